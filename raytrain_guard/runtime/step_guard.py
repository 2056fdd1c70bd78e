"""The per-worker step guard: timer + probe + gate, with the local actions applied.

Use in a training loop::

    guard = StepGuard(config, probe=ProcessMemoryProbe(config), world_rank=rank)
    attach_comm_timer(ddp_model, guard.timer)       # optional: communication wait
    guard.attach_loader(loader)                     # a GuardedDataLoader opens each step
    for step, batch in enumerate(loader):           # and times its data phase
        loss = model(batch).sum(); guard.mark("forward")
        loss.backward();           guard.mark("backward")
        opt.step()                 # from the backward mark to end_step: the optimizer
        for decision in guard.end_step(step):
            if decision.action is Action.CHECKPOINT_AND_STOP: ...   # the loop's to act on

With another loader, or none attached: ``guard.begin_step(step)`` before fetching the step's
batch and ``guard.mark("data")`` once it is there. A loop with more work after its optimizer
step marks ``guard.mark("optimizer")`` where the update ends (the rest stays untimed).

Per step: a few clock reads, one probe read (allocator counters or one ``/proc`` read), the
pure gate. No RPC, no NVML, no device synchronization. The guard fails open: a probe or gate
that raises is logged once and the step goes on.

Fast path (host timers): a step whose total time is at or under the gate's quiet bound and
whose memory reading is under its quiet line (:meth:`StepGate.quiet_limits`) is only buffered,
two comparisons. A step over the time bound waits too, unless it could complete a run of
``num_slow_steps`` slow steps with the steps over the bound before it (buffered, or the gate's
own run, :attr:`StepGate.slow_run_length`): a step at or under the bound ends any run, so an
isolated slow step (a noisy box has many) decides nothing. The buffer goes to the gate, in
order, as StepStats, when a step may decide something, every ``gate_batch_steps`` steps,
and before :meth:`StepGuard.drain_stats`, :meth:`~StepGuard.state_dict` or a read of
:attr:`~StepGuard.gate`. Buffered steps decide nothing, so every decision comes at the same
step as with a gate fed every step; the saving is the StepStats and the gate call of the
waiting steps (cold-cache Python: about half of the guard's per-step cost next to a ~10 ms
step). A host-memory reading far below the watermark is reused for a few steps
(``memory_read_every_steps``, more the farther below): the ``/proc`` read is the other half.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import gc
import logging
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Cause, Decision
from raytrain_guard.core.gate import StepGate
from raytrain_guard.core.steps import StepStats
from raytrain_guard.errors import InputError
from raytrain_guard.runtime.timing import StepTimer

logger = logging.getLogger(__name__)

#: A host-memory reading this far below the watermark may be reused (memory_read_every_steps).
_REUSE_MARGIN_FRAC = 0.05
#: Far below that line a reading is reused longer, up to this many times memory_read_every_steps
#: steps: as long as memory growing steadily by _REUSE_MARGIN_FRAC / memory_read_every_steps of
#: the budget per step (the rate the margin is sized for) stays under the line.
_REUSE_MAX_FACTOR = 4


class StepGuard:
    """Joins a :class:`StepTimer`, a memory probe and a :class:`StepGate` for one worker.

    ``probe``: anything with ``read() -> MemoryReading`` (None: timing rules only).
    ``timer``: defaults to a host-clock :class:`StepTimer`. ``clock``: the gate's clock.
    ``on_decision``: called with every decision after it was applied locally.
    ``fault_injector``: a :class:`~raytrain_guard.runtime.probes.FaultInjector` whose delays
    run before the matching :meth:`mark` (fixed at construction: without one, :meth:`mark` is
    the timer's own). ``sleep``: used for pacing (tests pass a fake).
    """

    def __init__(self, config: GuardConfig, *, probe: Any = None, timer: StepTimer | None = None,
                 clock: Callable[[], float] = time.monotonic, world_rank: int = 0,
                 on_decision: Callable[[Decision], None] | None = None,
                 fault_injector: Any = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.config = config
        self.probe = probe
        self.timer = timer if timer is not None else StepTimer(world_rank=world_rank)
        self.world_rank = world_rank
        self._gate: Any = StepGate(config, clock=clock,
                                   memory_cause=getattr(probe, "cause", Cause.DEVICE_MEMORY))
        self.on_decision = on_decision
        self.fault_injector = fault_injector
        self._sleep = sleep
        self._pace_delay_s = 0.0
        self._step = 0
        self._stats: deque[StepStats] = deque(maxlen=max(config.step_window,
                                                         config.report_every_steps))
        self._failed: set[str] = set()
        # fast path (host timers only): steps closed but not yet fed to the gate, the bounds
        # under which a step may wait (see the module doc), decisions of a flush that no
        # end_step returned (none expected: buffered steps decide nothing)
        self._fast = bool(getattr(self.timer, "on_host", False))
        self._buffer: list[tuple[Any, float | None]] = []
        self._built: list[StepStats | None] = []   # StepStats of the first buffered steps, drained
        self._horizon = min(config.gate_batch_steps, max(1, config.step_window // 2 - 5))
        self._quiet_s = -1.0           # no bound yet: every step goes to the gate
        self._quiet_frac = float("-inf")
        self._num_slow = config.num_slow_steps
        self._over = 0                 # buffered steps over the time bound, in a row, at the end
        self._run0 = 0                 # the gate's run of slow steps when the buffer started
        self._late: list[Decision] = []
        # host-memory readings far below the watermark are reused on the fast path
        # (config.memory_read_every_steps): steps left to reuse, the reading, the line
        self._reuse_steps = (config.memory_read_every_steps - 1
                             if self._fast and getattr(probe, "cause", None) is Cause.HOST_MEMORY
                             else 0)
        self._reuse_left = 0
        self._reused_frac: float | None = None
        self._reuse_below = config.memory_watermark_frac - _REUSE_MARGIN_FRAC
        self._reuse_growth = _REUSE_MARGIN_FRAC / config.memory_read_every_steps
        self._reuse_max = _REUSE_MAX_FACTOR * config.memory_read_every_steps - 1
        if fault_injector is None:
            self.mark = self.timer.mark      # type: ignore[method-assign]  # one call less
        #: whether a loader opens the steps and times their data phase (:meth:`attach_loader`):
        #: the loop then calls neither :meth:`begin_step` nor ``mark("data")``
        self.loader_attached = False
        self._bind_begin()

    # -- the step ----------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Start ``step``: pace first when pacing is on, then start the timer."""
        self._step = step
        if self._pace_delay_s > 0:
            self._sleep(self._pace_delay_s)
        self.timer.begin_step(step)

    def mark(self, phase: str) -> None:
        """End ``phase`` now (see :meth:`StepTimer.mark`)."""
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
        if self.fault_injector is not None:
            self._inject_unmarked_optimizer(step)
        frac = None
        if self._reuse_left > 0:
            self._reuse_left -= 1
            frac = self._reused_frac
        elif self.probe is not None:
            try:
                reading = self.probe.read()
                frac = reading.frac
            except Exception:  # noqa: BLE001 - the guard fails open
                self._failed_once("probe")
            if self._reuse_steps and frac is not None and frac < self._reuse_below \
                    and self._quiet_s > 0:
                self._reuse_left = min(self._reuse_max, self._reuse_steps + int(
                    (self._reuse_below - frac) / self._reuse_growth))
                self._reused_frac = frac
        if self._fast:
            try:
                record, total_s = self.timer.close_step(step)
            except Exception:  # noqa: BLE001
                self._failed_once("timer")
            else:
                buffer = self._buffer
                buffer.append((record, frac))
                self._step = step + 1
                if total_s <= self._quiet_s:
                    self._over = 0
                    if ((frac is None or frac < self._quiet_frac)
                            and len(buffer) < self._horizon and not self._late):
                        return []                # the common case: a few comparisons
                    return self._flush()
                return self._over_bound(len(buffer), frac)
            decisions = self._flush()            # the gate sees the buffered steps first
            frac_decisions = self._observe(None, step, frac)
            for decision in frac_decisions:
                self._apply(decision)
            self._step = step + 1
            return decisions + frac_decisions
        try:
            stats = self.timer.finish_step(step, memory_frac=frac)
        except Exception:  # noqa: BLE001
            self._failed_once("timer")
            stats = None
        decisions = self._observe(stats, step, frac)
        for decision in decisions:
            self._apply(decision)
        self._step = step + 1
        return decisions

    def _inject_unmarked_optimizer(self, step: int) -> None:
        if getattr(self.timer, "pending_phase", None) == "optimizer":
            self.fault_injector.on_mark(step, "optimizer")

    def _over_bound(self, num_buffered: int, frac: float | None) -> list[Decision]:
        """A step over the quiet time bound was buffered: it waits unless it could complete a
        run of slow steps (the buffered steps over the bound just before it, and the gate's
        own run when every buffered step is over the bound), or another bound asks a flush."""
        self._over += 1
        run = self._over + (self._run0 if self._over == num_buffered else 0)
        if (self._quiet_s >= 0 and run < self._num_slow
                and (frac is None or frac < self._quiet_frac)
                and num_buffered < self._horizon and not self._late):
            return []
        return self._flush()

    def _observe(self, stats: StepStats | None, step: int,
                 frac: float | None) -> list[Decision]:
        """Keep ``stats`` and feed them to the gate (the memory rules alone without stats)."""
        try:
            if stats is not None:
                if stats.world_rank != self.world_rank:
                    stats = dataclasses.replace(stats, world_rank=self.world_rank)
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
        kept, observe = self._stats, self._gate.observe
        for i, (record, frac) in enumerate(buffer):
            if i < len(built):
                stats = built[i]                 # drained already: not kept again
            else:
                stats = self._stats_of(record, frac)
                if stats is not None:
                    kept.append(stats)
            if stats is None:            # no timings: the memory rules alone (what _observe does)
                found = self._observe(None, record.step, frac)
            else:
                try:
                    found = observe(stats)
                except Exception:  # noqa: BLE001
                    self._failed_once("gate")
                    found = []
            if found:
                for decision in found:
                    self._apply(decision)
                decisions += found
        self._refresh_bounds()
        return decisions

    def _stats_of(self, record: Any, frac: float | None) -> StepStats | None:
        """A buffered step's StepStats, with this guard's rank (None: the timer failed)."""
        try:
            stats = self.timer.stats_of(record, frac)
        except Exception:  # noqa: BLE001
            self._failed_once("timer")
            return None
        if stats.world_rank != self.world_rank:
            stats = dataclasses.replace(stats, world_rank=self.world_rank)
        return stats

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
        for a batch to the coordinator. Waiting steps stay waiting: their StepStats are built
        now and reach the gate with the next batch, so a drain every few steps does not
        shorten the fast path's batches."""
        out = list(self._stats)
        self._stats.clear()
        if len(self._buffer) > len(self._built):
            fresh = [self._stats_of(record, frac)
                     for record, frac in self._buffer[len(self._built):]]
            self._built += fresh
            out += [s for s in fresh if s is not None]
        return out

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
        self._bind_begin()

    def attach_loader(self, loader: Any) -> bool:
        """Let ``loader`` (a :class:`~raytrain_guard.runtime.loader.GuardedDataLoader`) open
        each step where the loop starts fetching its first batch (after the pacing sleep, when
        pacing), and end the ``data`` phase where each batch arrives, from its next iterator
        on. The loop then calls neither :meth:`begin_step` nor ``mark("data")``: two lines
        fewer in the loop, and the data phase ends exactly where the batch arrives. (It saves
        no time: on a cold-cache CPU loop the loader's inline stamps cost about what the two
        calls did, docs/benchmarks.md.) Calling them anyway stays correct: a step begun by the
        loop is not restarted by the loader, and a second ``data`` mark adds the few
        microseconds since the loader's. Returns whether the loader took it: not with a fault
        injector (whose ``data`` delays run in :meth:`mark`), nor with a host timer on another
        clock than the loader's (tests' fake clocks); then nothing changes and the loop marks
        as before."""
        if self.fault_injector is not None:
            return False
        self.timer.before_step = None
        try:
            attached = bool(loader.time_steps(self.timer))
        except Exception:  # noqa: BLE001 - fail open: the loop marks as before
            self._failed_once("attach_loader")
            attached = False
        self.loader_attached = attached
        self._bind_begin()
        return attached

    def _bind_begin(self) -> None:
        """Without pacing or fault injection, :meth:`begin_step` is the timer's own (one call
        less per step; the step number is known again at end_step). With an attached loader
        the pacing sleep is the loader's to make, where it opens a step."""
        pacing = self._pace_delay_s > 0
        if pacing or self.fault_injector is not None:
            self.__dict__.pop("begin_step", None)
        else:
            self.begin_step = self.timer.begin_step   # type: ignore[method-assign]
        if self.loader_attached:
            self.timer.before_step = self._pace_sleep if pacing else None

    def _pace_sleep(self) -> None:
        """The pacing sleep before a step an attached loader opens."""
        self._sleep(self._pace_delay_s)

    def state_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able) to checkpoint the guard: the gate's state and the pacing
        sleep, which the gate's ``pacing`` flag alone does not restore."""
        return {"gate": self.gate.state_dict(), "pace_delay_s": self._pace_delay_s}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (a state without ``pace_delay_s``, from
        an older checkpoint, restores the gate and does not pace)."""
        if state.get("gate"):
            self.gate.load_state_dict(state["gate"])
            self._refresh_bounds()
            self._reuse_left = 0
        self.set_pace(state.get("pace_delay_s", 0.0))

    # -- actions -----------------------------------------------------------------------------
    def _apply(self, decision: Decision) -> None:
        if decision.action is Action.RELEASE_CACHE:
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
        try:
            return fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - the guard fails open
            self._failed_once(part)
            return None

    def _failed_once(self, part: str) -> None:
        """Log the exception being handled, once per part."""
        if part not in self._failed:
            self._failed.add(part)
            logger.warning("rank %d step %d: guard part %r failed; training goes on "
                           "(logged once)", self.world_rank, self._step, part,
                           exc_info=True)  # noqa: LOG014 - called from except blocks only


def release_cache() -> str:
    """Give cached memory back: ``torch.cuda.empty_cache()`` where CUDA is initialised, else
    ``gc.collect()`` and glibc's ``malloc_trim(0)`` where available. Returns what it did."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        return "torch.cuda.empty_cache"
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
        return "gc.collect + malloc_trim"
    return "gc.collect"


_MALLOC_TRIM: Any = False


def _malloc_trim() -> Any:
    global _MALLOC_TRIM
    if _MALLOC_TRIM is False:
        _MALLOC_TRIM = None
        name = ctypes.util.find_library("c")
        if name:
            with contextlib.suppress(OSError, AttributeError):
                _MALLOC_TRIM = ctypes.CDLL(name).malloc_trim
    return _MALLOC_TRIM
