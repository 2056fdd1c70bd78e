"""What a Grafana dashboard model queries (for the dashboard tests)."""

from __future__ import annotations

import re
from typing import Any


def queried_metrics(model: dict[str, Any]) -> set[str]:
    """Every ``ray_raytrain_guard_*`` name a dashboard's queries (panels, annotations,
    variables) mention."""
    texts = [t["expr"] for p in model["panels"] for t in p.get("targets", ())]
    texts += [a["expr"] for a in model["annotations"]["list"]]
    texts += [v["definition"] for v in model["templating"]["list"] if "definition" in v]
    return {m for text in texts for m in re.findall(r"\bray_raytrain_guard_\w+", text)}
