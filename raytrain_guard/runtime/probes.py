"""Memory probes (the only code here that reads CUDA allocator counters or psutil), a scripted
probe and a fault injector for rehearsals.

Every probe has ``read() -> MemoryReading`` and ``cause`` (the resource it measures). Reads are
cheap enough for every step: allocator counters on CUDA (no device synchronization, no NVML),
one ``/proc`` read of this process's RSS on CPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Cause
from raytrain_guard.errors import InputError, check_int

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryReading:
    """Memory of one rank, in bytes.

    ``used_bytes``: held by live tensors (CUDA: ``memory_allocated``) or by the process (CPU:
    RSS, or USS). ``reserved_bytes``: held by the allocator, cache included (CUDA:
    ``memory_reserved``; CPU: the same as used). ``total_bytes``: the budget they count
    against (the card, or the CPU budget). ``cache_known``: whether reserved minus used is the
    allocator's cache (False for a bare scripted fraction).
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

    @property
    def used_frac(self) -> float:
        """Live tensors (or process memory) only, over the total."""
        return self.used_bytes / self.total_bytes


class CudaMemoryProbe:
    """``torch.cuda.memory_allocated`` / ``memory_reserved`` plus the CUDA context, against the
    card's total memory (``mem_get_info``, read once here). Allocator counters only: no
    synchronization, no NVML.

    The allocator does not see the CUDA context or NCCL's buffers, which the planner budgets as
    ``GuardConfig.cuda_context_bytes``; the probe adds ``context_bytes`` (default:
    ``config.cuda_context_bytes``, else ``GuardConfig().cuda_context_bytes``) to both figures
    so the gate's fractions count what the card really holds. cuBLAS and cuDNN take their
    workspaces from the allocator: its counters already hold them.
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
    """This process's resident memory (RSS, or USS with ``use_uss``) against a CPU budget.

    The budget is ``budget_bytes``, else ``config.cpu_memory_budget_bytes``, else host RAM
    divided by ``local_world_size``. USS (private pages, what the process would give back)
    reads ``/proc/self/smaps``: a few milliseconds, too slow for every step of a fast loop.
    """

    cause = Cause.HOST_MEMORY

    def __init__(self, config: GuardConfig | None = None, *, budget_bytes: int | None = None,
                 local_world_size: int = 1, use_uss: bool = False) -> None:
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
        self.use_uss = use_uss
        self._process: Any = None
        self._statm: int | None = None      # open /proc/self/statm of self._pid (Linux)
        self._pid = -1
        self._page_bytes = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def read(self) -> MemoryReading:
        pid = os.getpid()
        if pid != self._pid:              # first read, or a forked child: this process
            self.close()
            self._pid = pid
            self._process = psutil_process()
            if not self.use_uss:
                with contextlib.suppress(OSError):
                    self._statm = os.open("/proc/self/statm", os.O_RDONLY)
        if self.use_uss:
            used = int(self._process.memory_full_info().uss)
        else:
            used = self._rss_bytes()
        return MemoryReading(used, used, self.total_bytes)

    def _rss_bytes(self) -> int:
        """RSS from a kept-open /proc/self/statm (one pread, a few us; psutil opens the file
        each time, ten times slower); psutil where there is no /proc."""
        if self._statm is not None:
            return int(os.pread(self._statm, 128, 0).split()[1]) * self._page_bytes
        return int(self._process.memory_info().rss)

    def close(self) -> None:
        """Close the kept-open /proc file (also done on garbage collection)."""
        fd, self._statm = getattr(self, "_statm", None), None
        if fd is not None and getattr(self, "_pid", -1) == os.getpid():
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        self.close()


def psutil_process() -> Any:
    import psutil

    return psutil.Process()


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
    from ``after`` on when ``fail_reads`` is None). Made by :meth:`FaultInjector.failing_probe`."""

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


