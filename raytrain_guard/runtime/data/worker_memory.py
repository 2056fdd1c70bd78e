"""Watching the private memory of the DataLoader worker processes (copy-on-read detection).

A forked worker shares its parent's pages until it writes to them, and reading a Python object
writes to it (its reference count): a dataset that keeps its samples as Python objects in lists
or dicts is copied, page by page, into every worker as the epoch reads it, and the workers'
private memory (USS) climbs steadily. Samples in numpy arrays or tensors stay shared.
:class:`GrowthDetector` is the rule (pure); :class:`WorkerMemoryWatcher` samples the workers'
USS on a background thread (the step never pays for ``/proc/<pid>/smaps``) and warns once.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from raytrain_guard.errors import check_int
from raytrain_guard.runtime.host_memory import private_bytes
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
    """Steady growth: ``num_samples`` samples in a row, none below the one before, rising
    ``min_growth_bytes`` or more from the first to the last (a worker that settles after its
    start-up is flat; a copy-on-read worker rises all epoch)."""

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
        values = [b for _, b in self._window]
        if (len(values) < (self._window.maxlen or 0) or values[-1] - values[0] < self._min_growth
                or any(b < a for a, b in itertools.pairwise(values))):
            return None
        return GrowthVerdict(values[0], values[-1], self._window[-1][0] - self._window[0][0])


def read_private_bytes(pids: Iterable[int]) -> int:
    """Sum of the USS of ``pids``; processes that vanished count 0."""
    return sum(private_bytes(pid) or 0 for pid in pids)


class WorkerMemoryWatcher:
    """Samples the private memory of the processes ``pids()`` names (called each time: the
    workers change with a re-plan) every ``interval_s`` on a daemon thread (:meth:`start`), and
    warns once. ``read`` and ``clock`` are seams for tests; a failing sample is logged once,
    never raised."""

    def __init__(self, pids: Callable[[], Sequence[int]], *, interval_s: float,
                 num_samples: int, min_growth_bytes: int,
                 read: Callable[[Iterable[int]], int] = read_private_bytes,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pids = pids
        self._interval_s = float(interval_s)
        self._read = read
        self._clock = clock
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
        """Read the workers' private memory once; the verdict the first time it fires."""
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
