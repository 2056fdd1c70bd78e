"""The per-worker step guard: a step timer, a memory probe and the step gate, with the local
actions (release cached memory, pacing) applied; no RPC, no NVML, no device synchronization.
Use and cost: docs/train_loop.md, "The step guard".
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Cause, Decision
from raytrain_guard.core.gate import StepGate
from raytrain_guard.core.memory_rules import trend_ahead
from raytrain_guard.core.steps import StepStats
from raytrain_guard.errors import InputError
from raytrain_guard.runtime.guard.cache_release import release_cache
from raytrain_guard.runtime.guard.fail_open import FailOpen
from raytrain_guard.runtime.guard.gate_feed import GateFeed
from raytrain_guard.runtime.guard.memory_reads import MemoryReads
from raytrain_guard.runtime.guard.timing import StepTimer

logger = logging.getLogger(__name__)

__all__ = ["StepGuard"]


class StepGuard:
    """Joins a :class:`StepTimer` (default: host clock), a memory probe (``read() ->
    MemoryReading``; None: timing rules only) and a :class:`StepGate` (on ``clock``) for one
    worker. ``on_decision``: called with each decision once applied; ``fault_injector``: its
    ``on_mark(step, phase)`` runs at each mark; ``sleep``: pacing's; ``act`` False: decide and
    log only. With a host timer the gate is fed in batches (:attr:`feed`): decisions still come
    at their step, and :attr:`gate`, :meth:`drain_stats` and :meth:`state_dict` see every step.
    """

    def __init__(self, config: GuardConfig, *, probe: Any = None, timer: StepTimer | None = None,
                 clock: Callable[[], float] = time.monotonic, world_rank: int = 0,
                 on_decision: Callable[[Decision], None] | None = None,
                 fault_injector: Any = None,
                 sleep: Callable[[float], None] = time.sleep, act: bool = True) -> None:
        self.config = config
        self.act = act
        self.probe = probe
        self.timer = timer if timer is not None else StepTimer()
        self.timer.world_rank = world_rank          # the guard's rank names its steps
        self.world_rank = world_rank
        self.on_decision = on_decision
        self.fault_injector = fault_injector
        self._sleep = sleep
        self._pace_delay_s = 0.0
        self._step = 0                 # the step now running (the next one after end_step)
        self._fail_open = FailOpen(logger, lambda: f"rank {self.world_rank} step {self._step}")
        #: whether a loader opens the steps and ends their data phase (:meth:`attach_loader`)
        self.loader_attached = False
        fast = bool(getattr(self.timer, "on_host", False))
        gate = StepGate(config, clock=clock,
                        memory_cause=getattr(probe, "cause", Cause.DEVICE_MEMORY))
        self.feed = GateFeed(gate, config, timer=self.timer, world_rank=world_rank,
                             apply=self._applied, fail_open=self._fail_open, fast=fast)
        self._memory = MemoryReads(probe, config, reuse=fast)
        self._fracs: deque[float] = deque(maxlen=max(3, config.memory_trend_steps))

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
        """Finish ``step``: read the probe, time the step, feed the gate, apply the local
        actions (RELEASE_CACHE, PACE) and return every decision (CHECKPOINT_AND_STOP and
        SLOW_STEP are the caller's). An injected ``optimizer`` delay runs here when the loop
        did not mark ``optimizer`` (the time since the backward mark is the optimizer's)."""
        if self.fault_injector is not None and self.timer.pending_phase == "optimizer":
            self.fault_injector.on_mark(step, "optimizer")
        try:
            frac, cached = self._memory.read(may_reuse=self.feed.quiet)
        except Exception:  # noqa: BLE001 - the guard fails open
            self._fail_open.note("probe")
            frac = cached = None
        if frac is not None:
            self._fracs.append(frac)
        decisions = self.feed.end_step(step, frac, cached)
        self._step = step + 1
        return decisions

    def memory_ahead(self, steps: int) -> float | None:
        """The memory fraction ``steps`` steps after the last one ended, on the line through
        the last ``memory_trend_steps`` readings (None: fewer than three). Not fed to the gate:
        the step boundary asks it where a stop may next land (:class:`StepBoundary`)."""
        trend = trend_ahead(self._fracs, steps)
        return None if trend is None else trend[1]

    def note_pause(self, next_step: int | None = None) -> None:
        """Training paused before ``next_step`` (default: the step after the last one), a
        checkpoint or a restore: the gate lets the next steps settle, and ``next_step`` is
        the step an attached loader opens next."""
        step = self._step if next_step is None else next_step
        self._step = step
        self._fail_open.call("note_pause", lambda: self.feed.gate.note_pause(step))

    def note_reshaped(self, step: int) -> None:
        """The guard ran ``step`` differently (a spike in pieces): the gate does not judge its
        time (:meth:`StepGate.note_reshaped`). Call it before ``end_step(step)``."""
        self._fail_open.call("note_reshaped", self.feed.note_reshaped, step)

    @property
    def gate(self) -> Any:
        """The :class:`StepGate`, with every finished step fed to it."""
        return self.feed.gate

    @gate.setter
    def gate(self, gate: Any) -> None:
        self.feed.gate = gate

    def drain_stats(self) -> list[StepStats]:
        """The StepStats of the steps finished since the last drain, oldest first."""
        return self.feed.drain_stats()

    # -- pacing and an attached loader ---------------------------------------------------------
    @property
    def pace_delay_s(self) -> float:
        """The pacing sleep now applied before each step (0: not pacing)."""
        return self._pace_delay_s

    def set_pace(self, delay_s: float) -> None:
        """Sleep ``delay_s`` before each step from the next one on (0 stops pacing): a PACE
        decision's effect."""
        delay = float(delay_s)
        if not delay >= 0:
            raise InputError("params['delay_s']", "must be a number >= 0", value=delay_s,
                             fix="pass the pacing sleep in seconds, 0 to stop pacing")
        self._pace_delay_s = delay

    def attach_loader(self, loader: Any) -> bool:
        """Let ``loader`` (a :class:`~raytrain_guard.runtime.data.loader.GuardedDataLoader`)
        open each step where the loop fetches its first batch and end the ``data`` phase where
        the batch arrives (:meth:`before_fetch`, :meth:`after_fetch`), from its next iterator
        on; the loop then calls neither :meth:`begin_step` nor ``mark("data")`` (calling them
        anyway stays correct). Returns whether the loader took it."""
        try:
            attached = bool(loader.time_steps(self))
        except Exception:  # noqa: BLE001 - fail open: the loop marks as before
            self._fail_open.note("attach_loader")
            attached = False
        self.loader_attached = attached
        return attached

    def before_fetch(self) -> None:
        """An attached loader starts fetching a batch: the step opens here, unless the loop
        (or an earlier fetch of this step) opened it already."""
        if not self.timer.step_begun:
            self.begin_step(self._step)

    def after_fetch(self) -> None:
        """An attached loader's batch is here: the ``data`` phase ends."""
        self.mark("data")

    # -- checkpoint ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able): the gate's state and the pacing sleep."""
        return {"gate": self.gate.state_dict(), "pace_delay_s": self._pace_delay_s}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (without ``pace_delay_s``: no pacing)."""
        if state.get("gate"):
            self.gate.load_state_dict(state["gate"])
            self.feed.refresh_bounds()
            self._memory.forget()
            self._fracs.clear()
        self.set_pace(state.get("pace_delay_s", 0.0))

    # -- actions -----------------------------------------------------------------------------
    def _applied(self, decisions: list[Decision]) -> list[Decision]:
        """Apply ``decisions`` locally, in order; return them."""
        for decision in decisions:
            action = decision.action
            if self.act and action is Action.RELEASE_CACHE:
                self._fail_open.call("release_cache", release_cache)
            elif self.act and action is Action.PACE:
                self._fail_open.call("pace", self.set_pace, decision.params.get("delay_s", 0.0))
            loud = action in (Action.CHECKPOINT_AND_STOP, Action.SLOW_STEP)
            (logger.warning if loud else logger.info)("%s", decision)
            if self.on_decision is not None:
                self._fail_open.call("on_decision", self.on_decision, decision)
        return decisions
