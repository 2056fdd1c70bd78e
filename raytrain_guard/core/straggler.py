"""Per-rank straggler scores with attribution: input, compute or communication (pure).

In DDP the ranks' wall-clock step times equalize: a rank slow in compute makes the others wait
inside the allreduce. So a rank is scored on what it spends *itself* (data wait, compute), each
compared with the faster half of the ranks, and not on its wall time. Scores are in units of a
median step: ``excess_frac = 0.4`` means the rank adds 40 % of a step over the reference rank.

The reference of each component is the lower median across ranks (``statistics.median_low``):
with two ranks it is the faster one, and with many ranks it is a typical healthy rank as long
as fewer than half are slow. Communication is attributed only when no rank is slow in data or
compute: otherwise a high communication wait is the symptom of waiting for the straggler.

The coordinator summarizes each rank's window once per report (:func:`summarize_columns`) and
scores the summaries in O(ranks) (:func:`score_summaries`); the train loop's end-of-run
attribution (``core.gate.attribute_across_ranks``) uses the same scores.

Worked example (4 ranks, every step 1.0 s, medians over each rank's window)::

    rank  data  compute  comm      reference (median_low): data 0.05, compute 0.5, comm 0.45
    0     0.05  0.5      0.45      rank 3: compute excess (0.9 - 0.5) / 1.0 = 0.40 -> COMPUTE
    1     0.05  0.5      0.45      ranks 0-2: no excess -> 0.0
    2     0.05  0.5      0.45
    3     0.05  0.9      0.05
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import sub

from raytrain_guard.core.columns import StepColumns
from raytrain_guard.core.decisions import Cause
from raytrain_guard.core.stats import median_of_sorted, nearest_rank, robust_sigma
from raytrain_guard.core.steps import StepStats


@dataclass(slots=True)
class StragglerScore:
    """How much of a median step one rank adds over the reference rank, and in what."""

    world_rank: int
    excess_frac: float      # >= 0; the worst component's excess over the reference, / step
    cause: Cause            # DATA, COMPUTE, COMMUNICATION; UNKNOWN when there is no excess
    data_wait_s: float      # this rank's medians over its window
    compute_s: float
    comm_wait_s: float
    step_s: float           # median step time across ranks (the unit of excess_frac)
    num_steps: int

    def to_dict(self) -> dict:
        return {"world_rank": self.world_rank, "excess_frac": round(self.excess_frac, 4),
                "cause": self.cause.value, "data_wait_s": self.data_wait_s,
                "compute_s": self.compute_s, "comm_wait_s": self.comm_wait_s,
                "step_s": self.step_s, "num_steps": self.num_steps}


@dataclass(slots=True)
class TimingSummary:
    """Medians of one rank's window: what the scores compare across ranks."""

    data_wait_s: float
    compute_s: float
    comm_wait_s: float
    total_s: float
    num_steps: int
    total_p99_s: float = 0.0     # nearest-rank 99th percentile of the step times
    # robust spread (1.4826 x MAD) of each component over the window: the rank's own noise
    data_sigma_s: float = 0.0
    compute_sigma_s: float = 0.0
    comm_sigma_s: float = 0.0


def summarize(window: Sequence[StepStats]) -> TimingSummary:
    """Medians and robust spreads over a window of StepStats."""
    return summarize_columns(StepColumns.of(window))


def summarize_columns(c: StepColumns) -> TimingSummary:
    """Medians and robust spreads over a window's columns (about 17 us for 50 steps)."""
    if not c.total:
        return TimingSummary(0.0, 0.0, 0.0, 0.0, 0)
    totals = sorted(c.total)
    (m_data, s_data), (m_compute, s_compute), (m_comm, s_comm) = \
        _median_sigma(c.data), _median_sigma(c.compute), _median_sigma(c.comm)
    return TimingSummary(m_data, m_compute, m_comm, median_of_sorted(totals), len(totals),
                         nearest_rank(totals, 0.99), s_data, s_compute, s_comm)


def _median_sigma(values: Sequence[float]) -> tuple[float, float]:
    """(median, robust spread)."""
    m = median_of_sorted(sorted(values))
    return m, robust_sigma(values, m)


