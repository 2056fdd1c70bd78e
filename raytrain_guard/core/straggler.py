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

import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

from raytrain_guard.core.decisions import Cause
from raytrain_guard.core.stats import nearest_rank
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


def summarize(window: Sequence[StepStats]) -> TimingSummary:
    """Medians over a window (the coordinator does this once per report, not per round)."""
    if not window:
        return TimingSummary(0.0, 0.0, 0.0, 0.0, 0)
    totals = sorted(s.total_s for s in window)
    return TimingSummary(statistics.median([s.data_wait_s for s in window]),
                         statistics.median([s.forward_s + s.backward_s + s.optimizer_s
                                            for s in window]),
                         statistics.median([s.comm_wait_s for s in window]),
                         statistics.median(totals), len(totals),
                         nearest_rank(totals, 0.99))


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
