"""The drop-in's step boundary: where the optimizer has stepped, one rank's decisions and the
stop every rank agrees on.

At each step end: the :class:`~raytrain_guard.runtime.step_guard.StepGuard`'s own decisions
(timings, memory watermark, slow steps), the cluster's through the decision source (lockstep
every ``lockstep_every_steps``) and the stop flag on the shared control plane
(:mod:`raytrain_guard.runtime.control_plane`): a ``checkpoint_and_stop`` from any rank's gate,
from :meth:`StepBoundary.request_stop` on any rank or from the coordinator stops every rank at
the same step. No RPC: the source's poll and the agreement round are the only exchanges, and
they run at the same steps on every rank.
"""

from __future__ import annotations

import logging
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Cause, Decision, due_at
from raytrain_guard.runtime.fail_open import FailOpen

logger = logging.getLogger(__name__)

OTHER_RANK_STOP = "another rank asked to checkpoint and stop"


class StepBoundary:
    """One rank's step count, decisions and stop. ``source``: the cluster's decisions (None: the
    local gate only); ``metrics``: the rank's gauges (None: none); ``loader``: the training
    loader that ``set_prefetch`` acts on, once there is one."""

    def __init__(self, config: GuardConfig, *, world_rank: int, node_id: str, step_guard: Any,
                 control: Any, source: Any, metrics: Any, fail_open: FailOpen) -> None:
        self.config = config
        self.rank = world_rank
        self.node_id = node_id
        self.step_guard = step_guard
        self.control = control
        self.source = source
        self.metrics = metrics
        self.loader: Any = None
        self._fail_open = fail_open
        self.step = 0
        self.stop_reason: str | None = None
        self.stopped_at: int | None = None
        self.checkpoint_now = False
        self.now: list[Decision] = []          # applied at the latest boundary
        self.pending: list[Decision] = []      # from the source, due at a later step
        self.decision_log: list[dict[str, Any]] = []
        self._local_stop: Decision | None = None
        self._every = (config.report_every_steps, config.lockstep_every_steps)

    def end_step(self) -> None:
        """The optimizer has stepped: the step guard ends step ``step``, then the boundary."""
        step = self.step
        try:
            local = self.step_guard.end_step(step)
        except Exception:  # noqa: BLE001 - fail open
            self._fail_open.note("end_step")
            local = []
        self.step = step + 1
        self._at(self.step, local)

    def request_stop(self, reason: str) -> None:
        """Carried by the next agreement round, after which every rank stops."""
        if self._local_stop is None:
            self._local_stop = Decision(Action.CHECKPOINT_AND_STOP,
                                        f"stop requested on rank {self.rank}: {reason}",
                                        cause=Cause.UNKNOWN, scope="rank")
            self._record(self.step, self._local_stop)

    def _at(self, step: int, local: list[Decision]) -> None:
        """After ``step`` steps: local decisions, the cluster's (lockstep), the stop agreement.
        The collectives run on every rank at the same steps (they depend on ``step`` only)."""
        now: list[Decision] = []
        self.checkpoint_now = False
        for decision in local:
            self._record(step, decision)
            now.append(decision)
            if decision.action is Action.CHECKPOINT_AND_STOP and self._local_stop is None:
                self._local_stop = decision
        stats = self.step_guard.drain_stats() if self._stats_due(step, local) else []
        if stats and self.metrics is not None:
            self._fail_open.call("metrics", self.metrics.record, stats)
        control = self.control
        control.local_stop = self._local_stop is not None      # rides on a lockstep round
        rounds_before = control.num_rounds
        polled = self.source.poll(step, stats) if self.source is not None else ()
        due, self.pending = due_at(step, self.pending, polled)
        stop = None
        for decision in due:
            mine = decision.concerns(self.node_id)
            self._record(step, decision, applied=mine)
            if mine:
                self._apply(decision)
                now.append(decision)
            if decision.action is Action.CHECKPOINT_AND_STOP and stop is None:
                stop = decision.reason
        if stop is None and control.stop_agreed(
                rounds_before, check_now=step % self.config.lockstep_every_steps == 0):
            stop = self._local_stop.reason if self._local_stop is not None \
                else OTHER_RANK_STOP
        if stop is not None and self.stop_reason is None:
            self.stop_reason, self.stopped_at = stop, step
            self.checkpoint_now = True
            logger.warning("rank %d: checkpoint and stop at step %d: %s", self.rank, step, stop)
        self.now = now

    def _stats_due(self, step: int, local: list[Decision]) -> bool:
        if local or any(step % every == 0 for every in self._every):
            return True
        return any(d.step is not None and d.step <= step for d in self.pending)

    def _apply(self, decision: Decision) -> None:
        """Apply what the guard can apply itself; the rest is the loop's (``decisions()``)."""
        from raytrain_guard.runtime.cache_release import release_cache

        action, safe = decision.action, self._fail_open.call
        if action is Action.RELEASE_CACHE:    # one spacing with the gate's own releases
            safe("release_cache", lambda: self.step_guard.gate.claim_release() and release_cache())
        elif action is Action.PACE:
            safe("pace", self.step_guard.set_pace, decision.params.get("delay_s", 0.0))
        elif action is Action.SET_PREFETCH and self.loader is not None:
            if "prefetch_factor" in decision.params:
                safe("set_prefetch", self.loader.request_prefetch_factor,
                     decision.params["prefetch_factor"])
            if "device_prefetch_depth" in decision.params:
                safe("set_prefetch", self.loader.set_device_prefetch_depth,
                     int(decision.params["device_prefetch_depth"]))
        elif action is Action.CHECKPOINT:
            self.checkpoint_now = True
        elif action is Action.SHRINK_MICRO_BATCH:
            logger.warning("rank %d: %s: the loop owns its batch size; see get_guard()."
                           "decisions()", self.rank, decision)

    def _record(self, step: int, decision: Decision, *, applied: bool = True) -> None:
        entry = decision.to_dict()
        entry.update(applied_at=step, world_rank=self.rank, applied=applied)
        self.decision_log.append(entry)
        if applied and self.metrics is not None:
            self._fail_open.call("metrics", self.metrics.record_decision, decision)
