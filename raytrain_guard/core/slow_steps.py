"""The step gate's slow-step rules (pure): which steps are slow and in what, and which runs of
them make an event. The rules and their figures: docs/train_loop.md ("The gate's rules")."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Cause, Decision
from raytrain_guard.core.recent_steps import MIN_MEDIAN_POINTS, PARTS, RecentSteps, parts_of
from raytrain_guard.core.stats import median_of_sorted, robust_sigma
from raytrain_guard.core.steps import StepStats
from raytrain_guard.errors import InputError

MAX_PERSISTENCE_FACTOR = 3
"""Adaptive persistence asks at most 3 x ``num_slow_steps`` slow steps (9 by default): the cap
keeps a real slowdown named within 9 steps on a box whose noise streaks reach 7."""

Verdict = tuple[Cause, bool, float]   # a slow step's (cause, slow by its part, line in s)


class SlowStepLine:
    """Whether a step is slow against ``recent``, and in which part. The line: the lower of
    ``slow_step_abs_s`` and the largest of ``slow_step_factor`` x the median, the median +
    ``slow_step_floor_s`` and the median + ``slow_step_mad_k`` robust spreads. Under it, a step
    is slow by its part when its data wait or compute grew by ``slow_component_growth_steps``
    median steps, the floor and ``slow_step_mad_k`` spreads of its own. The cause: the part
    that grew most (UNKNOWN: none)."""

    def __init__(self, config: GuardConfig, recent: RecentSteps) -> None:
        self.config = config
        self.recent = recent

    def judge(self, stats: StepStats) -> Verdict | None:
        """None for a step under its line, else its verdict."""
        cfg = self.config
        totals = self.recent.sorted_totals
        threshold_s = cfg.slow_step_abs_s
        median_s = None
        if len(totals) >= MIN_MEDIAN_POINTS:
            median_s = median_of_sorted(totals)
            relative_s = max(cfg.slow_step_factor * median_s, median_s + cfg.slow_step_floor_s)
            if threshold_s is None or relative_s < threshold_s:
                threshold_s = relative_s
            else:
                median_s = None                  # the absolute line decides: no spread test
        total_s = stats.total_s
        if threshold_s is not None and total_s > threshold_s:
            if median_s is not None and cfg.slow_step_mad_k > 0:
                threshold_s = max(threshold_s, median_s + cfg.slow_step_mad_k
                                  * robust_sigma(totals, median_s))
            if total_s > threshold_s:
                return self.recent.most_grown(stats)[0], False, threshold_s
        if (median_s is not None and cfg.slow_component_growth_steps > 0
                and total_s > median_s + cfg.slow_step_floor_s):
            cause, growth_s, values = self.recent.most_grown(stats)
            if cause in (Cause.DATA, Cause.COMPUTE) and growth_s > max(
                    cfg.slow_step_floor_s, cfg.slow_component_growth_steps * median_s) \
                    and growth_s > cfg.slow_step_mad_k * robust_sigma(values):
                return cause, True, threshold_s
        return None

    def waited_for_peer(self, stats: StepStats) -> bool:
        """Whether a step slow in communication waited for a rank of its node that did more
        work in it (its time less its communication wait, ``peer_work_s``) than this one by
        ``slow_step_peer_work_frac`` of the step's excess over the median (the floor at
        least): that rank's gate judges it."""
        frac, totals = self.config.slow_step_peer_work_frac, self.recent.sorted_totals
        if frac <= 0 or stats.peer_work_s is None or not totals:
            return False
        excess_s = max(stats.total_s - median_of_sorted(totals), self.config.slow_step_floor_s)
        return stats.peer_work_s - (stats.total_s - stats.comm_wait_s) >= frac * excess_s

    def quiet_bounds(self, num_steps: int) -> tuple[float, ...] | None:
        """For each of the next ``num_steps`` steps, a total under its line whatever steps
        enter the window before it (None: under three steps there). After j more steps the
        median is at least the ``(n - 1) // 2 - j``-th smallest of today's n totals, m: the
        line is at least m + the floor (where a part may make a step slow; else the larger of
        that and ``slow_step_factor`` x m), ``slow_step_abs_s`` at most; 0 when the index
        is < 0."""
        totals, cfg = self.recent.sorted_totals, self.config
        if len(totals) < MIN_MEDIAN_POINTS:
            return None
        bounds = []
        for j in range(num_steps):
            index = (len(totals) - 1) // 2 - j
            low_s = totals[index] if index >= 0 else 0.0
            bound_s = low_s + cfg.slow_step_floor_s if index >= 0 else 0.0
            if cfg.slow_component_growth_steps <= 0:
                bound_s = max(cfg.slow_step_factor * low_s, bound_s)
            bounds.append(bound_s if cfg.slow_step_abs_s is None
                          else min(bound_s, cfg.slow_step_abs_s))
        return tuple(bounds)

    def describe(self, threshold_s: float) -> str:
        """Which term made the line ``threshold_s``, in words."""
        cfg = self.config
        if cfg.slow_step_abs_s is not None and threshold_s == cfg.slow_step_abs_s:
            return f"absolute {cfg.slow_step_abs_s:g} s"
        totals = self.recent.sorted_totals
        if len(totals) < MIN_MEDIAN_POINTS:
            return "no baseline"
        median_s = median_of_sorted(totals)
        sigma_s = robust_sigma(totals, median_s)
        terms = [(cfg.slow_step_factor * median_s,
                  f"{cfg.slow_step_factor:g} x recent median {median_s:.4f} s"),
                 (median_s + cfg.slow_step_floor_s,
                  f"recent median {median_s:.4f} s + floor {cfg.slow_step_floor_s:g} s"),
                 (median_s + cfg.slow_step_mad_k * sigma_s,
                  (f"recent median {median_s:.4f} s + {cfg.slow_step_mad_k:g} x robust spread "
                   f"{sigma_s:.4f} s"))]
        return max(terms, key=lambda t: t[0])[1]


