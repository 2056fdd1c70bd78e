"""The recent steps a rank's slow-step rules compare a step with (pure)."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable

from raytrain_guard.core.decisions import Cause
from raytrain_guard.core.stats import median_of_sorted
from raytrain_guard.core.steps import StepStats

MIN_MEDIAN_POINTS = 3
"""A median of fewer than three steps is one of them, not a baseline."""

#: The timed parts of a step, in the order that breaks ties, with their names in reasons.
PARTS = ((Cause.DATA, "data wait"), (Cause.COMPUTE, "compute"),
         (Cause.COMMUNICATION, "communication wait"))


def parts_of(stats: StepStats) -> tuple[float, float, float]:
    """The step's timed parts in :data:`PARTS` order (seconds)."""
    return stats.data_wait_s, stats.compute_s, stats.comm_wait_s


class RecentSteps:
    """The last ``size`` steps judged (oldest first), their totals kept sorted (a median is
    one index) and their parts by column (a part's median is one sort)."""

    def __init__(self, size: int) -> None:
        self.steps: deque[StepStats] = deque(maxlen=size)
        self.sorted_totals: list[float] = []
        self._parts: deque[tuple[float, float, float]] = deque(maxlen=size)

    def load(self, steps: Iterable[StepStats]) -> None:
        """Hold ``steps`` instead (a restored gate's)."""
        self.steps.clear()
        self.sorted_totals.clear()
        self._parts.clear()
        for stats in steps:
            self.add(stats)

    def add(self, stats: StepStats) -> None:
        steps, totals = self.steps, self.sorted_totals
        if len(steps) == steps.maxlen:
            del totals[bisect.bisect_left(totals, steps[0].total_s)]
        steps.append(stats)
        self._parts.append(parts_of(stats))
        bisect.insort(totals, stats.total_s)

    def most_grown(self, stats: StepStats) -> tuple[Cause, float, list[float]]:
        """(cause, growth in seconds over its median here, the window's values sorted) of the
        part of ``stats`` that grew most; (UNKNOWN, 0, []) when none grew."""
        best: tuple[Cause, float, list[float]] = (Cause.UNKNOWN, 0.0, [])
        if not self._parts:
            return best
        for (cause, _), value, column in zip(PARTS, parts_of(stats), zip(*self._parts)):
            values = sorted(column)
            growth = value - median_of_sorted(values)
            if growth > best[1]:
                best = (cause, growth, values)
        return best
