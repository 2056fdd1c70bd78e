"""The step gate: per-rank rules that turn step statistics into decisions (pure).

:class:`StepGate` sees one :class:`~raytrain_guard.core.steps.StepStats` per step and returns
:class:`~raytrain_guard.core.decisions.Decision` values with their reasons (watermark, critical
memory, slow steps and their cause, pacing); it never acts: the
:class:`~raytrain_guard.runtime.step_guard.StepGuard` applies the local ones. The rules and their
thresholds: docs/train_loop.md ("The gate's rules"). :func:`attribute_across_ranks` compares the
ranks of a run with the coordinator's straggler rule.
"""

from __future__ import annotations

import bisect
import enum
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Cause, Decision
from raytrain_guard.core.excuses import SlowStepExcuses
from raytrain_guard.core.stats import robust_sigma, slope
from raytrain_guard.core.steps import StepStats
from raytrain_guard.core.straggler import StragglerScore, TimingSummary, score_summaries, summarize
from raytrain_guard.errors import InputError

_STATE_VERSION = 2
_MIN_MEDIAN_POINTS = 3      # a median of fewer than three steps is one of them, not a baseline
MAX_PERSISTENCE_FACTOR = 3
"""Adaptive persistence asks at most 3 x ``num_slow_steps`` slow steps (9 by default): a box
whose noise comes in longer streaks than that has lost the rule's point; the cap keeps a real
slowdown named within 9 steps there (the streaks measured on an oversubscribed 2-core box
reached 7)."""


