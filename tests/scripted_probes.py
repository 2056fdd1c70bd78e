"""Memory probes that read a script, and one that fails on chosen reads: for tests."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from raytrain_guard.core.decisions import Cause
from raytrain_guard.errors import InputError
from raytrain_guard.runtime.guard.probes import MemoryReading


class ScriptedProbe:
    """Readings from a script, for tests and rehearsals.

    Items are :class:`MemoryReading`, fractions (of ``total_bytes``) or exceptions, which
    :meth:`read` raises. After the script the last reading repeats (``repeat_last``) or
    ``read`` raises ``IndexError``.
    """

    cause = Cause.DEVICE_MEMORY

    def __init__(self, readings: Iterable[MemoryReading | float | BaseException], *,
                 total_bytes: int = 80 * 1024**3, repeat_last: bool = True,
                 cause: Cause = Cause.DEVICE_MEMORY) -> None:
        self._script = list(readings)
        if not self._script:
            raise InputError("readings", "is empty", value=[], fix="pass at least one reading")
        self.total_bytes = total_bytes
        self.repeat_last = repeat_last
        self.cause = cause
        self.num_reads = 0

    def read(self) -> MemoryReading:
        index = self.num_reads
        self.num_reads += 1
        if index >= len(self._script):
            if not self.repeat_last:
                raise IndexError(f"ScriptedProbe: script of {len(self._script)} readings ended")
            index = len(self._script) - 1
        item = self._script[index]
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, MemoryReading):
            return item
        used = int(float(item) * self.total_bytes)
        return MemoryReading(used, used, self.total_bytes, cache_known=False)


class FailingProbe:
    """Wraps a probe and raises ``error`` on reads number ``fail_reads`` (0-based; all reads
    from ``after`` on when ``fail_reads`` is None)."""

    def __init__(self, probe: Any, *, after: int = 0, fail_reads: Collection[int] | None = None,
                 error: BaseException | None = None) -> None:
        self.probe = probe
        self.cause = getattr(probe, "cause", Cause.UNKNOWN)
        self.after = after
        self.fail_reads = None if fail_reads is None else set(fail_reads)
        self.error = error or RuntimeError("injected probe failure")
        self.num_reads = 0

    def read(self) -> MemoryReading:
        index = self.num_reads
        self.num_reads += 1
        failing = index in self.fail_reads if self.fail_reads is not None else index >= self.after
        if failing:
            raise self.error
        return self.probe.read()
