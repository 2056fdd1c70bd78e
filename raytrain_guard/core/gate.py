"""The step gate: per-rank rules that turn step statistics into decisions (pure), and the
cross-rank attribution of a run (:func:`attribute_across_ranks`, the coordinator's rule).

:class:`StepGate` composes the memory rules (``core/memory_rules.py``), the recent steps
(``core/recent_steps.py``) and the slow-step rules (``core/slow_steps.py``); it never acts (the
StepGuard applies the local decisions). The rules: docs/train_loop.md ("The gate's rules").
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Cause, Decision
from raytrain_guard.core.memory_rules import MemoryRules
from raytrain_guard.core.recent_steps import RecentSteps
from raytrain_guard.core.slow_steps import SlowRuns, SlowStepLine
from raytrain_guard.core.steps import StepStats
from raytrain_guard.core.straggler import StragglerScore, TimingSummary, score_summaries, summarize
from raytrain_guard.errors import InputError

_STATE_VERSION = 2


class StepGate:
    """Per-rank rules over step statistics. ``clock`` (monotonic seconds) spaces cache
    releases; ``memory_cause``: what the memory fraction measures. The first
    ``slow_step_warmup_steps`` steps, those that settle after a pause (:meth:`note_pause`) and
    those the guard reshaped itself (:meth:`note_reshaped`) are left out of the slow-step rules
    and of the window.
    """

    def __init__(self, config: GuardConfig, *, clock: Callable[[], float] = time.monotonic,
                 memory_cause: Cause = Cause.DEVICE_MEMORY) -> None:
        if not isinstance(config, GuardConfig):
            raise InputError("config", "must be a GuardConfig", value=type(config).__name__,
                             fix="pass raytrain_guard.GuardConfig(...)")
        self.config = config
        self._next_id = 1
        self.memory = MemoryRules(config, clock=clock, cause=Cause(memory_cause),
                                  decide=self._decide)
        self.recent = RecentSteps(config.step_window)
        self.line = SlowStepLine(config, self.recent)
        self.runs = SlowRuns(config, self.line, decide=self._decide)
        self._num_seen = 0
        self._settle_until = 0                   # steps before this one follow a pause
        self._reshaped: set[int] = set()         # steps the guard ran differently (note_reshaped)

    def observe(self, stats: StepStats, *, cached_frac: float | None = None) -> list[Decision]:
        """Feed one step; returns the decisions it triggers (often none). ``cached_frac``:
        the part of ``stats.memory_frac`` cached but unallocated (None: not known)."""
        frac = stats.memory_frac
        decisions = [] if frac is None else self.memory.observe(
            stats.step, frac, world_rank=stats.world_rank, cached_frac=cached_frac)
        cfg = self.config
        self._num_seen += 1
        totals = self.recent.sorted_totals
        gap_s = stats.idle_before_s
        if gap_s is not None and totals and gap_s > cfg.pause_gap_steps * totals[len(totals) // 2]:
            self.note_pause(stats.step)         # the loop paused before this step
        reshaped = False
        if self._reshaped:
            reshaped = stats.step in self._reshaped
            self._reshaped = {s for s in self._reshaped if s > stats.step}
        if (self._num_seen <= cfg.slow_step_warmup_steps or stats.step < self._settle_until
                or reshaped):
            return decisions
        event = self.runs.observe(stats)
        if event is not None:
            decisions.append(event)
        self.recent.add(stats)
        return decisions

    def observe_memory(self, step: int, memory_frac: float, *, world_rank: int = 0,
                       cached_frac: float | None = None) -> list[Decision]:
        """The memory rules alone, for a reading whose step timings are not known yet."""
        return self.memory.observe(step, memory_frac, world_rank=world_rank,
                                   cached_frac=cached_frac)

    def note_pause(self, next_step: int) -> None:
        """Training paused before ``next_step`` (a checkpoint, or a restore in fresh
        processes): the slow-step rules skip it and the steps after it, as many as
        ``slow_step_settle_steps`` and ``slow_step_warmup_steps`` ask (the memory rules do
        not)."""
        cfg = self.config
        self._settle_until = next_step + max(cfg.slow_step_settle_steps,
                                             cfg.slow_step_warmup_steps)

    def note_reshaped(self, step: int) -> None:
        """The guard ran ``step`` differently from the steps around it (a spike's micro-batch in
        pieces): its time is the spike's and the remedy's, not the run's pace, and the decision
        that reshaped it already says why. The slow-step rules leave it out, and the window
        too (the memory rules do not)."""
        self._reshaped.add(step)

    def quiet_limits(self, num_steps: int) -> tuple[tuple[float, ...], float] | None:
        """``(totals_s, memory_frac)``: the j-th of the next ``num_steps`` steps decides
        nothing when its ``total_s <= totals_s[j]`` and it has no memory reading or one under
        ``memory_frac``, so it may be fed later, in order, with the same decisions at the same
        steps (StepGuard's fast path); nor does one over its bound that cannot be the
        ``num_slow_steps``-th of a run (:attr:`slow_run_length`). None: no bounds yet
        (:meth:`SlowStepLine.quiet_bounds`)."""
        bounds = self.line.quiet_bounds(num_steps)
        return None if bounds is None else (bounds, self.memory.quiet_frac())

    def claim_release(self) -> bool:
        """Whether a cache release may run now, and if so, count it
        (:meth:`MemoryRules.claim_release`)."""
        return self.memory.claim_release()

    def state_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able) to checkpoint the gate (:meth:`MemoryRules.state_dict` says
        what is not kept)."""
        return {"version": _STATE_VERSION, "window": [s.to_dict() for s in self.recent.steps],
                **self.memory.state_dict(), **self.runs.state_dict(),
                "num_seen": self._num_seen, "next_id": self._next_id}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state.get("version") != _STATE_VERSION:
            raise InputError("state['version']", "unknown gate state version",
                             value=state.get("version"),
                             fix=f"pass a state_dict() of this StepGate (version {_STATE_VERSION})")
        self.recent.load(StepStats.from_dict(d) for d in state["window"])
        self.memory.load_state_dict(state)
        self.runs.load_state_dict(state)
        self._num_seen = int(state["num_seen"])
        self._next_id = int(state["next_id"])

    @property
    def window(self) -> tuple[StepStats, ...]:
        """The recent steps the rules compare with (at most ``step_window``, warm-up steps
        left out), oldest first; also what the run's cross-rank attribution reads."""
        return tuple(self.recent.steps)

    @property
    def num_waited_for_peer(self) -> int:
        """Slow steps in communication that waited for a rank of the node that worked
        longer (not counted as slow)."""
        return self.runs.num_waited_for_peer

    @property
    def slow_run_length(self) -> int:
        """Slow steps in a row at the end of what was fed (0 after a step under its line)."""
        return len(self.runs.run)

    @property
    def stopped(self) -> bool:
        """Whether CHECKPOINT_AND_STOP was decided already."""
        return self.memory.stopped

    def _decide(self, action: Action, cause: Cause, reason: str, **params: Any) -> Decision:
        decision = Decision(action, reason, None, cause, "rank", params, self._next_id)
        self._next_id += 1
        return decision


# -- attribution across ranks --------------------------------------------------------------------
class RankRole(str, enum.Enum):
    """A rank's role in a cross-rank comparison."""

    STRAGGLER_COMPUTE = "straggler_compute"
    STRAGGLER_DATA = "straggler_data"
    WAITING = "waiting"
    NORMAL = "normal"


@dataclass(frozen=True)
class RankAttribution:
    """One rank's role, with the medians it was judged on and the reason."""

    world_rank: int
    role: RankRole
    reason: str
    total_s: float = 0.0
    data_wait_s: float = 0.0
    compute_s: float = 0.0
    comm_wait_s: float = 0.0


def attribute_across_ranks(windows: Sequence[Iterable[StepStats]], *,
                           straggler_frac: float = GuardConfig.straggler_frac,
                           floor_s: float = GuardConfig.slow_step_floor_s
                           ) -> list[RankAttribution]:
    """Each rank's role from its recent StepStats window, one result per window in order
    (``world_rank`` from the stats, the position when empty).

    The stragglers are the coordinator's (:func:`~raytrain_guard.core.straggler.score_summaries`):
    a rank whose data wait or compute median exceeds the reference rank's (the lower median
    across ranks) by ``straggler_frac`` of the median step. Another rank whose communication
    wait exceeds the least one by as much is waiting (under DDP the straggler waits least).
    Either gap must also reach ``floor_s``.
    """
    if not 0 < straggler_frac:
        raise InputError("straggler_frac", "must be > 0", value=straggler_frac,
                         fix="pass a fraction such as 0.1")
    steps = [list(w) for w in windows]
    ranks = [w[0].world_rank if w else index for index, w in enumerate(steps)]
    summaries = {rank: summarize(w) for rank, w in zip(ranks, steps) if w}
    scores = score_summaries(summaries, min_steps=1)
    stragglers = [r for r, sc in scores.items()
                  if sc.cause in (Cause.DATA, Cause.COMPUTE) and sc.excess_frac >= straggler_frac
                  and sc.excess_frac * sc.step_s >= floor_s]
    least_wait = min((m.comm_wait_s for m in summaries.values()), default=0.0)
    out = []
    for rank, window in zip(ranks, steps):
        if not window:
            out.append(RankAttribution(rank, RankRole.NORMAL,
                                       f"rank at position {rank}: no steps reported"))
            continue
        m = summaries[rank]
        figures = (m.total_s, m.data_wait_s, m.compute_s, m.comm_wait_s)
        if rank not in scores:
            out.append(RankAttribution(rank, RankRole.NORMAL, f"rank {rank}: the only rank "
                                       f"reporting, nothing to compare with", *figures))
            continue
        out.append(RankAttribution(rank, *_role(rank, m, scores[rank], straggler_frac,
                                                least_wait, stragglers, floor_s), *figures))
    return out


def _role(rank: int, m: TimingSummary, score: StragglerScore, frac: float, least_wait: float,
          stragglers: Sequence[int], floor_s: float = 0.0) -> tuple[RankRole, str]:
    thr = max(frac * score.step_s, floor_s)
    tail = (f"(straggler_frac {frac:g} x median step {score.step_s:.4f} s = "
            f"{frac * score.step_s:.4f} s"
            + (f", floor {floor_s:g} s)" if floor_s > frac * score.step_s else ")"))
    if rank in stragglers:
        excess = f"{score.excess_frac:+.1%} of a step over the reference rank {tail}"
        if score.cause is Cause.COMPUTE:
            return RankRole.STRAGGLER_COMPUTE, (
                f"rank {rank}: compute {m.compute_s:.4f} s is {excess}; it waits "
                f"{m.comm_wait_s:.4f} s in communication")
        return RankRole.STRAGGLER_DATA, f"rank {rank}: data wait {m.data_wait_s:.4f} s is {excess}"
    wait_gap = m.comm_wait_s - least_wait
    if wait_gap > thr:
        on = f"; waiting on rank {', '.join(map(str, stragglers))}" if stragglers else ""
        return RankRole.WAITING, (
            f"rank {rank}: waits {m.comm_wait_s:.4f} s in communication, {wait_gap:+.4f} s "
            f"over the least-waiting rank {tail}{on}")
    return RankRole.NORMAL, f"rank {rank}: within {thr:.4f} s of the reference rank {tail}"