class SlowRuns:
    """Runs of slow steps in one cause (outliers land in random parts, a slowdown stays put):
    ``num_slow_steps`` in a row make one SLOW_STEP event, and with
    ``slow_step_adaptive_persistence`` must outlast the longest streak that ended by itself
    within ``step_window`` steps (:data:`MAX_PERSISTENCE_FACTOR` x ``num_slow_steps`` at most).
    A step that waited for a rank of its node does not count and ends a run not named yet;
    so does a step the gate did not judge (a pause's settling steps): a run is of steps in a
    row, never of slow steps on either side of a checkpoint."""

    def __init__(self, config: GuardConfig, line: SlowStepLine,
                 decide: Callable[..., Decision]) -> None:
        self.config = config
        self.line = line
        self._decide = decide
        self.run: list[StepStats] = []     # the current run of slow steps
        self.reported = False              # its event was decided
        self.cause: Cause | None = None    # the part it is slow in
        self.num_by_part = 0               # its steps slow by their part
        self._streak = 0                   # slow steps in a row, whatever their cause
        self._ended: deque[tuple[int, int]] = deque()   # (last step, length) of streaks that
                                                        # ended by themselves lately
        #: slow steps in communication that waited for a rank of the node that worked longer
        self.num_waited_for_peer = 0

    def observe(self, stats: StepStats) -> Decision | None:
        """Judge one step (before it enters the window); its event, if it completes one."""
        if self.run and stats.step != self.run[-1].step + 1:
            self._end_run(self.run[-1].step + 1)        # steps not judged came between
        verdict = self.line.judge(stats)
        if verdict is None:
            self._end_run(stats.step)
            return None
        cause, by_part, threshold_s = verdict
        if cause is Cause.COMMUNICATION and self.line.waited_for_peer(stats):
            # another rank's slowdown: it stays in the window, out of any run
            self.num_waited_for_peer += 1
            if not self.reported:
                self._clear()
            return None
        if self.run and cause is not self.cause:
            self._clear()
        self.cause = cause
        self.run.append(stats)
        self.num_by_part += by_part
        self._streak += 1
        if len(self.run) < self._persistence(stats.step) or self.reported:
            return None
        self.reported = True
        return self._event(stats, threshold_s)

    def _end_run(self, step: int) -> None:
        """The streak and the run end before ``step``."""
        if self._streak:
            self._ended.append((step, self._streak))
            self._streak = 0
        if self.run:
            self._clear()
            self.reported = False

    def _clear(self) -> None:
        self.run.clear()
        self.num_by_part = 0

    def _persistence(self, step: int) -> int:
        cfg = self.config
        if not cfg.slow_step_adaptive_persistence:
            return cfg.num_slow_steps
        ended = self._ended
        while ended and ended[0][0] <= step - cfg.step_window:
            ended.popleft()
        longest = max((n for _, n in ended), default=0)
        return min(MAX_PERSISTENCE_FACTOR * cfg.num_slow_steps,
                   max(cfg.num_slow_steps, longest + 1))

    def _event(self, stats: StepStats, threshold_s: float) -> Decision:
        run, cfg = self.run, self.config
        run_steps = {s.step for s in run}
        baseline = [s for s in self.line.recent.steps if s.step not in run_steps]
        cause, detail = attribute_slow_steps(run, baseline)
        run_median = statistics.median(s.total_s for s in run)
        if self.num_by_part:
            why = (f"median {run_median:.4f} s; {self.num_by_part} of them slow by the rank's "
                   f"own {self.cause.value}, grown by more than "
                   f"{cfg.slow_component_growth_steps:g} median step(s), the floor and "
                   f"{cfg.slow_step_mad_k:g} robust spreads of its own")
        else:
            why = (f"median {run_median:.4f} s; each step over its line, the last one's "
                   f"{threshold_s:.4f} s, {self.line.describe(threshold_s)}")
        reason = (f"rank {stats.world_rank} steps {run[0].step}-{run[-1].step}: {len(run)} slow "
                  f"steps in a row ({why}); {detail}")
        node_wide = cause is Cause.COMPUTE and peers_grew_too(
            run, baseline, cfg.slow_step_peer_work_frac)
        if node_wide:
            reason += ("; the node's other rank(s) worked longer in these steps too: the node "
                       "is slow, not this rank alone")
        return self._decide(Action.SLOW_STEP, cause, reason, num_steps=len(run),
                            first_step=run[0].step, node_wide=node_wide,
                            threshold_s=threshold_s, median_s=run_median)

    def state_dict(self) -> dict[str, Any]:
        return {"run": [s.to_dict() for s in self.run], "run_reported": self.reported,
                "run_cause": None if self.cause is None else self.cause.value,
                "run_parts": self.num_by_part, "streak": self._streak,
                "ended_runs": [list(r) for r in self._ended]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.run = [StepStats.from_dict(d) for d in state["run"]]
        self.reported = bool(state["run_reported"])
        self.cause = None if state["run_cause"] is None else Cause(state["run_cause"])
        self.num_by_part = int(state["run_parts"])
        self._streak = int(state["streak"])
        self._ended = deque((int(a), int(b)) for a, b in state["ended_runs"])


MIN_PEER_POINTS = 3
"""Peer figures :func:`peers_grew_too` needs in the baseline and in the run (all of a shorter
run's): a median of fewer is one step's noise."""


def peers_grew_too(slow: Sequence[StepStats], baseline: Sequence[StepStats],
                   frac: float) -> bool:
    """Whether the other ranks of this rank's node slowed with it: the most work another local
    rank did in a step (``peer_work_s``) grew, from the baseline's median to the slow steps',
    by at least ``frac`` of this rank's own growth in work (its time less its communication
    wait), which must be positive. The peer medians are of the steps with a peer figure (a
    rank that closes a step before its peers finds none: half of the steps or more, on a fast
    rank), :data:`MIN_PEER_POINTS` of each set at least. With more than two ranks on a node
    one other slowed rank is enough (the board keeps the most work, not each rank's). False
    without peer figures (a rank alone on its node, no board) or with ``frac`` 0
    (``slow_step_peer_work_frac`` off)."""
    peers_slow = [s.peer_work_s for s in slow if s.peer_work_s is not None]
    peers_base = [s.peer_work_s for s in baseline if s.peer_work_s is not None]
    if (frac <= 0 or len(peers_base) < MIN_PEER_POINTS
            or len(peers_slow) < min(MIN_PEER_POINTS, len(slow))):
        return False
    own = (statistics.median(s.total_s - s.comm_wait_s for s in slow)
           - statistics.median(s.total_s - s.comm_wait_s for s in baseline))
    peers = statistics.median(peers_slow) - statistics.median(peers_base)
    return own > 0 and peers >= frac * own


def attribute_slow_steps(slow: Sequence[StepStats],
                         baseline: Sequence[StepStats]) -> tuple[Cause, str]:
    """Cause of a run of slow steps on one rank: the part that grew most (median of the run
    minus median of the baseline, in seconds). UNKNOWN when none grew, or when the untimed
    rest of the step grew more than any of them."""
    if not slow:
        raise InputError("slow", "is empty", value=[], fix="pass at least one slow step")
    if not baseline:
        return Cause.UNKNOWN, "no baseline steps to compare with"
    growth = []
    for i, (cause, name) in enumerate(PARTS):
        before = statistics.median(parts_of(s)[i] for s in baseline)
        after = statistics.median(parts_of(s)[i] for s in slow)
        growth.append((after - before, cause, name, before, after))
    total_growth = (statistics.median(s.total_s for s in slow)
                    - statistics.median(s.total_s for s in baseline))
    untimed = total_growth - sum(g[0] for g in growth)
    text = ", ".join(f"{name} {g:+.4f} s ({b:.4f} -> {a:.4f})" for g, _, name, b, a in growth)
    best = max(growth, key=lambda g: g[0])   # max keeps the first of equals: data, compute, comm
    if best[0] <= 0 or untimed > best[0]:
        return Cause.UNKNOWN, f"no timed phase explains it ({text}, untimed {untimed:+.4f} s)"
    return best[1], f"{best[2]} grew most: {text}"