class StepGate:
    """Per-rank rules over step statistics; returns decisions, never acts (pure).

    ``clock`` (seconds, monotonic) spaces cache releases; tests pass a fake one.
    ``memory_cause`` is the resource the memory fraction measures (device memory on CUDA,
    host memory against a CPU budget).
    """

    def __init__(self, config: GuardConfig, *, clock: Callable[[], float] = time.monotonic,
                 memory_cause: Cause = Cause.DEVICE_MEMORY) -> None:
        if not isinstance(config, GuardConfig):
            raise InputError("config", "must be a GuardConfig", value=type(config).__name__,
                             fix="pass raytrain_guard.GuardConfig(...)")
        self.config = config
        self._clock = clock
        self._memory_cause = Cause(memory_cause)
        self._window: deque[StepStats] = deque(maxlen=config.step_window)
        self._sorted_totals: list[float] = []    # the window's total_s, sorted (cheap median)
        self._memory: deque[float] = deque(maxlen=config.memory_trend_steps)
        self._run: list[StepStats] = []          # the current run of consecutive slow steps
        self._run_reported = False
        self._run_cause: Cause | None = None     # the component the current run is slow in
        self._run_parts = 0                      # steps of the run slow by the part rule
        self._streak = 0                         # slow steps in a row, whatever their cause
        self._ended_runs: deque[tuple[int, int]] = deque()   # (ending step, length) of
                                                 # streaks that ended by themselves lately
        self._num_seen = 0
        self._excuses = SlowStepExcuses(config)  # slow steps that are not this rank's
        self._settle_until = 0                   # steps before this one follow a checkpoint
        self._armed = True                       # watermark rule may fire
        self._last_release_s: float | None = None
        self._stopped = False                    # CHECKPOINT_AND_STOP already decided
        self._pacing = False
        self._next_id = 1
        self._rearm_below = config.memory_watermark_frac - config.memory_hysteresis_frac

    # -- public ------------------------------------------------------------------------------
    def observe(self, stats: StepStats, *, cached_frac: float | None = None) -> list[Decision]:
        """Feed one step; returns the decisions it triggers (often none). ``cached_frac``:
        the part of ``stats.memory_frac`` cached but unallocated (None: not known)."""
        frac = stats.memory_frac
        if frac is None:
            decisions: list[Decision] = []
        elif frac < self._rearm_below and self._armed and not self._pacing:
            self._memory.append(float(frac))    # observe_memory's common case, one call less
            decisions = []
        else:
            decisions = self.observe_memory(stats.step, frac, world_rank=stats.world_rank,
                                            cached_frac=cached_frac)
        # the timing rule, inline: the threshold is the lower of slow_step_abs_s and
        # slow_step_factor x the window's median (no relative rule below three steps).
        # StepGuard feeds the gate a batch of steps at once on cold caches, where each
        # Python call counts
        cfg = self.config
        self._num_seen += 1
        totals = self._sorted_totals
        gap_s = stats.idle_before_s
        if gap_s is not None and totals and gap_s > cfg.pause_gap_steps * totals[len(totals) // 2]:
            self.note_pause(stats.step)         # the loop paused before this step
        if self._num_seen <= cfg.slow_step_warmup_steps:
            return decisions
        if stats.step < self._settle_until:
            if len(totals) >= _MIN_MEDIAN_POINTS and (stats.cpu_wait_s is not None
                                                      or stats.peer_cpu_wait_s is not None):
                self._excuses.note_settling(stats, self._most_grown(stats)[0], self._window,
                                            statistics.median(totals))
            return decisions
        n = len(totals)
        threshold_s = cfg.slow_step_abs_s
        median_s = None
        if n >= _MIN_MEDIAN_POINTS:
            mid = n // 2
            median_s = totals[mid] if n % 2 else (totals[mid - 1] + totals[mid]) / 2
            relative_s = max(cfg.slow_step_factor * median_s, median_s + cfg.slow_step_floor_s)
            if threshold_s is None or relative_s < threshold_s:
                threshold_s = relative_s
            else:
                median_s = None                 # the absolute rule decides: no spread test
        total_s = stats.total_s
        slow = threshold_s is not None and total_s > threshold_s
        if slow and median_s is not None and cfg.slow_step_mad_k > 0:
            # over the cheap line: the robust spread of the window raises it on a noisy box
            # (computed only here, for a step that may be slow)
            threshold_s = max(threshold_s, median_s + cfg.slow_step_mad_k
                              * robust_sigma(totals, median_s))
            slow = total_s > threshold_s
        cause = None
        by_part = False
        if (not slow and median_s is not None and cfg.slow_component_growth_steps > 0
                and total_s > median_s + cfg.slow_step_floor_s):
            # the whole step hides a straggler's slowdown behind the wait it no longer has
            cause, slow = self._component_slow(stats, median_s)
            by_part = slow
        if slow and cause is None:
            cause = self._most_grown(stats)[0]  # the part that grew most (UNKNOWN: untimed)
        if slow and totals and self._excuses.judge(stats, cause, self._window,
                                                   statistics.median(totals)):
            # not this rank's slowdown (the host's contention or its aftermath, a slower rank
            # of the node: core.excuses): the step does not count toward a run of slow steps
            # and ends the one it fell in (whose first step, not read for a CPU wait, was the
            # contention's start), unless that run was named already: a slowdown that lasts
            # through the contention is not named again. It stays in the window, whose spread
            # keeps the next noisy steps in line
            if not self._run_reported:
                self._run.clear()
                self._run_parts = 0
        elif slow:
            # persistence in one cause: a step slow in another component than the run's starts
            # a new run (random outliers land in random phases; a real slowdown stays put)
            if self._run and cause is not self._run_cause:
                self._run.clear()
                self._run_parts = 0
            self._run_cause = cause
            self._run.append(stats)
            self._run_parts += by_part
            self._streak += 1
            if len(self._run) >= self._persistence(stats.step) and not self._run_reported:
                self._run_reported = True
                decisions.append(self._slow_step_decision(stats, threshold_s))
        else:
            if self._streak:
                self._ended_runs.append((stats.step, self._streak))
                self._streak = 0
            if self._run:
                self._run.clear()
                self._run_parts = 0
                self._run_reported = False
        window = self._window                   # into the window, its totals kept sorted
        if len(window) == window.maxlen:
            del totals[bisect.bisect_left(totals, window[0].total_s)]
        window.append(stats)
        bisect.insort(totals, total_s)
        return decisions

    def observe_memory(self, step: int, memory_frac: float, *, world_rank: int = 0,
                       cached_frac: float | None = None) -> list[Decision]:
        """The memory rules alone, for a reading whose step timings are not known yet.
        ``cached_frac``: the part of it cached but unallocated (None: not known); a cache
        release is decided only where it is at least ``cache_release_min_frac``."""
        cfg = self.config
        frac = float(memory_frac)
        self._memory.append(frac)
        rearm_below = self._rearm_below
        if frac < rearm_below and self._armed and not self._pacing:
            return []                                # the common case: nothing to decide
        where = f"rank {world_rank} step {step}"
        decisions: list[Decision] = []
        if not self._armed and frac < rearm_below:
            self._armed = True
        if (frac >= cfg.memory_watermark_frac and self._armed and self._release_spaced()
                and (cached_frac is None or cached_frac >= cfg.cache_release_min_frac)):
            self._armed = False
            self._last_release_s = self._clock()
            decisions.append(self._decide(
                Action.RELEASE_CACHE, self._memory_cause,
                f"{where}: memory at {frac:.1%} >= watermark {cfg.memory_watermark_frac:.0%}; "
                f"release cached blocks (re-arms below {rearm_below:.0%})"))
        if not self._stopped:
            reason = self._critical_reason(frac)
            if reason is not None:
                self._stopped = True
                decisions.append(self._decide(Action.CHECKPOINT_AND_STOP, self._memory_cause,
                                              f"{where}: {reason}; checkpoint and stop before "
                                              f"running out of memory"))
        if cfg.pacing_enabled:
            if not self._pacing and frac >= cfg.memory_watermark_frac:
                self._pacing = True
                decisions.append(self._decide(
                    Action.PACE, self._memory_cause,
                    f"{where}: memory at {frac:.1%} >= watermark; pace each step by "
                    f"{cfg.pacing_delay_s:g} s", delay_s=cfg.pacing_delay_s))
            elif self._pacing and frac < rearm_below:
                self._pacing = False
                decisions.append(self._decide(
                    Action.PACE, self._memory_cause,
                    f"{where}: memory at {frac:.1%} < {rearm_below:.0%}; stop pacing",
                    delay_s=0.0))
        return decisions

    def note_pause(self, next_step: int) -> None:
        """Training paused before ``next_step`` (a checkpoint, or a restore in fresh
        processes): the slow-step rules skip it and the steps after it, as many as
        ``slow_step_settle_steps`` and ``slow_step_warmup_steps`` ask (the memory rules do
        not)."""
        cfg = self.config
        self._settle_until = next_step + max(cfg.slow_step_settle_steps,
                                             cfg.slow_step_warmup_steps)

    def quiet_limits(self, num_steps: int) -> tuple[float, float] | None:
        """Bounds under which the next ``num_steps`` steps are sure to decide nothing:
        ``(total_s, memory_frac)``: a step with ``total_s <=`` the first and no memory reading
        or one ``<`` the second yields no decision whatever other such steps precede it, so a
        caller may feed such steps later, in order, with the same decisions at the same steps
        (StepGuard's fast path). None: no such bound now (fewer than three steps in the
        window: the next step may be the first one judged).

        The time bound is the lower of ``slow_step_abs_s`` and m + ``slow_step_floor_s`` (with
        ``slow_component_growth_steps``, under which a component may make a step slow from
        there) or else the larger of ``slow_step_factor`` x m and that, m the
        ``(n - 1) // 2 - (num_steps - 1)``-th smallest of the window's n totals (the spread term
        only raises a threshold, so leaving it out keeps the bound safe): after j <
        num_steps more steps enter the window (j evicted, or none while it fills) its median is
        at least the ``(n - 1) // 2 - j``-th of today's, so the threshold of each of those steps
        is at least this bound; 0 when that index is below 0. The memory bound is the re-arm
        line while the watermark is armed and the gate is not pacing (below it
        :meth:`observe_memory` returns at once and changes no state), else -inf: every
        reading counts then (it may re-arm or stop pacing)."""
        totals, n = self._sorted_totals, len(self._sorted_totals)
        if n < _MIN_MEDIAN_POINTS:
            return None
        cfg = self.config
        index = (n - 1) // 2 - (num_steps - 1)
        low_s = totals[index] if index >= 0 else 0.0
        if index < 0:
            bound_s = 0.0
        elif cfg.slow_component_growth_steps > 0:   # a component may make a step slow from
            bound_s = low_s + cfg.slow_step_floor_s  # the floor on
        else:
            bound_s = max(cfg.slow_step_factor * low_s, low_s + cfg.slow_step_floor_s)
        if cfg.slow_step_abs_s is not None:
            bound_s = min(bound_s, cfg.slow_step_abs_s)
        quiet_frac = (cfg.memory_watermark_frac - cfg.memory_hysteresis_frac
                      if self._armed and not self._pacing else float("-inf"))
        return bound_s, quiet_frac

    def state_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able) to checkpoint the gate. The release spacing restarts on load:
        a monotonic clock reading means nothing in another process. ``stopped`` is not kept:
        the final checkpoint of a CHECKPOINT_AND_STOP would otherwise resume a gate that never
        stops again, however full memory gets."""
        return {
            "version": _STATE_VERSION,
            "window": [s.to_dict() for s in self._window],
            "memory": list(self._memory),
            "run": [s.to_dict() for s in self._run],
            "run_reported": self._run_reported,
            "run_cause": None if self._run_cause is None else self._run_cause.value,
            "run_parts": self._run_parts,
            "streak": self._streak,
            "ended_runs": [list(r) for r in self._ended_runs],
            "num_seen": self._num_seen,
            "armed": self._armed,
            "pacing": self._pacing,
            "next_id": self._next_id,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state.get("version") != _STATE_VERSION:
            raise InputError("state['version']", "unknown gate state version",
                             value=state.get("version"),
                             fix=f"pass a state_dict() of this StepGate (version {_STATE_VERSION})")
        self._window = deque((StepStats.from_dict(d) for d in state["window"]),
                             maxlen=self.config.step_window)
        self._sorted_totals = sorted(s.total_s for s in self._window)
        self._memory = deque((float(x) for x in state["memory"]),
                             maxlen=self.config.memory_trend_steps)
        self._run = [StepStats.from_dict(d) for d in state["run"]]
        self._run_reported = bool(state["run_reported"])
        run_cause = state["run_cause"]
        self._run_cause = None if run_cause is None else Cause(run_cause)
        self._run_parts = int(state["run_parts"])
        self._streak = int(state["streak"])
        self._ended_runs = deque((int(a), int(b)) for a, b in state["ended_runs"])
        self._num_seen = int(state["num_seen"])
        self._armed = bool(state["armed"])
        self._stopped = False              # a resumed run is protected anew (see state_dict)
        self._pacing = bool(state["pacing"])
        self._next_id = int(state["next_id"])
        self._last_release_s = None

    @property
    def window(self) -> tuple[StepStats, ...]:
        """The recent steps the rules compare with (at most ``step_window``, warm-up steps
        left out), oldest first; also what the run's cross-rank attribution reads."""
        return tuple(self._window)

    @property
    def num_host_starved(self) -> int:
        """Slow steps the host's contention or its aftermath explains (not counted as slow)."""
        return self._excuses.num_host_starved

    @property
    def num_waited_for_peer(self) -> int:
        """Slow steps in communication that waited for a rank of the node that worked
        longer (not counted as slow)."""
        return self._excuses.num_waited_for_peer

    @property
    def slow_run_length(self) -> int:
        """Slow steps in a row at the end of what was fed (0 after a step under the threshold):
        with :meth:`quiet_limits`, how many more steps over its time bound may wait before one
        of them could complete a run of ``num_slow_steps``."""
        return len(self._run)

    @property
    def stopped(self) -> bool:
        """Whether CHECKPOINT_AND_STOP was decided already."""
        return self._stopped

    # -- memory ------------------------------------------------------------------------------
    def _release_spaced(self) -> bool:
        if self._last_release_s is None:
            return True
        return self._clock() - self._last_release_s >= self.config.release_cache_min_interval_s

    def claim_release(self) -> bool:
        """Whether a cache release may run now, and if so, count it: the rank's one spacing
        (``release_cache_min_interval_s``) for its gate's releases and the cluster's alike."""
        if not self._release_spaced():
            return False
        self._last_release_s = self._clock()
        return True

    def _critical_reason(self, frac: float) -> str | None:
        cfg = self.config
        if frac >= cfg.memory_critical_frac:
            return f"memory at {frac:.1%} >= critical {cfg.memory_critical_frac:.0%}"
        if (cfg.memory_predict_steps == 0 or frac < cfg.memory_watermark_frac
                or len(self._memory) < min(_MIN_MEDIAN_POINTS, cfg.memory_trend_steps)):
            return None
        rise = slope(list(enumerate(self._memory)))
        predicted = frac + rise * cfg.memory_predict_steps
        if rise > 0 and predicted >= cfg.memory_critical_frac:
            return (f"memory at {frac:.1%} rising {rise:.2%} per step, {predicted:.1%} predicted "
                    f"in {cfg.memory_predict_steps} steps >= critical "
                    f"{cfg.memory_critical_frac:.0%}")
        return None

    # -- timing ------------------------------------------------------------------------------
    def _rule_text(self, threshold_s: float) -> str:
        cfg = self.config
        if cfg.slow_step_abs_s is not None and threshold_s == cfg.slow_step_abs_s:
            return f"absolute {cfg.slow_step_abs_s:g} s"
        totals = self._sorted_totals
        if len(totals) < _MIN_MEDIAN_POINTS:
            return "no baseline"
        median_s = statistics.median(totals)
        sigma_s = robust_sigma(totals, median_s)
        terms = [(cfg.slow_step_factor * median_s,
                  f"{cfg.slow_step_factor:g} x recent median {median_s:.4f} s"),
                 (median_s + cfg.slow_step_floor_s,
                  f"recent median {median_s:.4f} s + floor {cfg.slow_step_floor_s:g} s"),
                 (median_s + cfg.slow_step_mad_k * sigma_s,
                  (f"recent median {median_s:.4f} s + {cfg.slow_step_mad_k:g} x robust spread "
                   f"{sigma_s:.4f} s"))]
        return max(terms, key=lambda t: t[0])[1]

    def _persistence(self, step: int) -> int:
        """Slow steps in one cause that make an event: ``num_slow_steps``, or with
        ``slow_step_adaptive_persistence`` one more than the longest streak of slow steps that
        ended by itself within the last ``step_window`` steps, at most
        ``MAX_PERSISTENCE_FACTOR`` x ``num_slow_steps``."""
        cfg = self.config
        if not cfg.slow_step_adaptive_persistence:
            return cfg.num_slow_steps
        ended = self._ended_runs
        while ended and ended[0][0] <= step - cfg.step_window:
            ended.popleft()
        longest = max((n for _, n in ended), default=0)
        return min(MAX_PERSISTENCE_FACTOR * cfg.num_slow_steps,
                   max(cfg.num_slow_steps, longest + 1))

    def _most_grown(self, stats: StepStats) -> tuple[Cause, float, list[float]]:
        """(cause, growth in seconds, the window's values) of the component that grew most
        over its window median; (UNKNOWN, 0, []) when none grew."""
        best: tuple[Cause, float, list[float]] = (Cause.UNKNOWN, 0.0, [])
        for c, _, get in _COMPONENTS:
            values = [get(s) for s in self._window]
            growth = get(stats) - statistics.median(values) if values else 0.0
            if growth > best[1]:
                best = (c, growth, values)
        return best

    def _component_slow(self, stats: StepStats, median_s: float) -> tuple[Cause, bool]:
        """Whether the rank's own work that grew most (data wait or compute) grew past
        ``slow_component_growth_steps`` median steps, the floor and ``slow_step_mad_k`` of its
        own robust spreads. Not communication wait: it adds to the whole step undiminished,
        which the whole-step rule weighs already."""
        cfg = self.config
        cause, growth_s, values = self._most_grown(stats)
        if cause not in (Cause.DATA, Cause.COMPUTE):
            return cause, False
        line_s = max(cfg.slow_step_floor_s, cfg.slow_component_growth_steps * median_s)
        if growth_s <= line_s:
            return cause, False
        part_median = statistics.median(values)
        return cause, growth_s > cfg.slow_step_mad_k * robust_sigma(values, part_median)

    def _slow_step_decision(self, stats: StepStats, threshold_s: float) -> Decision:
        rule = self._rule_text(threshold_s)
        run_steps = {s.step for s in self._run}
        baseline = [s for s in self._window if s.step not in run_steps]
        cause, detail = attribute_slow_steps(self._run, baseline)
        first, last = self._run[0].step, self._run[-1].step
        run_median = statistics.median(s.total_s for s in self._run)
        cfg = self.config
        if self._run_parts:
            why = (f"median {run_median:.4f} s; {self._run_parts} of them slow by the rank's own "
                   f"{self._run_cause.value}, grown by more than "
                   f"{cfg.slow_component_growth_steps:g} median step(s), the floor and "
                   f"{cfg.slow_step_mad_k:g} robust spreads of its own")
        else:
            why = (f"median {run_median:.4f} s; each step over its line, the last one's "
                   f"{threshold_s:.4f} s, {rule}")
        reason = (f"rank {stats.world_rank} steps {first}-{last}: {len(self._run)} slow steps in "
                  f"a row ({why}); {detail}")
        return self._decide(Action.SLOW_STEP, cause, reason, num_steps=len(self._run),
                            threshold_s=threshold_s, median_s=run_median)

    def _decide(self, action: Action, cause: Cause, reason: str, **params: Any) -> Decision:
        decision = Decision(action, reason, None, cause, "rank", params, self._next_id)
        self._next_id += 1
        return decision


