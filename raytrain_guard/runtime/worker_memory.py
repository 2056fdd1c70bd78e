"""Watching the private memory of the DataLoader worker processes (copy-on-read detection).

A forked DataLoader worker shares its parent's pages until it writes to them. Reading a Python
object writes to it (its reference count), so a dataset that keeps its samples as Python objects
in lists or dicts is copied, page by page, into every worker as the epoch reads it: the
workers' private memory (USS) climbs steadily, times the number of workers. Storage in numpy
arrays or tensors is one buffer without per-sample reference counts and stays shared.

:class:`GrowthDetector` is the rule (pure: numbers in, verdict out).
:class:`WorkerMemoryWatcher` samples the workers' USS with psutil on a background thread, so the
training step never pays for reading ``/proc/<pid>/smaps``, and warns once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from raytrain_guard.errors import check_int
from raytrain_guard.units import format_bytes

logger = logging.getLogger(__name__)

COPY_ON_READ_FIX = (
    "the dataset probably keeps its samples as Python objects (lists/dicts), whose reference "
    "counts every worker writes, copying them page by page (copy-on-read); store samples in "
    "numpy arrays or torch tensors (one contiguous buffer), or keep file offsets and decode in "
    "__getitem__")


@dataclass(frozen=True)
class GrowthVerdict:
    """Steady growth seen: ``from_bytes`` to ``to_bytes`` over ``over_s`` seconds."""

    from_bytes: int
    to_bytes: int
    over_s: float

    def message(self) -> str:
        return (f"DataLoader worker private memory grew steadily from "
                f"{format_bytes(self.from_bytes)} to {format_bytes(self.to_bytes)} in "
                f"{self.over_s:.1f} s: {COPY_ON_READ_FIX}")


class GrowthDetector:
    """Steady growth: ``num_samples`` samples in a row, each one not below the one before,
    rising ``min_growth_bytes`` or more from the first of them to the last.

    A worker that settles after start-up (allocator warm-up, imports) has flat samples and never
    matches; a copy-on-read worker rises sample after sample for the whole epoch.
    """

    def __init__(self, *, num_samples: int, min_growth_bytes: int) -> None:
        check_int("num_samples", num_samples, at_least=2,   # growth needs two samples
                  fix="set GuardConfig.worker_memory_growth_samples to 2 or more")
        self._window: deque[tuple[float, int]] = deque(maxlen=num_samples)
        self._min_growth = int(min_growth_bytes)

    def reset(self) -> None:
        """Forget the samples (the set of workers changed)."""
        self._window.clear()

    def add(self, t: float, private_bytes: int) -> GrowthVerdict | None:
        """Add one sample; a verdict when the window now shows steady growth."""
        self._window.append((t, int(private_bytes)))
        if len(self._window) < (self._window.maxlen or 0):
            return None
        values = [b for _, b in self._window]
        if any(b < a for a, b in zip(values, values[1:])):
            return None
        if values[-1] - values[0] < self._min_growth:
            return None
        return GrowthVerdict(values[0], values[-1], self._window[-1][0] - self._window[0][0])


def read_private_bytes(pids: Iterable[int]) -> int:
    """Sum of the USS of ``pids`` (psutil); processes that vanished count 0."""
    import psutil

    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_full_info().uss
        except (psutil.Error, OSError):
            continue
    return total


class WorkerMemoryWatcher:
    """Samples the private memory of some worker processes every ``interval_s`` and warns once.

    ``pids`` is called on each sample (the loader's workers change when it re-plans);
    ``read`` and ``clock`` are seams for tests. :meth:`sample` does one sample synchronously;
    :meth:`start` runs it on a daemon thread. A failing sample is logged once and never raised
    (the guard fails open).
    """

    def __init__(self, pids: Callable[[], Sequence[int]], *, interval_s: float,
                 num_samples: int, min_growth_bytes: int,
                 read: Callable[[Iterable[int]], int] = read_private_bytes,
                 clock: Callable[[], float] = time.monotonic,
                 on_growth: Callable[[GrowthVerdict], None] | None = None) -> None:
        self._pids = pids
        self._interval_s = float(interval_s)
        self._read = read
        self._clock = clock
        self._on_growth = on_growth
        self._detector = GrowthDetector(num_samples=num_samples, min_growth_bytes=min_growth_bytes)
        self._last_pids: tuple[int, ...] = ()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed = False
        self.verdict: GrowthVerdict | None = None
        self.last_private_bytes = 0
        self.num_samples_taken = 0

    @property
    def warned(self) -> bool:
        return self.verdict is not None

    def sample(self) -> GrowthVerdict | None:
        """Read the workers' private memory once; returns the verdict the first time it fires."""
        try:
            pids = tuple(self._pids())
            if not pids:
                return None
            if pids != self._last_pids:
                self._detector.reset()
                self._last_pids = pids
            self.last_private_bytes = self._read(pids)
            self.num_samples_taken += 1
            verdict = self._detector.add(self._clock(), self.last_private_bytes)
        except Exception as exc:  # noqa: BLE001 - fail open
            if not self._failed:
                self._failed = True
                logger.warning("worker memory sampling failed, watcher continues: %r", exc)
            return None
        if verdict is None or self.verdict is not None:
            return None
        self.verdict = verdict
        logger.warning("%s", verdict.message())
        if self._on_growth is not None:
            self._on_growth(verdict)
        return verdict

    def start(self) -> None:
        """Sample on a daemon thread until :meth:`stop`."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="raytrain-guard-worker-memory",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.sample()