def score_summaries(summaries: Mapping[int, TimingSummary], *, min_steps: int = 3,
                    noise_frac: float = 0.05) -> dict[int, StragglerScore]:
    """Score every rank with at least ``min_steps`` steps in its window (O(ranks)).

    ``noise_frac`` is the excess below which data/compute differences are treated as jitter
    when deciding whether communication may be blamed. Needs two ranks or more; fewer gives {}.
    """
    medians = {r: s for r, s in summaries.items() if s.num_steps >= min_steps}
    if len(medians) < 2:
        return {}
    values = list(medians.values())
    ref_data = statistics.median_low([v.data_wait_s for v in values])
    ref_compute = statistics.median_low([v.compute_s for v in values])
    ref_comm = statistics.median_low([v.comm_wait_s for v in values])
    step_s = statistics.median([v.total_s for v in values])
    if step_s <= 0:
        return {}

    own: dict[int, tuple[float, Cause]] = {}
    for rank, m in medians.items():
        excess_data = (m.data_wait_s - ref_data) / step_s
        excess_compute = (m.compute_s - ref_compute) / step_s
        own[rank] = ((excess_data, Cause.DATA) if excess_data > excess_compute
                     else (excess_compute, Cause.COMPUTE))
    someone_slow = any(excess > noise_frac for excess, _ in own.values())

    scores: dict[int, StragglerScore] = {}
    for rank, m in medians.items():
        excess, cause = own[rank]
        if not someone_slow:
            excess_comm = (m.comm_wait_s - ref_comm) / step_s
            if excess_comm > excess:
                excess, cause = excess_comm, Cause.COMMUNICATION
        if excess <= 0:
            excess, cause = 0.0, Cause.UNKNOWN
        scores[rank] = StragglerScore(rank, excess, cause, m.data_wait_s, m.compute_s,
                                      m.comm_wait_s, step_s, m.num_steps)
    return scores


# -- persistent slowdowns, step by step ------------------------------------------------------

_COMPONENTS = (("data", Cause.DATA, "data_sigma_s"),
               ("compute", Cause.COMPUTE, "compute_sigma_s"),
               ("comm", Cause.COMMUNICATION, "comm_sigma_s"))


MISS_SHARE = 0.1
"""Share of a run of slow steps that may miss the threshold (rounded down): 2 of 20. Another
rank's outlier shortens a slow link's excess below the line at one step in a few dozen
(tests/test_noise.py)."""


@dataclass(frozen=True)
class Slowdown:
    """A rank slower than the reference rank at ``steps``, all but ``MISS_SHARE`` of them
    (``num_over`` cleared the threshold). ``excess_s``: the smallest excess over the per-step
    reference (the lower median across ranks) among those that cleared it. ``threshold_s``:
    the largest of ``straggler_frac`` x the median step, the floor, and ``mad_k`` x sqrt(2) x
    the typical rank's robust spread (an excess is the difference of two noisy figures)."""

    world_rank: int
    cause: Cause
    excess_s: float
    threshold_s: float
    component_s: float          # the rank's median of that component over those steps
    reference_s: float          # the reference's median over those steps
    step_s: float
    steps: tuple[int, ...]
    num_over: int               # how many of ``steps`` cleared the threshold

    @property
    def excess_frac(self) -> float:
        return self.excess_s / self.step_s if self.step_s > 0 else 0.0


