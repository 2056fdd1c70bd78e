"""The drop-in's summary: one rank's figures, the run's from every rank's, and the last report
to the coordinator."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from raytrain_guard.coordination.client import coordinator_name
from raytrain_guard.core.gate import attribute_across_ranks
from raytrain_guard.core.steps import StepStats
from raytrain_guard.runtime.guard.boundary import OTHER_RANK_STOP


def rank_summary(*, world_rank: int, step: int, window: Iterable[StepStats], loader: Any,
                 decisions: list[dict[str, Any]], model_plan: Mapping[str, Any],
                 stop_reason: str | None, stopped_at: int | None) -> dict[str, Any]:
    """One rank's figures (JSON-able): its step window, decisions, loader settings and data
    wait (``loader``: the training loader or None), stop."""
    loader_figures = None
    if loader is not None:
        stats = loader.stats()
        loader_figures = {**loader.settings(),
                          "data_wait_frac": round(stats["data_wait_frac"], 4),
                          "data_wait_total_s": round(stats["data_wait_total_s"], 4),
                          "batches": stats["batches"]}
    return {"world_rank": world_rank, "step": step, "window": [s.to_dict() for s in window],
            "decisions": list(decisions), "loader": loader_figures, "model": dict(model_plan),
            "stop_reason": stop_reason, "stopped_at": stopped_at}


def combine_summaries(per_rank: list[Mapping[str, Any]], *,
                      straggler_frac: float) -> dict[str, Any]:
    """Every rank's :func:`rank_summary` -> the run's (pure but for StepStats): attribution
    across ranks, data wait and loader settings per rank, every decision, the stop (a rank that
    only heard of it learns whose it was)."""
    ranks = sorted(per_rank, key=lambda r: r.get("world_rank", 0))
    windows = [[StepStats.from_dict(s) for s in r.get("window") or ()] for r in ranks]
    attribution = [{"world_rank": a.world_rank, "role": a.role.value, "reason": a.reason}
                   for a in attribute_across_ranks(windows, straggler_frac=straggler_frac)]
    decisions = [d for r in ranks for d in r.get("decisions") or ()]
    reasons = [r.get("stop_reason") for r in ranks if r.get("stop_reason")]
    own = [x for x in reasons if x != OTHER_RANK_STOP]
    return {"world_size": len(ranks), "steps": max((r.get("step", 0) for r in ranks), default=0),
            "stopped_early": bool(reasons), "stop_reason": (own or reasons or [None])[0],
            "stopped_at": sorted({r.get("stopped_at") for r in ranks if r.get("stopped_at")
                                  is not None}),
            "attribution": attribution,
            "data_wait_frac": {r.get("world_rank", 0): (r.get("loader") or {}).get(
                "data_wait_frac") for r in ranks},
            "loader": [r.get("loader") for r in ranks],
            "model": ranks[0].get("model") if ranks else {},
            "decisions": decisions}


def report_summary(run_id: str, namespace: str | None, world_rank: int,
                   summary: Mapping[str, Any]) -> None:
    """The one function that touches ``ray.get`` (at the end of the run, with a timeout): this
    rank's summary to the run's coordinator."""
    import ray
    handle = ray.get_actor(coordinator_name(run_id), namespace=namespace)
    ray.get(handle.report_summary.remote(world_rank, summary), timeout=10)