# -- attribution -------------------------------------------------------------------------------
_COMPONENTS = (  # order breaks ties
    (Cause.DATA, "data wait", lambda s: s.data_wait_s),
    (Cause.COMPUTE, "compute", lambda s: s.compute_s),
    (Cause.COMMUNICATION, "communication wait", lambda s: s.comm_wait_s),
)


def attribute_slow_steps(slow: Sequence[StepStats],
                         baseline: Sequence[StepStats]) -> tuple[Cause, str]:
    """Cause of a run of slow steps on one rank: the component that grew most (median of the
    run minus median of the baseline, in seconds). UNKNOWN when none grew, or when the untimed
    rest of the step grew more than any of them."""
    if not slow:
        raise InputError("slow", "is empty", value=[], fix="pass at least one slow step")
    if not baseline:
        return Cause.UNKNOWN, "no baseline steps to compare with"
    growth = []
    for cause, name, get in _COMPONENTS:
        before = statistics.median(get(s) for s in baseline)
        after = statistics.median(get(s) for s in slow)
        growth.append((after - before, cause, name, before, after))
    total_growth = (statistics.median(s.total_s for s in slow)
                    - statistics.median(s.total_s for s in baseline))
    untimed = total_growth - sum(g[0] for g in growth)
    text = ", ".join(f"{name} {g:+.4f} s ({b:.4f} -> {a:.4f})" for g, _, name, b, a in growth)
    best = max(growth, key=lambda g: g[0])   # max keeps the first of equals: data, compute, comm
    if best[0] <= 0 or untimed > best[0]:
        return Cause.UNKNOWN, f"no timed phase explains it ({text}, untimed {untimed:+.4f} s)"
    return best[1], f"{best[2]} grew most: {text}"


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
    """Name the stragglers among ranks from each rank's recent StepStats window (pure).

    The stragglers are the coordinator's (:func:`~raytrain_guard.core.straggler.score_ranks`):
    a rank whose data wait or compute median exceeds the reference rank's (the lower median
    across ranks) by ``straggler_frac`` of the median step or more is a data (compute)
    straggler. Any other rank whose communication wait exceeds the least one among ranks by
    more than ``straggler_frac`` x the median step is waiting (under DDP the straggler waits
    least and the others wait for it). Either gap must also reach ``floor_s`` (seconds): 10 %
    of a 4 ms step is 0.4 ms, jitter on a loaded box. One result per window, in order; ``world_rank`` is
    taken from the stats (the position when empty).
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
            f"{frac * score.step_s:.4f} s" + (f", floor {floor_s:g} s)" if thr == floor_s
                                              and floor_s > frac * score.step_s else ")"))
    if rank in stragglers:
        excess = f"{score.excess_frac:+.1%} of a step over the reference rank {tail}"
        if score.cause is Cause.COMPUTE:
            return RankRole.STRAGGLER_COMPUTE, (
                f"rank {rank}: compute {m.compute_s:.4f} s is {excess}; it waits "
                f"{m.comm_wait_s:.4f} s in communication")
        return RankRole.STRAGGLER_DATA, f"rank {rank}: data wait {m.data_wait_s:.4f} s is {excess}"
    wait_gap = m.comm_wait_s - least_wait
    if wait_gap > thr and stragglers:
        on = ", ".join(str(r) for r in stragglers)
        return RankRole.WAITING, (
            f"rank {rank}: waits {m.comm_wait_s:.4f} s in communication, {wait_gap:+.4f} s "
            f"over the least-waiting rank {tail}; waiting on rank {on}")
    if wait_gap > thr:
        return RankRole.WAITING, (
            f"rank {rank}: waits {m.comm_wait_s:.4f} s in communication, {wait_gap:+.4f} s "
            f"over the least-waiting rank {tail}")
    return RankRole.NORMAL, f"rank {rank}: within {thr:.4f} s of the reference rank {tail}"
