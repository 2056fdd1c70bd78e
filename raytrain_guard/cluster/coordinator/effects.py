"""Whether a decision did what it was priced to do (docs/cluster.md, "The coordinator").

A measured action is measured once every rank has reported ``decision_cooldown_steps`` steps
after its apply step, against as many steps before it was decided, and judged against its
prediction (:func:`~raytrain_guard.core.effects.judge`). A miss goes into the policy's
``missed`` set (not repeated for that cause); a cache release that hit re-arms releases."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from raytrain_guard.cluster.coordinator.reports import NodeSamples, RankWindow
from raytrain_guard.config import GuardConfig
from raytrain_guard.core.columns import StepColumns
from raytrain_guard.core.decisions import Action, Decision
from raytrain_guard.core.effects import Verdict, judge, measure
from raytrain_guard.core.view import ClusterView, PolicyState, missed_key
from raytrain_guard.errors import check_int

logger = logging.getLogger(__name__)

MEASURED_ACTIONS = (Action.RELEASE_CACHE, Action.SHRINK_MICRO_BATCH, Action.SET_PREFETCH,
                    Action.PACE)


@dataclasses.dataclass(slots=True)
class PendingEffect:
    """A decision waiting for its effect: the steps before it per rank, the node's host memory
    fraction when decided (host actions), and the step the ranks applied it at (once known)."""

    decision: Decision
    before: dict[int, StepColumns]
    host_before: float | None
    node_id: str | None
    applied_at: int | None = None


class EffectMeter:
    """The measured actions decided and not measured yet, by decision id (``pending``)."""

    def __init__(self, run_id: str, config: GuardConfig) -> None:
        self.run_id = run_id
        self.config = config
        self.pending: dict[int, PendingEffect] = {}

    def clear(self) -> None:
        """A new attempt: what the old one decided is not measured."""
        self.pending.clear()

    def track(self, d: Decision, ranks: Mapping[int, RankWindow], view: ClusterView) -> None:
        """A new decision: keep the steps before it, when its action is measured."""
        if d.action not in MEASURED_ACTIONS or d.step is None:
            return
        n = self.config.decision_cooldown_steps
        before = {r: e.columns.span(-n, None) for r, e in ranks.items()}
        node_id = d.scope.split(":", 1)[1] if d.scope.startswith("node:") else None
        host = view.nodes.get(node_id).host if node_id in view.nodes else None
        self.pending[d.decision_id] = PendingEffect(
            d, before, None if host is None else host.memory_used_frac, node_id)

    def applied(self, pairs: Sequence[Sequence[int]], state: PolicyState
                ) -> tuple[PolicyState, list[Any]]:
        """A rank's ``(step, decision id)`` pairs applied: each decision's effect, and the
        policy's cooldown for its action, count from the first such step. Returns ``state`` so
        changed, and the unreadable pairs."""
        bad = []
        for pair in pairs:
            try:
                step, decision_id = check_int("step", pair[0]), check_int("decision_id", pair[1])
            except Exception:  # noqa: BLE001 - an unreadable pair is dropped
                bad.append(pair)
                continue
            pending = self.pending.get(decision_id)
            if pending is not None and pending.applied_at is None:
                pending.applied_at = step
                state = _cooldown_from(state, pending.decision, step)
        return state, bad

    def measure_due(self, ranks: Mapping[int, RankWindow], nodes: NodeSamples,
                    state: PolicyState) -> tuple[PolicyState, list[Decision]]:
        """Measure every pending action whose window after its apply step every rank has
        reported. Returns the policy state and the measured decisions, each with ``measured``
        set (its ``verdict``: hit, miss or not_judged)."""
        if not self.pending or not ranks:
            return state, []
        reported = min(e.last_step for e in ranks.values())
        n = self.config.decision_cooldown_steps
        done = []
        for decision_id in sorted(self.pending):
            pending = self.pending[decision_id]
            d, start = pending.decision, pending.applied_at
            if start is None or reported < start + n:    # not applied, or its steps not in
                continue
            del self.pending[decision_id]
            after = {r: e.columns.after(start, start + n) for r, e in ranks.items()}
            host = (None, None)
            sample = nodes.sample(pending.node_id) if pending.node_id is not None else None
            if pending.host_before is not None and sample is not None and sample.host is not None:
                host = (pending.host_before, sample.host.memory_used_frac)
            try:
                result = measure(pending.before, after, host)
                verdict = judge(d.predicted, result, self.config.effect_min_share)
            except Exception:   # one bad record costs its own measurement only
                logger.exception("[run %s] decision #%d: effect not measured", self.run_id,
                                 d.decision_id)
                continue
            if result is None:
                continue
            done.append(dataclasses.replace(
                d, measured=dict(result.to_dict(), verdict=verdict.value, applied_at=start)))
            if d.action is Action.RELEASE_CACHE and verdict is Verdict.HIT:
                state = dataclasses.replace(state, release_armed=True)
            if verdict is Verdict.MISS:
                key = missed_key(d.action, d.cause, d.scope)
                state = dataclasses.replace(state, missed=state.missed | {key})
                logger.warning("[run %s] decision #%d %s missed its prediction (memory "
                               "%+.1f%% measured vs %+.1f%% predicted): not repeated for %s",
                               self.run_id, d.decision_id, d.action.value,
                               100 * (result.delta_frac or 0.0),
                               100 * float(d.predicted["delta_frac"]), key)
        return state, done


def _cooldown_from(state: PolicyState, d: Decision, step: int) -> PolicyState:
    """``state`` with the cooldown of ``d``'s action counted from ``step`` when later."""
    def later(last: int | None) -> int:
        return step if last is None else max(last, step)

    if d.action is Action.SHRINK_MICRO_BATCH:
        return dataclasses.replace(state, last_shrink_step=later(state.last_shrink_step),
                                   last_release_step=later(state.last_release_step))
    if d.action is Action.RELEASE_CACHE:
        return dataclasses.replace(state, last_release_step=later(state.last_release_step))
    if d.action is Action.PACE:
        return dataclasses.replace(state, last_pace_step=later(state.last_pace_step))
    if d.action is Action.SET_PREFETCH and d.scope.startswith("node:"):
        node = d.scope.split(":", 1)[1]
        steps = dict(state.prefetch_steps)
        steps[node] = later(steps.get(node))
        return dataclasses.replace(state, prefetch_steps=steps)
    return state
