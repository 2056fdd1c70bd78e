"""The step gate fed in batches: StepGuard's fast path for host timers.

A step that cannot decide anything (under the gate's quiet bounds, :meth:`StepGate.quiet_limits`,
or over the time bound without completing a run of ``num_slow_steps``) waits here as its timer
record and reaches the gate with the next batch (every ``gate_batch_steps`` steps, or as soon as
a step may decide something): the same decisions at the same steps as a gate fed every step,
for a fraction of the cost (docs/train_loop.md, "The step guard").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Decision
from raytrain_guard.core.steps import StepStats
from raytrain_guard.runtime.guard.fail_open import FailOpen
from raytrain_guard.runtime.guard.timing import StepTimer

Apply = Callable[[list[Decision]], list[Decision]]


class GateFeed:
    """The gate of one worker and the steps waiting for it. ``timer``: where the steps come
    from; ``apply``: applies decisions locally and returns them, in the order the gate
    decides; ``fast``: batch the steps (a host timer) or feed each at once."""

    def __init__(self, gate: Any, config: GuardConfig, *, timer: StepTimer, world_rank: int,
                 apply: Apply, fail_open: FailOpen, fast: bool) -> None:
        self._gate = gate
        self.timer = timer
        self.world_rank = world_rank
        self.fast = fast
        self._apply = apply
        self._fail_open = fail_open
        self._stats: deque[StepStats] = deque(maxlen=max(config.step_window,
                                                         config.report_every_steps))
        self._buffer: list[tuple[Any, float | None, float | None]] = []   # (timer record,
                                                     # memory fraction, cached fraction)
        self._built: list[StepStats | None] = []     # StepStats drain_stats built already
        self._late: list[Decision] = []              # decided by a flush outside end_step
        self._horizon = min(config.gate_batch_steps, max(1, config.step_window // 2 - 5))
        self._num_slow = config.num_slow_steps
        self._quiet_s: tuple[float, ...] = ()    # the gate's quiet bound of each waiting
        self._quiet_frac = float("-inf")         # step; none: every step goes to the gate
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
        return bool(self._quiet_s) and self._quiet_s[0] > 0

    def end_step(self, step: int, frac: float | None,
                 cached: float | None = None) -> list[Decision]:
        """Step ``step`` ended with memory fraction ``frac``, ``cached`` of it cached but
        unallocated (None: not known): feed the gate, now or with the next batch, and return
        the decisions applied."""
        if not self.fast:
            try:
                stats = self.timer.finish_step(step, memory_frac=frac)
            except Exception:  # noqa: BLE001 - the guard fails open
                self._fail_open.note("timer")
                stats = None
            return self._observe(stats, step, frac, cached)
        try:
            record, total_s = self.timer.close_step(step)
        except Exception:  # noqa: BLE001
            self._fail_open.note("timer")
            return self.flush() + self._observe(None, step, frac, cached)
        buffer, bounds = self._buffer, self._quiet_s
        buffer.append((record, frac, cached))
        if len(buffer) > len(bounds):
            return self.flush()                  # no bound for it: the batch is full
        if total_s <= bounds[len(buffer) - 1]:
            self._over = 0                       # a quiet step ends any run of slow ones
        else:
            self._fail_open.call("timer", self.timer.publish_work, record)   # may be judged
            # over its bound: it waits unless it could complete a run of slow steps
            self._over += 1
            if self._over + (self._run0 if self._over == len(buffer) else 0) >= self._num_slow:
                return self.flush()
        if (frac is None or frac < self._quiet_frac) and len(buffer) < len(bounds) \
                and not self._late:
            return []
        return self.flush()

    def note_reshaped(self, step: int) -> None:
        """The gate leaves ``step`` out of its slow-step rules (:meth:`StepGate.note_reshaped`:
        it keeps the step number until the step is fed), so the waiting steps stay waiting."""
        self._gate.note_reshaped(step)

    def flush(self) -> list[Decision]:
        """Feed the waiting steps to the gate in order, apply and return their decisions
        (with those a flush outside end_step left), then refresh the quiet bounds."""
        decisions, self._late = self._late, []
        buffer, self._buffer = self._buffer, []
        built, self._built = self._built, []
        for i, (record, frac, cached) in enumerate(buffer):
            if i < len(built):
                stats = built[i]                 # drained already: not kept again
            else:
                stats = self._fail_open.call("timer", self.timer.stats_of, record, frac)
                if stats is not None:
                    self._stats.append(stats)
            decisions += self._observe(stats, record.step, frac, cached, keep=False)
        self.refresh_bounds()
        return decisions

    def drain_stats(self) -> list[StepStats]:
        """The StepStats of the steps finished since the last drain (at most max(step_window,
        report_every_steps) fed to the gate, then those still waiting), oldest first. Waiting
        steps stay waiting (their StepStats are built now), so drains keep whole batches."""
        out = list(self._stats)
        self._stats.clear()
        if len(self._buffer) > len(self._built):
            fresh = [self._fail_open.call("timer", self.timer.stats_of, record, frac)
                     for record, frac, _ in self._buffer[len(self._built):]]
            self._built += fresh
            out += [s for s in fresh if s is not None]
        return out

    def refresh_bounds(self) -> None:
        """The gate's quiet bounds for the next ``gate_batch_steps`` steps (none: every step
        goes to the gate)."""
        try:
            limits = self._gate.quiet_limits(self._horizon)
            self._run0 = self._gate.slow_run_length
        except Exception:  # noqa: BLE001
            self._fail_open.note("gate")
            limits = None
        self._quiet_s, self._quiet_frac = limits if limits else ((), float("-inf"))
        self._over = 0

    def _observe(self, stats: StepStats | None, step: int, frac: float | None,
                 cached: float | None, keep: bool = True) -> list[Decision]:
        """Feed ``stats`` to the gate (the memory rules alone without them) and apply what it
        decides; ``keep``: keep them for :meth:`drain_stats`."""
        try:
            if stats is not None:
                if keep:
                    self._stats.append(stats)
                found = self._gate.observe(stats, cached_frac=cached)
            elif frac is not None:
                found = self._gate.observe_memory(step, frac, world_rank=self.world_rank,
                                                  cached_frac=cached)
            else:
                found = []
        except Exception:  # noqa: BLE001
            self._fail_open.note("gate")
            found = []
        return self._apply(found)

    def _sync(self) -> None:
        """Feed the waiting steps now (before the gate or the stats are read); their
        decisions, if any, come with the next end_step."""
        if self._buffer:
            self._late = self.flush()
