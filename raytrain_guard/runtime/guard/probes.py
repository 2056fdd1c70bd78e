"""Memory probes: the only code here that reads CUDA allocator counters or host RSS.

Every probe has ``read() -> MemoryReading`` and ``cause`` (the resource it measures). Reads are
cheap enough for every step: allocator counters on CUDA (no device synchronization, no NVML),
one ``/proc`` read of this process's RSS on CPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Cause
from raytrain_guard.errors import InputError, check_int

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryReading:
    """Memory of one rank, in bytes: ``used_bytes`` held by live tensors (CUDA) or the
    process (CPU: RSS), ``reserved_bytes`` by the allocator, cache included (CPU: as used),
    against ``total_bytes`` (the card, or the CPU budget). ``cache_known``: whether reserved
    minus used is the allocator's cache (False for a bare scripted fraction).
    """

    used_bytes: int
    reserved_bytes: int
    total_bytes: int
    cache_known: bool = True

    @property
    def frac(self) -> float:
        """What this rank holds of its budget: ``max(used, reserved) / total``. A cache release
        lowers it; the gate's watermark and critical rules read it."""
        return max(self.used_bytes, self.reserved_bytes) / self.total_bytes

    @property
    def cached_frac(self) -> float | None:
        """Cached but unallocated (reserved - used) over the total: what a cache release can
        give back (0 on CPU and on a simulated card); None when not known."""
        if not self.cache_known:
            return None
        return max(0, self.reserved_bytes - self.used_bytes) / self.total_bytes


class CudaMemoryProbe:
    """``torch.cuda.memory_allocated`` / ``memory_reserved`` against the card's total memory
    (``mem_get_info``, read once): allocator counters only, no synchronization, no NVML. The
    allocator does not see the CUDA context or NCCL's buffers: ``context_bytes`` (default
    ``cuda_context_bytes`` of ``config``) is added to both figures.
    """

    cause = Cause.DEVICE_MEMORY

    def __init__(self, device: Any = None, *, config: GuardConfig | None = None,
                 context_bytes: int | None = None) -> None:
        import torch

        if not torch.cuda.is_available():
            raise InputError("device", "CUDA is not available", value=str(device),
                             fix="use ProcessMemoryProbe on CPU")
        if context_bytes is None:
            context_bytes = (config or GuardConfig()).cuda_context_bytes
        if context_bytes < 0:
            raise InputError("context_bytes", "must be >= 0", value=context_bytes,
                             fix="pass the CUDA context size in bytes (or 0)")
        self._torch = torch
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)
        self.total_bytes = int(torch.cuda.mem_get_info(self.device)[1])
        self.context_bytes = int(context_bytes)

    def read(self) -> MemoryReading:
        cuda = self._torch.cuda
        return MemoryReading(int(cuda.memory_allocated(self.device)) + self.context_bytes,
                             int(cuda.memory_reserved(self.device)) + self.context_bytes,
                             self.total_bytes)


class ProcessMemoryProbe:
    """This process's resident memory (RSS) against a CPU budget: ``budget_bytes``, else
    ``config.cpu_memory_budget_bytes``, else host RAM divided by ``local_world_size``."""

    cause = Cause.HOST_MEMORY

    def __init__(self, config: GuardConfig | None = None, *, budget_bytes: int | None = None,
                 local_world_size: int = 1) -> None:
        import psutil

        check_int("local_world_size", local_world_size, at_least=1,
                  fix="pass the number of training workers on this node")
        if budget_bytes is None and config is not None:
            budget_bytes = config.cpu_memory_budget_bytes
        if budget_bytes is None:
            budget_bytes = psutil.virtual_memory().total // local_world_size
        if budget_bytes <= 0:
            raise InputError("budget_bytes", "must be > 0", value=budget_bytes,
                             fix="pass a positive byte count, e.g. 8 * GiB")
        self.total_bytes = int(budget_bytes)
        self._statm: int | None = None      # open /proc/self/statm of self._pid (Linux)
        self._pid = -1
        self._page_bytes = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def read(self) -> MemoryReading:
        """RSS from a kept-open /proc/self/statm (one pread; psutil opens the file each time,
        ten times slower), psutil where there is none."""
        pid = os.getpid()
        if pid != self._pid:              # first read, or a forked child: this process
            self.close()
            self._pid = pid
            with contextlib.suppress(OSError):
                self._statm = os.open("/proc/self/statm", os.O_RDONLY)
        if self._statm is not None:
            used = int(os.pread(self._statm, 128, 0).split()[1]) * self._page_bytes
        else:
            import psutil
            used = int(psutil.Process().memory_info().rss)
        return MemoryReading(used, used, self.total_bytes)

    def close(self) -> None:
        """Close the kept-open /proc file (also done on garbage collection)."""
        fd, self._statm = getattr(self, "_statm", None), None
        if fd is not None and getattr(self, "_pid", -1) == os.getpid():
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        self.close()