def persistent_slowdowns(columns: Mapping[int, StepColumns],
                         summaries: Mapping[int, TimingSummary], *, num_steps: int = 3,
                         straggler_frac: float = 0.10, floor_s: float = 0.002,
                         mad_k: float = 3.5, scan_steps: int | None = None
                         ) -> dict[int, Slowdown]:
    """The ranks slow in data or compute (or, when none is, communication) over ``num_steps``
    consecutive steps (all but ``MISS_SHARE``; the first and the last slow) among the last
    ``scan_steps`` steps every rank reported, against the per-step reference; the latest run
    counts. Step by step, not window medians: a step the whole group pays raises the
    reference with it, so nobody is blamed for it. Needs two ranks with ``num_steps`` common
    steps; fewer gives {}.

    Example (2 ranks, compute in ms at steps 8-10: rank 0 [3.0, 3.2, 2.9], rank 1 [7.5, 8.0,
    7.4]; median step 4 ms, spreads 0.2 ms): reference (median_low) [3.0, 3.2, 2.9]; rank 1's
    excess [4.5, 4.8, 4.5] -> 4.5 ms >= max(0.1 x 4, 2, 3.5 x 1.414 x 0.2 = 0.99) ms: COMPUTE.
    """
    ranks = [r for r, c in columns.items() if c.steps and r in summaries]
    if len(ranks) < 2 or num_steps < 1:
        return {}
    scan = max(num_steps, scan_steps or num_steps)
    steps, at = _common_steps({r: columns[r].steps for r in ranks}, scan)
    if len(steps) < num_steps:
        return {}
    step_s = statistics.median([summaries[r].total_s for r in ranks])
    if step_s <= 0:
        return {}
    found: dict[int, Slowdown] = {}
    for name, cause, sigma_field in _COMPONENTS:
        if cause is Cause.COMMUNICATION and found:
            break     # communication waits are the symptom of the stragglers found
        sigma = statistics.median_low([getattr(summaries[r], sigma_field) for r in ranks])
        threshold = max(straggler_frac * step_s, floor_s, mad_k * math.sqrt(2) * sigma)
        by_rank = {r: at(r, getattr(columns[r], name)) for r in ranks}
        refs = [statistics.median_low(at_step) for at_step in zip(*by_rank.values())]
        for r, values in by_rank.items():
            excess = list(map(sub, values, refs))
            if max(excess) < threshold:       # the common case: no step over the line
                continue
            run = _latest_run(excess, threshold, num_steps)
            if run is None:
                continue
            over = [e for e in excess[run] if e >= threshold]
            if r not in found or (min(over) / threshold > found[r].excess_s
                                  / found[r].threshold_s):
                found[r] = Slowdown(r, cause, min(over), threshold,
                                    statistics.median(values[run]),
                                    statistics.median(refs[run]), step_s,
                                    tuple(steps[run]), len(over))
    return found


def _common_steps(steps_of: Mapping[int, Sequence[int]], scan: int):
    """The steps every rank reported among each one's latest ``scan`` up to the rank behind,
    and ``at(rank, column)``: that column's values there. Where every rank's steps there are
    consecutive (the rule), by index and slices; otherwise by step number."""
    last = min(s[-1] for s in steps_of.values())
    spans = {}
    for r, s in steps_of.items():
        end = len(s) - 1 - (s[-1] - last)      # where ``last`` is, if the tail is consecutive
        start = max(0, end - scan + 1)
        if end < 0 or s[end] != last or s[end] - s[start] != end - start:
            return _common_steps_by_number(steps_of, scan, last)
        spans[r] = (start, end + 1)
    n = min(stop - start for start, stop in spans.values())
    return (list(range(last - n + 1, last + 1)),
            lambda r, column: column[spans[r][1] - n:spans[r][1]])


def _common_steps_by_number(steps_of: Mapping[int, Sequence[int]], scan: int, last: int):
    index: dict[int, dict[int, int]] = {}
    for r, s in steps_of.items():
        found: dict[int, int] = {}
        for i in range(len(s) - 1, -1, -1):
            if s[i] <= last:
                found[s[i]] = i
                if len(found) >= scan:
                    break
        index[r] = found
    steps = sorted(set.intersection(*(set(f) for f in index.values())))[-scan:]
    return steps, lambda r, column: [column[index[r][st]] for st in steps]


def _latest_run(excess: Sequence[float], threshold: float, num_steps: int) -> slice | None:
    """The latest ``num_steps`` consecutive positions that begin and end with an excess at or
    over ``threshold`` and miss it at no more than ``MISS_SHARE`` of them (rounded down: none
    of 3, 2 of 20); None when there is no such run.

    Example (threshold 1, 10 steps, 1 may miss): excess [2, 2, 0, 2, 2, 2, 2, 2, 2, 2, 0]
    -> positions 0-9 (one miss, at 2); positions 1-10 begin and end under the line."""
    allowed = int(num_steps * MISS_SHARE)
    over = [e >= threshold for e in excess]
    misses = 0
    best = None
    for i, hit in enumerate(over):
        misses += not hit
        if i >= num_steps:
            misses -= not over[i - num_steps]
        first = i + 1 - num_steps
        if first >= 0 and misses <= allowed and hit and over[first]:
            best = slice(first, i + 1)
    return best
