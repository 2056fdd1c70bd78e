"""Memory readings for the step guard: the probe read once per step, or a host reading far
below the watermark reused for a few steps (the ``/proc`` read costs more than the rest of a
quiet step)."""

from __future__ import annotations

from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Cause

#: A host-memory reading this far below the watermark may be reused (memory_read_every_steps).
REUSE_MARGIN_FRAC = 0.05
#: Farther below, up to this many times memory_read_every_steps steps: as long as memory growing
#: by REUSE_MARGIN_FRAC / memory_read_every_steps of the budget per step stays under the line.
REUSE_MAX_FACTOR = 4


class MemoryReads:
    """The memory fraction of each step from ``probe`` (anything with ``read() -> reading``
    whose ``frac`` is the fraction; None: no readings). ``reuse``: whether a host-memory
    reading far below the watermark may stand for the next steps; device probes (allocator
    counters, cheap) are read every step."""

    def __init__(self, probe: Any, config: GuardConfig, *, reuse: bool) -> None:
        self.probe = probe
        every = config.memory_read_every_steps
        self._reuse_steps = every - 1 if reuse and getattr(
            probe, "cause", None) is Cause.HOST_MEMORY else 0
        self._below = config.memory_watermark_frac - REUSE_MARGIN_FRAC
        self._growth_per_step = REUSE_MARGIN_FRAC / every
        self._max_steps = REUSE_MAX_FACTOR * every - 1
        self._left = 0
        self._reused: tuple[float | None, float | None] = (None, None)

    def read(self, *, may_reuse: bool) -> tuple[float | None, float | None]:
        """This step's fraction and cached fraction (:attr:`MemoryReading.cached_frac`).
        ``may_reuse``: the caller's other rules are settled (the gate's quiet bounds are
        known), so a low reading may stand for the next steps. A probe that raises raises
        here: the caller fails open."""
        if self._left > 0:
            self._left -= 1
            return self._reused
        if self.probe is None:
            return None, None
        reading = self.probe.read()
        frac = reading.frac
        cached = getattr(reading, "cached_frac", None)
        if self._reuse_steps and may_reuse and frac is not None and frac < self._below:
            # the farther below the line, the longer memory growing at the sized rate needs
            # to reach it
            extra = int((self._below - frac) / self._growth_per_step)
            self._left = min(self._max_steps, self._reuse_steps + extra)
            self._reused = (frac, cached)
        return frac, cached

    def forget(self) -> None:
        """Read the probe at the next step (after a restore)."""
        self._left = 0
