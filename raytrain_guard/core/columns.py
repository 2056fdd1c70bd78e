"""One rank's window of steps as columns of plain numbers (pure): what the coordinator keeps
per rank and the policy reads.

``array`` columns, not a StepStats per step: a policy round slices and sorts them in C, and
arrays hold no Python objects, so the garbage collector's full passes skip their contents (over
1,024 ranks x 50 steps of StepStats those passes cost more than a policy round).
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from raytrain_guard.core.steps import StepStats

NO_READING = math.nan
"""A step's memory fraction where the step read none."""


def floats(values: Iterable[float | None]) -> array:
    """``values`` as a float column, None as :data:`NO_READING`."""
    return array("d", (NO_READING if v is None else v for v in values))


@dataclass(slots=True)
class StepColumns:
    """A window's figures, oldest first, steps strictly increasing."""

    steps: array                 # "q"
    total: array                 # "d", and the rest
    data: array
    compute: array               # forward + backward + optimizer
    comm: array
    memory: array                # NO_READING where the step read none

    @classmethod
    def of(cls, window: Sequence[StepStats]) -> StepColumns:
        return cls(array("q", (s.step for s in window)), floats(s.total_s for s in window),
                   floats(s.data_wait_s for s in window), floats(s.compute_s for s in window),
                   floats(s.comm_wait_s for s in window), floats(s.memory_frac for s in window))

    def __len__(self) -> int:
        return len(self.steps)

    def span(self, start: int | None, stop: int | None) -> StepColumns:
        """The positions ``start:stop``."""
        return StepColumns(self.steps[start:stop], self.total[start:stop],
                           self.data[start:stop], self.compute[start:stop],
                           self.comm[start:stop], self.memory[start:stop])

    def after(self, step: int, upto: int) -> StepColumns:
        """The steps in (``step``, ``upto``]."""
        return self.span(bisect_right(self.steps, step), bisect_right(self.steps, upto))

    def then(self, new: StepColumns, keep: int) -> StepColumns:
        """These steps followed by ``new``'s, the last ``keep`` of them."""
        return StepColumns((self.steps + new.steps)[-keep:], (self.total + new.total)[-keep:],
                           (self.data + new.data)[-keep:], (self.compute + new.compute)[-keep:],
                           (self.comm + new.comm)[-keep:], (self.memory + new.memory)[-keep:])

    def memory_readings(self) -> list[tuple[int, float]]:
        """(step, memory fraction) of the steps that read one."""
        return [(s, m) for s, m in zip(self.steps, self.memory) if not math.isnan(m)]

    def latest_memory(self) -> tuple[int, float] | None:
        """(step, memory fraction) of the latest step that read one."""
        for i in range(len(self.memory) - 1, -1, -1):
            if not math.isnan(self.memory[i]):
                return self.steps[i], self.memory[i]
        return None


EMPTY = StepColumns(array("q"), array("d"), array("d"), array("d"), array("d"), array("d"))