class FaultInjector:
    """Rehearse failures on purpose: a delay in a phase on chosen ranks and steps, ballast
    memory, a probe that raises.

    ``StepGuard(fault_injector=...)`` calls :meth:`on_mark` before each phase mark, so an
    injected delay is counted as that phase (``"forward"``: a compute straggler, ``"data"``: a
    slow loader), and for ``"optimizer"`` at ``end_step`` when the loop leaves that phase
    unmarked (StepTimer counts the rest after the backward mark as the optimizer's).
    ``sleep`` is injectable for tests.
    """

    def __init__(self, *, world_rank: int = 0, sleep: Callable[[float], None] = time.sleep) -> None:
        self.world_rank = world_rank
        self._sleep = sleep
        self._delays: list[tuple[float, str, frozenset[int] | None, Any]] = []
        self._ballast: list[Any] = []
        self.num_delays = 0

    # -- delays ------------------------------------------------------------------------------
    def delay(self, seconds: float, *, phase: str = "forward",
              ranks: Iterable[int] | None = None, steps: Any = None) -> None:
        """Sleep ``seconds`` at the end of ``phase`` on ``ranks`` (all when None) during
        ``steps`` (a container of step numbers such as ``range(10, 20)``; all when None)."""
        from raytrain_guard.runtime.timing import PHASE_FIELDS

        if phase not in PHASE_FIELDS:
            raise InputError("phase", "unknown phase", value=phase,
                             fix=f"use one of {', '.join(sorted(PHASE_FIELDS))}")
        if seconds < 0:
            raise InputError("seconds", "must be >= 0", value=seconds, fix="pass a delay in s")
        self._delays.append((float(seconds), phase,
                             None if ranks is None else frozenset(ranks), steps))

    def on_mark(self, step: int, phase: str) -> None:
        """Apply the delays scheduled for this rank, step and phase."""
        for seconds, d_phase, ranks, steps in self._delays:
            if d_phase != phase or (ranks is not None and self.world_rank not in ranks):
                continue
            if steps is not None and step not in steps:
                continue
            self.num_delays += 1
            self._sleep(seconds)

    # -- memory ------------------------------------------------------------------------------
    def allocate_ballast(self, num_bytes: int, *, device: Any = "cpu") -> None:
        """Hold ``num_bytes`` of resident memory (touched, so RSS grows) until
        :meth:`release_ballast`. On a CUDA device, a tensor of that size."""
        if num_bytes <= 0:
            raise InputError("num_bytes", "must be > 0", value=num_bytes, fix="pass a size")
        if str(device).startswith("cuda"):
            import torch

            self._ballast.append(torch.ones(num_bytes, dtype=torch.uint8, device=device))
        else:
            self._ballast.append(bytearray(b"\x01") * num_bytes)   # written: resident pages

    def fill_to(self, probe: Any, frac: float, *, device: Any = "cpu") -> int:
        """Allocate ballast until ``probe`` reads about ``frac`` of its total (nothing when it
        reads that much already). Returns the bytes allocated."""
        if not 0 < frac < 1.5:
            raise InputError("frac", "must be in (0, 1.5)", value=frac,
                             fix="pass a fraction of the probe's total, e.g. 0.95")
        reading = probe.read()
        missing = int(frac * reading.total_bytes) - max(reading.used_bytes,
                                                        reading.reserved_bytes)
        if missing > 0:
            self.allocate_ballast(missing, device=device)
        return max(0, missing)

    def release_ballast(self) -> None:
        """Drop every ballast allocation."""
        self._ballast.clear()

    @property
    def ballast_bytes(self) -> int:
        return sum(len(b) if isinstance(b, bytearray) else b.numel() for b in self._ballast)

    # -- probes ------------------------------------------------------------------------------
    @staticmethod
    def failing_probe(probe: Any, *, after: int = 0, fail_reads: Collection[int] | None = None,
                      error: BaseException | None = None) -> FailingProbe:
        """``probe`` wrapped to raise ``error`` (see :class:`FailingProbe`)."""
        return FailingProbe(probe, after=after, fail_reads=fail_reads, error=error)
