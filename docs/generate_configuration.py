"""Write docs/configuration.md from GuardConfig's field metadata.

    python docs/generate_configuration.py

tests/test_cli_plan.py fails when the file and the metadata differ.
"""

import dataclasses
from pathlib import Path

from raytrain_guard.config import GuardConfig

HEADER = """# Configuration reference

<!-- Generated from GuardConfig's field metadata (raytrain_guard/config.py); do not edit by hand.
     Regenerate with: python docs/generate_configuration.py -->

One frozen, validated `GuardConfig` holds every threshold. In Python:
`GuardConfig(headroom_frac=0.2)`; in a train loop config: `"guard": {"headroom_frac": 0.2}`; on
the command line: `raytrain-guard plan --config FILE.toml`.

A TOML file holds top-level keys or a `[raytrain_guard]` table, not both (top-level keys next to
the table are bad input: they would not be read; other tables, such as another tool's, may sit
next to it). Unknown keys, out-of-range values and unreadable files are bad input naming the
file, the key and the fix. TOML has no null: leave a key out for its default `none`.

```toml
[raytrain_guard]
headroom_frac = 0.2
host_prefetch_frac = 0.05
target_num_buckets = 8
```

Every key, its default and the rule it comes from (the measurements behind the measured
defaults: [benchmarks.md](benchmarks.md#where-the-defaults-come-from)):
"""


def markdown() -> str:
    """docs/configuration.md: every GuardConfig key with its default and its rule."""
    lines = [HEADER, "| key | default | rule |", "|---|---|---|"]
    for f in dataclasses.fields(GuardConfig):
        default = "none" if f.default is None else str(f.default).lower() \
            if isinstance(f.default, bool) else f"{f.default}"
        doc = " ".join(f.metadata.get("doc", "").split()).replace("|", "\\|")
        lines.append(f"| `{f.name}` | `{default}` | {doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    path = Path(__file__).resolve().parent / "configuration.md"
    path.write_text(markdown())
    print(f"wrote {path}")
