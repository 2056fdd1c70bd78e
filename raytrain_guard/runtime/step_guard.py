"""The per-worker step guard: a step timer, a memory probe and the step gate, with the local
actions (release cached memory, pacing) applied. Per step: a few clock reads, one probe read,
the pure gate; no RPC, no NVML, no device synchronization. Use and cost: docs/train_loop.md,
"The step guard".
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Cause, Decision
from raytrain_guard.core.gate import StepGate
from raytrain_guard.core.steps import StepStats
from raytrain_guard.errors import InputError
from raytrain_guard.runtime.cache_release import release_cache
from raytrain_guard.runtime.fail_open import FailOpen
from raytrain_guard.runtime.memory_reads import MemoryReads
from raytrain_guard.runtime.timing import StepTimer

logger = logging.getLogger(__name__)

__all__ = ["StepGuard"]


class StepGuard:
    """Joins a :class:`StepTimer`, a memory probe and a :class:`StepGate` for one worker.

    ``probe``: anything with ``read() -> MemoryReading`` (None: timing rules only).
    ``timer``: defaults to a host-clock :class:`StepTimer`. ``clock``: the gate's clock.
    ``on_decision``: called with every decision after it was applied locally.
    ``fault_injector``: a :class:`~raytrain_guard.runtime.probes.FaultInjector` whose delays
    run at the matching :meth:`mark`. ``sleep``: used for pacing (tests pass a fake).

    Host timers take a fast path: a step that cannot decide anything (under the gate's
    quiet bounds, :meth:`StepGate.quiet_limits`, or over the time bound without completing a
    run of ``num_slow_steps``) waits in a buffer and reaches the gate with the next batch
    (every ``gate_batch_steps`` steps, or as soon as a step may decide something), so
    decisions come at the same step as with a gate fed every step, for a fraction of the
    cost. Reading :attr:`gate`, :meth:`drain_stats` or :meth:`state_dict` sees every step.
    """

    def __init__(self, config: GuardConfig, *, probe: Any = None, timer: StepTimer | None = None,
                 clock: Callable[[], float] = time.monotonic, world_rank: int = 0,
                 on_decision: Callable[[Decision], None] | None = None,
                 fault_injector: Any = None,
                 sleep: Callable[[float], None] = time.sleep, act: bool = True) -> None:
        self.config = config
        self.act = act      # False: decide and log, apply nothing (the experiment's observe arm)
        self.probe = probe
        self.timer = timer if timer is not None else StepTimer(world_rank=world_rank)
        self.world_rank = world_rank
        self._gate: Any = StepGate(config, clock=clock,
                                   memory_cause=getattr(probe, "cause", Cause.DEVICE_MEMORY))
        self.on_decision = on_decision
        self.fault_injector = fault_injector
        self._sleep = sleep
        self._pace_delay_s = 0.0
        self._step = 0                 # the step now running (the next one after end_step)
        self._stats: deque[StepStats] = deque(maxlen=max(config.step_window,
                                                         config.report_every_steps))
        self._fail_open = FailOpen(logger, lambda: f"rank {self.world_rank} step {self._step}")
        #: whether a loader opens the steps and times their data phase (:meth:`attach_loader`):
        #: the loop then calls neither :meth:`begin_step` nor ``mark("data")``
        self.loader_attached = False
        # the fast path (host timers only; see the class doc)
        self._fast = bool(getattr(self.timer, "on_host", False))
        self._buffer: list[tuple[Any, float | None]] = []   # (step record, memory fraction)
        self._built: list[StepStats | None] = []     # StepStats drain_stats built already
        self._late: list[Decision] = []              # decided by a flush outside end_step
        self._horizon = min(config.gate_batch_steps, max(1, config.step_window // 2 - 5))
        self._num_slow = config.num_slow_steps
        self._quiet_s = -1.0           # the gate's quiet bounds; none yet: every step goes to it
        self._quiet_frac = float("-inf")
        self._over = 0                 # buffered steps over the time bound, in a row, at the end
        self._run0 = 0                 # the gate's run of slow steps when the buffer started
        self._memory = MemoryReads(probe, config, reuse=self._fast)

    # -- the step ----------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Start ``step``: pace first when pacing is on, then start the timer."""
        self._step = step
        if self._pace_delay_s > 0:
            self._sleep(self._pace_delay_s)
        self.timer.begin_step(step)

    def mark(self, phase: str) -> None:
        """End ``phase`` now (see :meth:`StepTimer.mark`), after the injected delays."""
        if self.fault_injector is not None:
            self.fault_injector.on_mark(self._step, phase)
        self.timer.mark(phase)

    @contextlib.contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        """``with guard.phase("forward"): ...``"""
        with self.timer.phase(phase):
            yield
            if self.fault_injector is not None:
                self.fault_injector.on_mark(self._step, phase)

    def end_step(self, step: int) -> list[Decision]:
        """Finish ``step``: read the probe, time the step, feed the gate, apply local actions
        (RELEASE_CACHE, PACE) and return every decision. CHECKPOINT_AND_STOP and SLOW_STEP
        are the caller's. On CUDA the timings belong to an earlier step (see StepTimer).
        With a fault injector, its ``optimizer`` delays run here when the loop did not mark
        ``optimizer`` (the time since the backward mark is the optimizer's)."""
        if self.fault_injector is not None and self.timer.pending_phase == "optimizer":
            self.fault_injector.on_mark(step, "optimizer")
        try:
            frac = self._memory.read(may_reuse=self._quiet_s > 0)
        except Exception:  # noqa: BLE001 - the guard fails open
            self._failed_once("probe")
            frac = None
        if self._fast:
            decisions = self._end_host_step(step, frac)
        else:
            try:
                stats = self.timer.finish_step(step, memory_frac=frac)
            except Exception:  # noqa: BLE001
                self._failed_once("timer")
                stats = None
            decisions = self._applied(self._observe(stats, step, frac))
        self._step = step + 1
        return decisions

    def _end_host_step(self, step: int, frac: float | None) -> list[Decision]:
        """The fast path: buffer the step, and feed the gate only when it may decide."""
        try:
            record, total_s = self.timer.close_step(step)
        except Exception:  # noqa: BLE001
            self._failed_once("timer")
            decisions = self._flush()            # the gate sees the buffered steps first
            return decisions + self._applied(self._observe(None, step, frac))
        self._buffer.append((record, frac))
        if total_s <= self._quiet_s:
            self._over = 0                       # a quiet step ends any run of slow ones
            may_wait = True
        else:
            # over the bound: it waits unless it could complete a run of slow steps
            self._over += 1
            run = self._over + (self._run0 if self._over == len(self._buffer) else 0)
            may_wait = self._quiet_s >= 0 and run < self._num_slow
        if (may_wait and (frac is None or frac < self._quiet_frac)
                and len(self._buffer) < self._horizon and not self._late):
            return []
        return self._flush()

    def _observe(self, stats: StepStats | None, step: int,
                 frac: float | None) -> list[Decision]:
        """Keep ``stats`` and feed them to the gate (the memory rules alone without stats)."""
        try:
            if stats is not None:
                stats = self._with_rank(stats)
                self._stats.append(stats)
                return self._gate.observe(stats)
            if frac is not None:
                return self._gate.observe_memory(step, frac, world_rank=self.world_rank)
        except Exception:  # noqa: BLE001
            self._failed_once("gate")
        return []

    def _flush(self) -> list[Decision]:
        """Feed the buffered steps to the gate in order, apply and return their decisions
        (with any a flush outside end_step left), then refresh the quiet bounds."""
        decisions, self._late = self._late, []
        buffer, self._buffer = self._buffer, []
        built, self._built = self._built, []
        for i, (record, frac) in enumerate(buffer):
            if i < len(built):
                stats = built[i]                 # drained already: not kept again
            else:
                stats = self._stats_of(record, frac)
                if stats is not None:
                    self._stats.append(stats)
            if stats is None:                    # no timings: the memory rules alone
                decisions += self._applied(self._observe(None, record.step, frac))
                continue
            try:
                found = self._gate.observe(stats)
            except Exception:  # noqa: BLE001
                self._failed_once("gate")
                found = []
            decisions += self._applied(found)
        self._refresh_bounds()
        return decisions

    def _stats_of(self, record: Any, frac: float | None) -> StepStats | None:
        """A buffered step's StepStats, with this guard's rank (None: the timer failed)."""
        try:
            return self._with_rank(self.timer.stats_of(record, frac))
        except Exception:  # noqa: BLE001
            self._failed_once("timer")
            return None

    def _with_rank(self, stats: StepStats) -> StepStats:
        if stats.world_rank == self.world_rank:
            return stats
        return dataclasses.replace(stats, world_rank=self.world_rank)

    def _refresh_bounds(self) -> None:
        """The gate's quiet bounds for the next ``gate_batch_steps`` steps (none: every
        step goes to the gate, as for a gate without :meth:`StepGate.quiet_limits`)."""
        limits = None
        quiet_limits = getattr(self._gate, "quiet_limits", None)
        if quiet_limits is not None:
            try:
                limits = quiet_limits(self._horizon)
            except Exception:  # noqa: BLE001
                self._failed_once("gate")
        self._quiet_s, self._quiet_frac = limits if limits else (-1.0, float("-inf"))
        self._over = 0
        try:
            self._run0 = int(getattr(self._gate, "slow_run_length", self._num_slow))
        except Exception:  # noqa: BLE001 - a gate without it: every step over the bound flushes
            self._run0 = self._num_slow

    def _sync(self) -> None:
        """Feed the buffered steps now (before the gate or the stats are read); their
        decisions, if any, come with the next end_step."""
        if self._buffer:
            self._late = self._flush()

    @property
    def gate(self) -> Any:
        """The :class:`StepGate`, with every finished step fed to it."""
        self._sync()
        return self._gate

    @gate.setter
    def gate(self, gate: Any) -> None:
        self._sync()
        self._gate = gate
        self._refresh_bounds()

    def drain_stats(self) -> list[StepStats]:
        """The StepStats of the steps finished since the last drain (at most max(step_window,
        report_every_steps) fed to the gate, and those still waiting for it), oldest first,
        for a batch to the coordinator. Waiting steps stay waiting (their StepStats are built
        now and reach the gate with the next batch), so frequent drains keep whole batches."""
        out = list(self._stats)
        self._stats.clear()
        if len(self._buffer) > len(self._built):
            fresh = [self._stats_of(record, frac)
                     for record, frac in self._buffer[len(self._built):]]
            self._built += fresh
            out += [s for s in fresh if s is not None]
        return out

    # -- pacing and an attached loader ---------------------------------------------------------
    @property
    def pace_delay_s(self) -> float:
        """The pacing sleep now applied before each step (0: not pacing)."""
        return self._pace_delay_s

    def set_pace(self, delay_s: float) -> None:
        """Sleep ``delay_s`` before each step from the next one on (0 stops pacing): what a
        PACE decision does, from the local gate or from the cluster layer."""
        delay = float(delay_s)
        if not delay >= 0:
            raise InputError("params['delay_s']", "must be a number >= 0", value=delay_s,
                             fix="pass the pacing sleep in seconds, 0 to stop pacing")
        self._pace_delay_s = delay

    def attach_loader(self, loader: Any) -> bool:
        """Let ``loader`` (a :class:`~raytrain_guard.runtime.loader.GuardedDataLoader`) open
        each step where the loop starts fetching its first batch (:meth:`begin_step`, pacing
        included) and end the ``data`` phase where each batch arrives (:meth:`mark`), from
        its next iterator on. The loop then calls neither: two lines fewer, and the data
        phase ends exactly where the batch arrives. Calling them anyway stays correct: a step
        the loop began is not begun again. Returns whether the loader took it (False: a
        loader that failed; the loop marks as before)."""
        try:
            attached = bool(loader.time_steps(LoaderSteps(self)))
        except Exception:  # noqa: BLE001 - fail open: the loop marks as before
            self._failed_once("attach_loader")
            attached = False
        self.loader_attached = attached
        return attached

    # -- checkpoint ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able) to checkpoint the guard: the gate's state and the pacing
        sleep, which the gate's ``pacing`` flag alone does not restore."""
        return {"gate": self.gate.state_dict(), "pace_delay_s": self._pace_delay_s}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (without ``pace_delay_s``: no pacing)."""
        if state.get("gate"):
            self.gate.load_state_dict(state["gate"])
            self._refresh_bounds()
            self._memory.forget()
        self.set_pace(state.get("pace_delay_s", 0.0))

    # -- actions -----------------------------------------------------------------------------
    def _applied(self, decisions: list[Decision]) -> list[Decision]:
        """Apply ``decisions`` locally; return them."""
        for decision in decisions:
            self._apply(decision)
        return decisions

    def _apply(self, decision: Decision) -> None:
        if not self.act:
            pass
        elif decision.action is Action.RELEASE_CACHE:
            self._guarded("release_cache", release_cache)
        elif decision.action is Action.PACE:
            self._guarded("pace", self.set_pace, decision.params.get("delay_s", 0.0))
        log = logger.warning if decision.action in (Action.CHECKPOINT_AND_STOP,
                                                    Action.SLOW_STEP) else logger.info
        log("%s", decision)
        if self.on_decision is not None:
            self._guarded("on_decision", self.on_decision, decision)

    def _guarded(self, part: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run a guard part; on failure log once per part and return None (fail open)."""
        return self._fail_open.call(part, fn, *args, **kwargs)

    def _failed_once(self, part: str) -> None:
        """Log the exception being handled, once per part."""
        self._fail_open.note(part)


class LoaderSteps:
    """What a GuardedDataLoader attached to ``guard`` (:meth:`StepGuard.attach_loader`) calls
    around each batch it fetches."""

    def __init__(self, guard: StepGuard) -> None:
        self._guard = guard

    def before_fetch(self) -> None:
        """Open the step where the loop starts fetching its first batch, unless the loop (or
        an earlier fetch of this step) opened it already."""
        guard = self._guard
        if not guard.timer.step_begun:
            guard.begin_step(guard._step)

    def after_fetch(self) -> None:
        """The batch is here: end the ``data`` phase."""
        self._guard.mark("data")
