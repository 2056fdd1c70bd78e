"""Per-rank straggler scores with attribution: input, compute or communication (pure).

In DDP the ranks' wall-clock step times equalize: a rank slow in compute makes the others wait
inside the allreduce. So a rank is scored on what it spends *itself* (data wait, compute), each
compared with the faster half of the ranks, and not on its wall time. Scores are in units of a
median step: ``excess_frac = 0.4`` means the rank adds 40 % of a step over the reference rank.

The reference of each component is the lower median across ranks (``statistics.median_low``):
with two ranks it is the faster one, and with many ranks it is a typical healthy rank as long
as fewer than half are slow. Communication is attributed only when no rank is slow in data or
compute: otherwise a high communication wait is the symptom of waiting for the straggler.

This is the one straggler rule: the coordinator summarizes each rank's window once per report
(:func:`summarize`) and scores the summaries in O(ranks) (:func:`score_summaries`); the train
loop's end-of-run attribution (``core.gate.attribute_across_ranks``) names its stragglers
with the same scores, adding only who waits on them.

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

from raytrain_guard.core.decisions import Cause
from raytrain_guard.core.excuses import cpu_waited_s, usual_cpu_waits
from raytrain_guard.core.stats import nearest_rank, robust_sigma
from raytrain_guard.core.steps import StepStats


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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
    """Medians and robust spreads over a window (the coordinator does this once per report,
    not per round)."""
    if not window:
        return TimingSummary(0.0, 0.0, 0.0, 0.0, 0)
    totals = sorted(s.total_s for s in window)
    data = [s.data_wait_s for s in window]
    compute = [s.forward_s + s.backward_s + s.optimizer_s for s in window]
    comm = [s.comm_wait_s for s in window]
    m_data, m_compute, m_comm = (statistics.median(data), statistics.median(compute),
                                 statistics.median(comm))
    return TimingSummary(m_data, m_compute, m_comm, statistics.median(totals), len(totals),
                         nearest_rank(totals, 0.99), robust_sigma(data, m_data),
                         robust_sigma(compute, m_compute), robust_sigma(comm, m_comm))


def score_ranks(windows: Mapping[int, Sequence[StepStats]], *, min_steps: int = 3,
                noise_frac: float = 0.05) -> dict[int, StragglerScore]:
    """Score every rank with at least ``min_steps`` statistics in its window.

    ``noise_frac`` is the excess below which data/compute differences are treated as jitter
    when deciding whether communication may be blamed. Needs two ranks or more; fewer gives {}.
    """
    return score_summaries({r: summarize(w) for r, w in windows.items()}, min_steps=min_steps,
                           noise_frac=noise_frac)


def score_summaries(summaries: Mapping[int, TimingSummary], *, min_steps: int = 3,
                    noise_frac: float = 0.05) -> dict[int, StragglerScore]:
    """:func:`score_ranks` on precomputed window medians (O(ranks) per round)."""
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

_COMPONENTS = (("data", Cause.DATA, lambda s: s.data_wait_s, "data_sigma_s"),
               ("compute", Cause.COMPUTE, lambda s: s.compute_s, "compute_sigma_s"),
               ("communication", Cause.COMMUNICATION, lambda s: s.comm_wait_s, "comm_sigma_s"))


MISS_SHARE = 0.1
"""Share of a run of slow steps that may miss the threshold (rounded down): 2 of the
coordinator's 20 straggler steps. In a 4-rank series with outliers on 3 % of every rank's
steps, another rank's outlier shortens a slow link's excess below the line at one step in a
few dozen, and broke a strict run of 20 in 2 of 15 seeded cases (tests/test_noise.py)."""


@dataclass(frozen=True)
class Slowdown:
    """A rank slower than the reference rank at the last ``steps`` common steps, all but at
    most ``MISS_SHARE`` of them (``num_over`` cleared the threshold).

    ``excess_s`` is the smallest excess of the slow component over the per-step reference
    (the lower median across ranks at the same step) over the steps that cleared it:
    persistence, since each of them exceeds it. ``threshold_s`` is what it had to clear: the
    largest of ``straggler_frac`` x the median step, the absolute floor, and ``mad_k`` x
    sqrt(2) x the typical rank's robust spread of that component (an excess is the difference
    of two noisy figures).
    """

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

    def to_dict(self) -> dict:
        return {"world_rank": self.world_rank, "cause": self.cause.value,
                "excess_s": round(self.excess_s, 6), "threshold_s": round(self.threshold_s, 6),
                "component_s": round(self.component_s, 6),
                "reference_s": round(self.reference_s, 6), "step_s": round(self.step_s, 6),
                "steps": list(self.steps), "num_over": self.num_over}


def persistent_slowdowns(windows: Mapping[int, Sequence[StepStats]],
                         summaries: Mapping[int, TimingSummary], *, num_steps: int = 3,
                         straggler_frac: float = 0.10, floor_s: float = 0.002,
                         mad_k: float = 3.5, scan_steps: int | None = None,
                         host_wait_frac: float = 0.0, host_settle_steps: int = 0,
                         host_settle_factor: float = 1.5) -> dict[int, Slowdown]:
    """The ranks slow in data or compute (or, when none is, communication) over ``num_steps``
    consecutive steps (at each of them but ``MISS_SHARE``, rounded down; the first and the last
    slow), among the last ``scan_steps`` steps (default ``num_steps``; the coordinator scans
    max(``report_every_steps``, ``straggler_steps``)) that every rank has reported, against the per-step reference. The
    latest such run counts.

    Step by step, not window medians: a slowdown is named ``num_steps`` steps after it starts
    (once reported), and a step the whole group pays (a loaded shared box, a slow batch for
    every rank) raises the reference with it, so nobody is blamed for it. Needs two ranks or
    more with ``num_steps`` common steps; fewer gives {}.

    With ``host_wait_frac`` > 0, a rank's step whose excess the host's contention explains
    does not count and ends a run, as in the step gate (``slow_step_host_wait_frac``,
    ``slow_step_host_settle_steps``): the rank's wait for a CPU (``cpu_wait_s``, and for
    communication the node peer's, ``peer_cpu_wait_s``, each over its usual one in the window)
    at least that fraction of the excess, and the ``host_settle_steps`` steps after such a
    step that are no slower than ``host_settle_factor`` x its time.

    Example (2 ranks, compute in ms at steps 8-10: rank 0 [3.0, 3.2, 2.9], rank 1 [7.5, 8.0,
    7.4]; median step 4 ms, spreads 0.2 ms): reference (median_low) [3.0, 3.2, 2.9]; rank 1's
    excess [4.5, 4.8, 4.5] -> 4.5 ms >= max(0.1 x 4, 2, 3.5 x 1.414 x 0.2 = 0.99) ms: COMPUTE.
    """
    ranks = [r for r, w in windows.items() if w and r in summaries]
    if len(ranks) < 2 or num_steps < 1:
        return {}
    scan = max(num_steps, scan_steps or num_steps)
    last = min(windows[r][-1].step for r in ranks)
    aligned: dict[int, dict[int, StepStats]] = {}
    for r in ranks:
        found: dict[int, StepStats] = {}
        for s in reversed(windows[r]):
            if s.step <= last:
                found[s.step] = s
                if len(found) >= scan:
                    break
        aligned[r] = found
    common = set.intersection(*(set(a) for a in aligned.values()))
    steps = sorted(common)[-scan:]
    if len(steps) < num_steps:
        return {}
    step_s = statistics.median([summaries[r].total_s for r in ranks])
    if step_s <= 0:
        return {}
    found_slow: dict[int, Slowdown] = {}
    for name, cause, get, sigma_field in _COMPONENTS:
        if cause is Cause.COMMUNICATION and found_slow:
            break     # communication waits are the symptom of the stragglers found
        sigma = statistics.median_low([getattr(summaries[r], sigma_field) for r in ranks])
        threshold = max(straggler_frac * step_s, floor_s, mad_k * math.sqrt(2) * sigma)
        by_rank = {r: [get(aligned[r][st]) for st in steps] for r in ranks}
        refs = [statistics.median_low(at_step) for at_step in zip(*by_rank.values())]
        for r, values in by_rank.items():
            excess = [v - ref for v, ref in zip(values, refs)]
            run = _latest_run(excess, threshold, num_steps)
            if run is not None and host_wait_frac > 0:
                # only a run can be excused (most ranks have none: 1,024 ranks, one round)
                explained = _host_explained(
                    [aligned[r][st] for st in steps], excess, windows[r], host_wait_frac,
                    host_settle_steps, host_settle_factor, cause is Cause.COMMUNICATION)
                excess = [0.0 if e else x for x, e in zip(excess, explained)]
                run = _latest_run(excess, threshold, num_steps)
            if run is None:
                continue
            over = [v - ref for v, ref, e in zip(values[run], refs[run], excess[run])
                    if e >= threshold]
            if r not in found_slow or (min(over) / threshold > found_slow[r].excess_s
                                       / found_slow[r].threshold_s):
                found_slow[r] = Slowdown(r, cause, min(over), threshold,
                                         statistics.median(values[run]),
                                         statistics.median(refs[run]), step_s,
                                         tuple(steps[run]), len(over))
    return found_slow


def _host_explained(stats: Sequence[StepStats], excess: Sequence[float],
                    window: Sequence[StepStats], frac: float, settle_steps: int,
                    settle_factor: float, with_peer: bool) -> list[bool]:
    """Per step of ``stats`` (consecutive, with their ``excess`` in one component), whether the
    host's contention explains it: the step gate's host-wait rule and its aftermath
    (``core.excuses``), here over one rank's steps as the coordinator has them."""
    usual = usual_cpu_waits(window)
    out = []
    until, starved_total_s = -1, 0.0
    for i, (s, e) in enumerate(zip(stats, excess)):
        if e > 0 and cpu_waited_s(s, usual, with_peer) >= frac * e:
            until, starved_total_s = i + settle_steps, s.total_s
            out.append(True)
        else:
            out.append(i <= until and s.total_s <= settle_factor * starved_total_s)
    return out


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
