"""The step gate fed in batches: StepGuard's fast path for host timers.

A step that cannot decide anything (under the gate's quiet bounds, :meth:`StepGate.quiet_limits`,
or over the time bound without completing a run of ``num_slow_steps``) waits here and reaches
the gate with the next batch (every ``gate_batch_steps`` steps, or as soon as a step may decide
something), so decisions come at the same step as with a gate fed every step, for a fraction of
the cost (docs/train_loop.md, "The step guard").
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Decision
from raytrain_guard.core.steps import StepStats
from raytrain_guard.runtime.fail_open import FailOpen

Apply = Callable[[list[Decision]], list[Decision]]


class GateFeed:
    """The gate of one worker and the steps waiting for it. ``timer``: the step timer the
    waiting records come from; ``apply``: applies decisions locally and returns them, called in
    the order the gate decides; ``fast``: batch the steps (a host timer) or feed each at once."""

    def __init__(self, gate: Any, config: GuardConfig, *, timer: Any, world_rank: int,
                 apply: Apply, fail_open: FailOpen, fast: bool) -> None:
        self._gate = gate
        self.timer = timer
        self.world_rank = world_rank
        self.fast = fast
        self._apply = apply
        self._fail_open = fail_open
        self._stats: deque[StepStats] = deque(maxlen=max(config.step_window,
                                                         config.report_every_steps))
        self._buffer: list[tuple[Any, float | None, float | None]] = []   # (step record,
                                                     # memory fraction, cached fraction)
        self._built: list[StepStats | None] = []     # StepStats drain_stats built already
        self._late: list[Decision] = []              # decided by a flush outside end_step
        self._horizon = min(config.gate_batch_steps, max(1, config.step_window // 2 - 5))
        self._num_slow = config.num_slow_steps
        self._quiet_s = -1.0           # the gate's quiet bounds; none yet: every step goes to it
        self._quiet_frac = float("-inf")
        self._over = 0                 # buffered steps over the time bound, in a row, at the end
        self._run0 = 0                 # the gate's run of slow steps when the buffer started

    @property
    def gate(self) -> Any:
        """The :class:`StepGate`, with every finished step fed to it."""
        self._sync()
        return self._gate

    @gate.setter
    def gate(self, gate: Any) -> None:
        self._sync()
        self._gate = gate
        self.refresh_bounds()

    @property
    def quiet(self) -> bool:
        """Whether the gate gave quiet bounds (then a far-below reading may be reused)."""
        return self._quiet_s > 0

    @property
    def num_waiting(self) -> int:
        """Finished steps waiting for the next batch."""
        return len(self._buffer)

    def end_step(self, step: int, frac: float | None,
                 cached: float | None = None) -> list[Decision]:
        """Step ``step`` ended with memory fraction ``frac``, ``cached`` of it cached but
        unallocated (None: not known): feed the gate (now, or with the next batch) and
        return the decisions applied."""
        if not self.fast:
            try:
                stats = self.timer.finish_step(step, memory_frac=frac)
            except Exception:  # noqa: BLE001 - the guard fails open
                self._fail_open.note("timer")
                stats = None
            return self._apply(self._observe(stats, step, frac, cached))
        try:
            record, total_s = self.timer.close_step(step)
        except Exception:  # noqa: BLE001
            self._fail_open.note("timer")
            decisions = self.flush()             # the gate sees the buffered steps first
            return decisions + self._apply(self._observe(None, step, frac, cached))
        self._buffer.append((record, frac, cached))
        if total_s <= self._quiet_s:
            self._over = 0                       # a quiet step ends any run of slow ones
            may_wait = True
        else:
            try:                                 # a step the gate may judge: its CPU wait
                self.timer.read_cpu_wait(record)
            except Exception:  # noqa: BLE001
                self._fail_open.note("timer")
            # over the bound: it waits unless it could complete a run of slow steps
            self._over += 1
            run = self._over + (self._run0 if self._over == len(self._buffer) else 0)
            may_wait = self._quiet_s >= 0 and run < self._num_slow
        if (may_wait and (frac is None or frac < self._quiet_frac)
                and len(self._buffer) < self._horizon and not self._late):
            return []
        return self.flush()

    def _observe(self, stats: StepStats | None, step: int, frac: float | None,
                 cached: float | None) -> list[Decision]:
        """Keep ``stats`` and feed them to the gate (the memory rules alone without stats)."""
        try:
            if stats is not None:
                stats = self._with_rank(stats)
                self._stats.append(stats)
                return self._gate.observe(stats, cached_frac=cached)
            if frac is not None:
                return self._gate.observe_memory(step, frac, world_rank=self.world_rank,
                                                 cached_frac=cached)
        except Exception:  # noqa: BLE001
            self._fail_open.note("gate")
        return []

    def flush(self) -> list[Decision]:
        """Feed the waiting steps to the gate in order, apply and return their decisions
        (with any a flush outside end_step left), then refresh the quiet bounds."""
        decisions, self._late = self._late, []
        buffer, self._buffer = self._buffer, []
        built, self._built = self._built, []
        for i, (record, frac, cached) in enumerate(buffer):
            if i < len(built):
                stats = built[i]                 # drained already: not kept again
            else:
                stats = self._stats_of(record, frac)
                if stats is not None:
                    self._stats.append(stats)
            if stats is None:                    # no timings: the memory rules alone
                decisions += self._apply(self._observe(None, record.step, frac, cached))
                continue
            try:
                found = self._gate.observe(stats, cached_frac=cached)
            except Exception:  # noqa: BLE001
                self._fail_open.note("gate")
                found = []
            decisions += self._apply(found)
        self.refresh_bounds()
        return decisions

    def drain_stats(self) -> list[StepStats]:
        """The StepStats of the steps finished since the last drain (at most max(step_window,
        report_every_steps) fed to the gate, and those still waiting for it), oldest first.
        Waiting steps stay waiting (their StepStats are built now and reach the gate with the
        next batch), so frequent drains keep whole batches."""
        out = list(self._stats)
        self._stats.clear()
        if len(self._buffer) > len(self._built):
            fresh = [self._stats_of(record, frac)
                     for record, frac, _ in self._buffer[len(self._built):]]
            self._built += fresh
            out += [s for s in fresh if s is not None]
        return out

    def refresh_bounds(self) -> None:
        """The gate's quiet bounds for the next ``gate_batch_steps`` steps (none: every
        step goes to the gate, as for a gate without :meth:`StepGate.quiet_limits`)."""
        limits = None
        quiet_limits = getattr(self._gate, "quiet_limits", None)
        if quiet_limits is not None:
            try:
                limits = quiet_limits(self._horizon)
            except Exception:  # noqa: BLE001
                self._fail_open.note("gate")
        self._quiet_s, self._quiet_frac = limits if limits else (-1.0, float("-inf"))
        self._over = 0
        try:
            self._run0 = int(getattr(self._gate, "slow_run_length", self._num_slow))
        except Exception:  # noqa: BLE001 - a gate without it: every step over the bound flushes
            self._run0 = self._num_slow

    def _stats_of(self, record: Any, frac: float | None) -> StepStats | None:
        """A waiting step's StepStats, with this worker's rank (None: the timer failed)."""
        try:
            return self._with_rank(self.timer.stats_of(record, frac))
        except Exception:  # noqa: BLE001
            self._fail_open.note("timer")
            return None

    def _with_rank(self, stats: StepStats) -> StepStats:
        if stats.world_rank == self.world_rank:
            return stats
        return dataclasses.replace(stats, world_rank=self.world_rank)

    def _sync(self) -> None:
        """Feed the waiting steps now (before the gate or the stats are read); their
        decisions, if any, come with the next end_step."""
        if self._buffer:
            self._late = self.flush()
