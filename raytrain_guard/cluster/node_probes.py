"""Node probes: the only code that reads NVML or psutil, plus scripted probes for rehearsals.

A GPU probe has ``sample() -> tuple[GpuSample, ...]``; a host probe has
``sample(workers: Mapping[int, int | None]) -> HostSample`` where ``workers`` maps each
registered train-worker pid to its world rank. Probes raise :class:`ProbeError` (or anything
else) when they cannot read; the node monitor turns that into host-only mode, never a crash.

Scripted probes ship with the package so a user can rehearse a hot GPU, a throttled one, host
memory pressure or an NVML failure without the hardware::

    gpu = ScriptedGpuProbe([[GpuSample(0, 70 * GiB, 80 * GiB)],
                            [GpuSample(0, 76 * GiB, 80 * GiB, throttle_reasons=("thermal",))]])
    monitor = NodeMonitor("node-a", config, gpu_probe=gpu, host_probe=ScriptedHostProbe([...]))
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Iterable, Mapping, Sequence

from raytrain_guard.core.node_samples import GpuSample, HostSample, WorkerMemory
from raytrain_guard.errors import GuardError

logger = logging.getLogger(__name__)


class ProbeError(GuardError):
    """A probe cannot read its source (NVML missing, driver error, process gone)."""


# -- NVML --------------------------------------------------------------------------------------

class NvmlGpuProbe:
    """Every GPU of this node through NVML: memory, utilization, temperature, power, throttling.

    The constructor initialises NVML and raises :class:`ProbeError` when it is missing or has no
    device to report, so the monitor can fall back to host-only monitoring. Readings that a GPU
    does not support (power on some boards) come back as None.
    """

    def __init__(self) -> None:
        try:
            import pynvml
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded ...
            raise ProbeError(f"NVML unavailable: {exc}") from exc
        if count == 0:
            raise ProbeError("NVML found no GPU on this node")
        self._nvml = pynvml
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        bits = {"thermal": ("SwThermalSlowdown", "HwThermalSlowdown"),
                "power": ("SwPowerCap", "HwPowerBrakeSlowdown"),
                "slowdown": ("HwSlowdown",)}
        self._reason_bits = {reason: sum(getattr(pynvml, f"nvmlClocksThrottleReason{n}", 0)
                                         for n in names) for reason, names in bits.items()}

    def sample(self) -> tuple[GpuSample, ...]:
        nv = self._nvml
        out = []
        for index, handle in enumerate(self._handles):
            try:
                mem = nv.nvmlDeviceGetMemoryInfo(handle)
            except Exception as exc:
                raise ProbeError(f"NVML failed reading GPU {index} memory: {exc}") from exc
            util = _optional(lambda: nv.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)
            temp = _optional(lambda: float(nv.nvmlDeviceGetTemperature(handle,
                                                                        nv.NVML_TEMPERATURE_GPU)))
            power = _optional(lambda: nv.nvmlDeviceGetPowerUsage(handle) / 1000.0)  # mW -> W
            mask = _optional(lambda: nv.nvmlDeviceGetCurrentClocksThrottleReasons(handle)) or 0
            reasons = tuple(r for r, bit in self._reason_bits.items() if mask & bit)
            out.append(GpuSample(index, int(mem.used), int(mem.total), util, temp, power, reasons))
        return tuple(out)


def _optional(read: Callable[[], float]) -> float | None:
    try:
        return read()
    except Exception:
        return None


# -- psutil ------------------------------------------------------------------------------------

class PsutilHostProbe:
    """Host memory, swap and CPU, and the private memory of each registered train worker.

    A worker's private memory is its USS (``memory_full_info().uss``, pages no other process
    shares) where the platform allows, else RSS minus shared pages. Its DataLoader workers are
    its child processes, found fresh at every sample (they come and go with epochs).
    """

    def __init__(self) -> None:
        import psutil
        self._psutil = psutil
        psutil.cpu_percent(None)   # prime: the first call always returns 0.0

    def sample(self, workers: Mapping[int, int | None]) -> HostSample:
        ps = self._psutil
        vm, sw = ps.virtual_memory(), ps.swap_memory()
        memories = []
        for pid, rank in sorted(workers.items()):
            try:
                proc = ps.Process(pid)
                children = proc.children(recursive=True)
                own = self._private_bytes(proc)
                loaders = [self._private_bytes(c) for c in children]
            except (ps.NoSuchProcess, ps.AccessDenied, ps.ZombieProcess):
                continue
            memories.append(WorkerMemory(pid, rank, own, sum(b for b in loaders if b),
                                         len(children)))
        return HostSample(memory_total_bytes=int(vm.total),
                          memory_available_bytes=int(vm.available),
                          swap_used_bytes=int(sw.used), swap_total_bytes=int(sw.total),
                          cpu_frac=ps.cpu_percent(None) / 100.0, workers=tuple(memories))

    def _private_bytes(self, proc) -> int:
        ps = self._psutil
        try:
            return int(proc.memory_full_info().uss)
        except (ps.AccessDenied, AttributeError):
            info = proc.memory_info()
            return int(info.rss - getattr(info, "shared", 0))
        except (ps.NoSuchProcess, ps.ZombieProcess):
            return 0


# -- scripted probes (tests and rehearsals) ----------------------------------------------------

class ScriptedGpuProbe:
    """Plays back a script of GPU readings, one entry per sample; the last entry repeats.

    An entry that is an exception instance is raised instead (rehearse an NVML failure).
    """

    def __init__(self, script: Sequence[Iterable[GpuSample] | BaseException]) -> None:
        if not script:
            raise ValueError("ScriptedGpuProbe needs at least one entry")
        self._script = list(script)
        self._i = 0

    def sample(self) -> tuple[GpuSample, ...]:
        entry = self._script[min(self._i, len(self._script) - 1)]
        self._i += 1
        if isinstance(entry, BaseException):
            raise entry
        return tuple(entry)


class ScriptedHostProbe:
    """Plays back host readings (the last repeats); fills in the registered workers' pids
    with ``worker_private_bytes`` each, so registration can be rehearsed without processes."""

    def __init__(self, script: Sequence[HostSample | BaseException], *,
                 worker_private_bytes: int = 0) -> None:
        if not script:
            raise ValueError("ScriptedHostProbe needs at least one entry")
        self._script = list(script)
        self._i = 0
        self._worker_bytes = worker_private_bytes

    def sample(self, workers: Mapping[int, int | None]) -> HostSample:
        entry = self._script[min(self._i, len(self._script) - 1)]
        self._i += 1
        if isinstance(entry, BaseException):
            raise entry
        if not workers:
            return entry
        fake = tuple(WorkerMemory(pid, rank, self._worker_bytes)
                     for pid, rank in sorted(workers.items()))
        return HostSample(entry.memory_total_bytes, entry.memory_available_bytes,
                          entry.swap_used_bytes, entry.swap_total_bytes, entry.cpu_frac, fake)


class ScriptedProbeFactory:
    """A picklable ``probe_factory(node_id) -> (gpu_probe, host_probe)`` for ``start_monitors``.

    ``gpu_script`` / ``host_script``: the script every node plays back, or a mapping from node
    id to its own script (a node missing from the mapping uses ``default_gpu_script``). A None
    host script keeps the real psutil host probe. Rehearse a hot or throttled node with it.
    """

    def __init__(self, gpu_script: Sequence | Mapping[str, Sequence] | None,
                 host_script: Sequence | None = None, *,
                 default_gpu_script: Sequence | None = None) -> None:
        self.gpu_script = gpu_script
        self.host_script = host_script
        self.default_gpu_script = default_gpu_script

    def __call__(self, node_id: str) -> tuple[ScriptedGpuProbe | None, ScriptedHostProbe | None]:
        script = self.gpu_script
        if isinstance(script, Mapping):
            script = script.get(node_id, self.default_gpu_script)
        gpu = ScriptedGpuProbe(script) if script is not None else None
        host = ScriptedHostProbe(self.host_script) if self.host_script is not None else None
        return gpu, host


def default_gpu_probe() -> NvmlGpuProbe:
    """The real GPU probe; raises ProbeError where NVML is missing."""
    if os.environ.get("RAYTRAIN_GUARD_DISABLE_NVML") == "1":
        raise ProbeError("NVML disabled by RAYTRAIN_GUARD_DISABLE_NVML=1")
    return NvmlGpuProbe()


def default_host_probe() -> PsutilHostProbe:
    return PsutilHostProbe()
