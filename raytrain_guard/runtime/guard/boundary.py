"""The step boundary of the train loop and of the drop-in: after the optimizer has stepped, the
rank's own gate decisions, the cluster's (the decision source, in lockstep), the stop every rank
agrees on, and whether to checkpoint now.

A ``checkpoint_and_stop`` from any rank's gate, from :meth:`StepBoundary.request_stop` or from
the coordinator stops every rank at the same step: the stop flag rides on the control plane's
round (:mod:`raytrain_guard.coordination.control_plane`). No RPC: the source's poll and that
round are the only exchanges, at the same steps on every rank.

A stop agreed every ``stop_every`` steps lands up to that many steps after a gate decided it,
and memory that grows fast fills the card in fewer. So each round also asks whether any rank's
memory, on the line through its last readings, reaches ``memory_critical_frac`` within
``stop_every`` steps; if one does, the ranks agree on the stop at every step until a round
where none does. Such a round costs one small gloo all_reduce; a stop too late costs the steps
since the last checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Cause, Decision, due_at
from raytrain_guard.runtime.guard import cache_release
from raytrain_guard.runtime.guard.fail_open import FailOpen

logger = logging.getLogger(__name__)

OTHER_RANK_STOP = "another rank asked to checkpoint and stop"


class BoundaryActions:
    """What only the loop around a boundary can apply. This one is the drop-in's, for a loop the
    user wrote: it owns its batch size and its loader's workers; a prefetch change goes to
    ``loader`` once there is one."""

    def __init__(self, world_rank: int = 0) -> None:
        self.rank = world_rank
        self.loader: Any = None

    def set_prefetch(self, params: Mapping[str, Any]) -> None:
        if self.loader is not None:
            set_prefetch(self.loader, params)

    def shrink(self, step: int, decision: Decision) -> None:
        logger.warning("rank %d step %d: %s: the loop owns its batch size; see "
                       "get_guard().decisions()", self.rank, step, decision)

    def add_loader_workers(self, step: int, decision: Decision) -> None:
        """Slow steps caused by data: nothing (the user's loader keeps its workers)."""


def set_prefetch(loader: Any, params: Mapping[str, Any]) -> None:
    """A SET_PREFETCH decision's ``params`` on ``loader``."""
    if "prefetch_factor" in params:
        loader.request_prefetch_factor(params["prefetch_factor"])
    if "device_prefetch_depth" in params:
        loader.set_device_prefetch_depth(int(params["device_prefetch_depth"]))


class StepBoundary:
    """One rank's step boundary. ``source``: the cluster's decisions (None: the gate only).
    ``metrics``: the rank's gauges (None: none). ``actions``: what only the loop applies.
    ``act`` False (the experiment's observe arm): decisions are recorded, never applied.
    ``log``: where each decision's entry goes (``append``; default a list,
    :attr:`decision_log`). ``on_stats``: called with the StepStats read at a boundary.
    ``stop_every``: steps between stop agreements, default ``lockstep_every_steps`` so that the
    flag rides on the lockstep round (one collective, not two).
    """

    def __init__(self, config: GuardConfig, *, world_rank: int, node_id: str, step_guard: Any,
                 control: Any, source: Any, metrics: Any, actions: BoundaryActions,
                 fail_open: FailOpen, act: bool = True, stop_every: int | None = None,
                 log: Any = None, on_stats: Callable[[list], None] | None = None) -> None:
        self.config = config
        self.rank = world_rank
        self.node_id = node_id
        self.step_guard = step_guard
        self.control = control
        self.source = source
        self.metrics = metrics
        self.actions = actions
        self.act = act
        self.stop_every = stop_every or config.lockstep_every_steps
        self.decision_log = log if log is not None else []
        self._on_stats = on_stats
        self._fail_open = fail_open
        self.step = 0
        self.stop_reason: str | None = None
        self.stopped_at: int | None = None
        self.checkpoint_now = False
        self.now: list[Decision] = []          # applied at the latest boundary
        self.pending: list[Decision] = []      # from the source, due at a later step
        self._local_stop: Decision | None = None
        self._every = (config.report_every_steps, config.lockstep_every_steps, self.stop_every)

    def end_step(self) -> None:
        """The optimizer has stepped (the drop-in's hook): the step guard ends the step, then
        the boundary."""
        try:
            local = self.step_guard.end_step(self.step)
        except Exception:  # noqa: BLE001 - fail open
            self._fail_open.note("end_step")
            local = []
        self.at(self.step + 1, local)

    def request_stop(self, reason: str) -> None:
        """Carried by the next agreement round, after which every rank stops."""
        if self._local_stop is None:
            self._local_stop = Decision(Action.CHECKPOINT_AND_STOP,
                                        f"stop requested on rank {self.rank}: {reason}",
                                        cause=Cause.UNKNOWN, scope="rank")
            self._record(self.step, self._local_stop)

    def at(self, step: int, local: list[Decision], *, read_stats: bool = False) -> None:
        """After ``step`` steps: ``local`` (the gate's), the cluster's, the stop agreement.
        ``read_stats``: read the guard's StepStats whatever the cadence (the loop's last and
        checkpoint steps). The collectives run at the same steps on every rank."""
        self.step = step
        act = self.act
        now: list[Decision] = []
        self.checkpoint_now = False
        for decision in local:
            self._record(step, decision, applied=act or decision.action is Action.SLOW_STEP)
            if not act:
                continue
            now.append(decision)
            if decision.action is Action.CHECKPOINT_AND_STOP and self._local_stop is None:
                self._local_stop = decision
            elif decision.action is Action.SLOW_STEP and decision.cause is Cause.DATA:
                self._fail_open.call("loader_workers", self.actions.add_loader_workers, step,
                                     decision)
        stats = self.step_guard.drain_stats() if read_stats or self._stats_due(step, local) \
            else []
        if stats:
            self._took(stats)
        control = self.control
        control.local_stop = self._local_stop is not None      # rides on a lockstep round
        if act and (control.agreed_urgent or step % self.stop_every == 0
                    or step % self.config.lockstep_every_steps == 0):
            control.local_urgent = bool(self._fail_open.call("memory_ahead", self._urgent))
        urgent_before = control.agreed_urgent
        rounds_before = control.num_rounds
        polled = self.source.poll(step, stats) if self.source is not None else ()
        due, self.pending = due_at(step, self.pending, polled)
        stop = None
        for decision in due:
            mine = act and decision.concerns(self.node_id)
            self._record(step, decision, applied=mine)
            if mine:
                self._apply(step, decision)
                now.append(decision)
            if act and stop is None and decision.action is Action.CHECKPOINT_AND_STOP:
                stop = decision.reason
        if stop is None and control.stop_agreed(
                rounds_before, check_now=urgent_before or step % self.stop_every == 0):
            stop = self._local_stop.reason if self._local_stop is not None else OTHER_RANK_STOP
        if control.agreed_urgent != urgent_before and self.rank == 0:
            logger.info("step %d: %s", step, "a rank's memory may reach the critical line "
                        "before the next round: the stop is agreed every step"
                        if control.agreed_urgent else "the stop is agreed every "
                        f"{self.stop_every} steps again")
        if stop is not None and self.stop_reason is None:
            self.stop_reason, self.stopped_at = stop, step
            self.checkpoint_now = True
            logger.warning("rank %d: checkpoint and stop at step %d: %s", self.rank, step, stop)
        self.now = now

    def _urgent(self) -> bool:
        """Whether this rank's memory, on its trend, reaches the critical line within
        ``stop_every`` steps (before a stop agreed at the next regular round would land)."""
        ahead = self.step_guard.memory_ahead(self.stop_every)
        return ahead is not None and ahead >= self.config.memory_critical_frac

    def finish(self) -> list:
        """The run is over: the StepStats no boundary read (a stop between reads) go to the
        gauges and to the source's ``finish`` (the coordinator client's last, partial
        report). Returns them."""
        left = self._fail_open.call("finish", self.step_guard.drain_stats) or []
        if left:
            self._took(left)
        finish = getattr(self.source, "finish", None)
        if callable(finish):
            self._fail_open.call("finish", finish, left)
        return left

    def _stats_due(self, step: int, local: list[Decision]) -> bool:
        """Whether this boundary reads the guard's StepStats: where the gate decided, every
        ``report_every_steps``, at agreement steps and where a pending decision is due. A read
        does not feed the gate (:meth:`StepGuard.drain_stats`): its batches stay whole."""
        if local:
            return True
        for every in self._every:          # a loop, not any(): this runs every step
            if step % every == 0:
                return True
        return any(d.step is not None and d.step <= step for d in self.pending)

    def _took(self, stats: list) -> None:
        if self.metrics is not None:
            self._fail_open.call("metrics", self.metrics.record, stats)
        if self._on_stats is not None:
            self._on_stats(stats)

    def _apply(self, step: int, decision: Decision) -> None:
        """A cluster decision for this node's ranks; the loop's own go to ``actions``."""
        action, safe = decision.action, self._fail_open.call
        if action is Action.RELEASE_CACHE:
            if self.step_guard.gate.claim_release():    # one spacing with the gate's releases
                safe("release_cache", cache_release.release_cache)
            else:
                logger.info("rank %d: cluster release_cache skipped: a release ran less than "
                            "release_cache_min_interval_s (%g s) ago", self.rank,
                            self.config.release_cache_min_interval_s)
        elif action is Action.PACE:
            safe("pace", self.step_guard.set_pace, decision.params.get("delay_s", 0.0))
        elif action is Action.SET_PREFETCH:
            safe("set_prefetch", self.actions.set_prefetch, decision.params)
        elif action is Action.CHECKPOINT:
            self.checkpoint_now = True
        elif action is Action.SHRINK_MICRO_BATCH:
            safe("shrink", self.actions.shrink, step, decision)

    def _record(self, step: int, decision: Decision, *, applied: bool = True) -> None:
        """Log ``decision``; ``applied`` False: seen at ``step``, meant for another node's ranks
        or only observed."""
        entry = decision.to_dict()
        entry.update(applied_at=step, world_rank=self.rank, applied=applied)
        self.decision_log.append(entry)
        if applied and self.metrics is not None:
            self._fail_open.call("metrics", self.metrics.record_decision, decision)
