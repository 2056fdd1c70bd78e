"""The parts of the coordinator's ``status()`` (what ``raytrain-guard status`` prints and the run
summary reads)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from raytrain_guard.cluster.coordinator.reports import RankWindow
from raytrain_guard.core.decisions import Action, Decision
from raytrain_guard.core.node_samples import NodeSample
from raytrain_guard.core.stats import nearest_rank
from raytrain_guard.core.straggler import StragglerScore
from raytrain_guard.core.view import PolicyState

ACTIVE_DECISIONS_SHOWN = 20     # the newest decisions (and measured effects) listed


def figures(ranks: Mapping[int, RankWindow], nodes: Mapping[str, tuple[NodeSample, float]],
            scores: Mapping[int, StragglerScore], state: PolicyState,
            decisions: Sequence[Decision]) -> dict:
    """The status of the ranks, the nodes, the stragglers and the decisions."""
    latest = max((e.last_step for e in ranks.values()), default=None)
    p50, p99 = step_quantiles(ranks)
    flagged = state.flagged_nodes
    return {"latest_step": latest, "step_p50_s": p50, "step_p99_s": p99,
            "nodes": {n: node_status(s, n in flagged) for n, (s, _at) in nodes.items()},
            "ranks": {r: rank_status(ranks[r], scores.get(r)) for r in sorted(ranks)},
            "straggler_scores": {r: s.to_dict() for r, s in sorted(scores.items())},
            "straggler_nodes": sorted(flagged), "straggler_ranks": sorted(state.flagged_ranks),
            "effects": measured_decisions(decisions), "missed": sorted(state.missed),
            "active_decisions": active_decisions(decisions, latest)}


def node_status(sample: NodeSample, straggler: bool) -> dict:
    """A node's latest sample, with its memory fractions, throttling and straggler flag."""
    d = sample.to_dict()
    if sample.host is not None:
        d["host"]["memory_used_frac"] = round(sample.host.memory_used_frac, 4)
    for g, gd in zip(sample.gpus, d["gpus"]):
        gd["memory_frac"] = round(g.memory_frac, 4)
    d["throttled"] = any(g.is_throttled for g in sample.gpus)
    d["straggler"] = straggler
    return d


def rank_status(entry: RankWindow, score: StragglerScore | None) -> dict:
    """A rank's latest step, step time p50/p99 over its window, memory and straggler score."""
    c = entry.columns
    mem = c.latest_memory()
    return {"world_rank": entry.world_rank, "node_id": entry.node_id, "step": entry.last_step,
            "step_p50_s": quantile(c.total, 0.5), "step_p99_s": quantile(c.total, 0.99),
            "memory_frac": None if mem is None else mem[1],
            "straggler_score": None if score is None else round(score.excess_frac, 4),
            "straggler_cause": None if score is None else score.cause.value}


def active_decisions(decisions: Iterable[Decision], latest_step: int | None) -> list[dict]:
    """Decisions not yet past their step, and every stop and straggler flag: the newest."""
    horizon = latest_step if latest_step is not None else -1
    return [d.to_dict() for d in decisions
            if d.step is None or d.step >= horizon or d.action in
            (Action.CHECKPOINT_AND_STOP, Action.FLAG_STRAGGLER)][-ACTIVE_DECISIONS_SHOWN:]


def measured_decisions(decisions: Iterable[Decision]) -> list[dict]:
    """The newest decisions whose effect was measured."""
    return [d.to_dict() for d in decisions if d.measured is not None][-ACTIVE_DECISIONS_SHOWN:]


def step_quantiles(ranks: Mapping[int, RankWindow]) -> tuple[float | None, float | None]:
    """Step time p50 and p99 over every step in the ranks' windows."""
    totals = [t for e in ranks.values() for t in e.columns.total]
    return quantile(totals, 0.5), quantile(totals, 0.99)


def round_step_quantiles(ranks: Mapping[int, RankWindow]) -> tuple[float | None, float | None]:
    """For the per-round gauges, in O(ranks): the median of the ranks' median step and the
    99th percentile of their p99s (:func:`step_quantiles`: exact, over every step)."""
    views = [e.view.timing for e in ranks.values() if e.view is not None]
    return (quantile([t.total_s for t in views], 0.5),
            quantile([t.total_p99_s for t in views], 0.99))


def quantile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile, None when empty."""
    return nearest_rank(sorted(values), q) if values else None
