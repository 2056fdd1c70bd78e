"""How long the training thread waited for a CPU: the run-queue delay Linux keeps per thread.

A step can grow because the rank is slow (its device, its data, its link) or because the host
gave its thread no CPU: another process, the rank's own loader workers, a second rank on a
too-small box. Only the second shows here: the thread was runnable but not running. The step
gate reads it to tell the host's contention from the rank's slowdown (``StepStats.cpu_wait_s``,
config ``slow_step_host_wait_frac``).

The figure is the second field of ``/proc/thread-self/schedstat`` (nanoseconds spent waiting on
a run queue; the kernel's ``CONFIG_SCHED_INFO``, on in every major distribution). A sleep, a
blocking collective or a CUDA synchronization is a voluntary wait and does not count. Where the
file is missing (not Linux) the reader gives None and the gate keeps its timing rules alone.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["ThreadCpuWait"]

_SCHEDSTAT = "/proc/thread-self/schedstat"


class ThreadCpuWait:
    """Cumulative run-queue wait, in seconds, of the thread that first calls :meth:`read`.

    The file is opened on that first call (``/proc/thread-self`` is the opening thread's), and
    each read is one ``pread`` of it: about 0.5 us.
    """

    def __init__(self, path: str = _SCHEDSTAT) -> None:
        self._path = path
        self._fd: int | None = None
        self._failed = False

    def read(self) -> float | None:
        """The thread's run-queue wait so far in seconds (None: not available here)."""
        if self._failed:
            return None
        try:
            if self._fd is None:
                self._fd = os.open(self._path, os.O_RDONLY)
            return int(os.pread(self._fd, 128, 0).split()[1]) * 1e-9
        except (OSError, ValueError, IndexError):
            self._failed = True      # a missing or unexpected file: stop asking
            return None

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(OSError):     # at interpreter shutdown
            self.close()
