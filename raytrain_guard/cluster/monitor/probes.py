"""Node probes: the only code that reads NVML or psutil, plus scripted probes for rehearsals.

A host probe has ``sample(workers) -> HostSample`` (``workers``: registered train-worker pid ->
world rank); a GPU probe ``sample() -> tuple[GpuSample, ...]`` or ``sample(workers)``, to mark
the GPUs that hold them (``process_pids``). A probe that cannot read raises (the monitor goes
host-only). Scripted probes rehearse a hot, throttled or foreign GPU, host pressure or an NVML
failure::

    gpu = ScriptedGpuProbe([[GpuSample(0, 70 * GiB, 80 * GiB)],
                            [GpuSample(0, 76 * GiB, 80 * GiB, throttle_reasons=("thermal",))]])
    monitor = NodeMonitor("node-a", config, gpu_probe=gpu, host_probe=ScriptedHostProbe([...]))
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from raytrain_guard.config import DISABLE_NVML_ENV, nvml_disabled
from raytrain_guard.core.node_samples import GpuSample, HostSample, WorkerMemory
from raytrain_guard.errors import GuardError, InputError
from raytrain_guard.runtime.host_memory import host_memory, private_bytes

logger = logging.getLogger(__name__)


class ProbeError(GuardError):
    """A probe cannot read its source."""


# -- NVML --------------------------------------------------------------------------------------

class NvmlGpuProbe:
    """Every GPU of this node through NVML: memory, utilization, temperature, power, throttling
    and the compute processes' pids (None where unsupported); :class:`ProbeError` without NVML
    or a device."""

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
            # each lambda runs at once, inside _optional; h=handle binds it all the same
            util = _optional(lambda h=handle: nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0)
            temp = _optional(lambda h=handle: float(nv.nvmlDeviceGetTemperature(
                h, nv.NVML_TEMPERATURE_GPU)))
            power = _optional(lambda h=handle: nv.nvmlDeviceGetPowerUsage(h) / 1000.0)  # mW -> W
            mask = _optional(lambda h=handle: nv.nvmlDeviceGetCurrentClocksThrottleReasons(h)) or 0
            reasons = tuple(r for r, bit in self._reason_bits.items() if mask & bit)
            out.append(GpuSample(index, int(mem.used), int(mem.total), util, temp, power, reasons,
                                 _optional(lambda h=handle: self._pids(h))))
        return tuple(out)

    def _pids(self, handle: Any) -> tuple[int, ...]:
        """The compute processes on one GPU, as the driver sees them (in its pid namespace)."""
        return tuple(int(p.pid) for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle))


def _optional(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except Exception:  # noqa: BLE001 - an optional reading that fails reads None
        return None


# -- psutil ------------------------------------------------------------------------------------

class PsutilHostProbe:
    """Host memory (the container's cgroup limit when lower), swap, CPU, and each registered
    worker's private memory (USS) and its DataLoader workers' (its child processes).

    A process's USS is read from its smaps, some 7 ms of kernel time for a rank holding torch
    (6 processes, 2 ranks with 2 loader workers each: 45 ms a sample, docs/benchmarks.md). It
    is read again once ``private_interval_s`` (``worker_memory_interval_s``, 5 s) has passed;
    between, a sample reuses each process's last reading. Host memory, swap and CPU are read
    at every sample."""

    def __init__(self, private_interval_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        import psutil
        self._psutil = psutil
        self._private_interval_s = private_interval_s
        self._clock = clock
        self._private: dict[int, tuple[float, int | None]] = {}   # pid -> (read at, bytes)
        psutil.cpu_percent(None)   # prime: the first call always returns 0.0

    def sample(self, workers: Mapping[int, int | None]) -> HostSample:
        ps = self._psutil
        total, available = host_memory()
        sw = ps.swap_memory()
        now = self._clock()
        last, self._private = self._private, {}    # processes not seen now are forgotten
        memories = []
        for pid, rank in sorted(workers.items()):
            try:
                children = ps.Process(pid).children(recursive=True)
            except ps.Error:
                continue   # gone: the monitor stops sampling it
            own = self._private_bytes(pid, now, last)
            if own is None:
                continue
            loaders = [self._private_bytes(c.pid, now, last) for c in children]
            memories.append(WorkerMemory(pid, rank, own, sum(b for b in loaders if b),
                                         len(children)))
        return HostSample(memory_total_bytes=total, memory_available_bytes=available,
                          swap_used_bytes=int(sw.used), swap_total_bytes=int(sw.total),
                          cpu_frac=ps.cpu_percent(None) / 100.0, workers=tuple(memories))

    def _private_bytes(self, pid: int, now: float,
                       last: Mapping[int, tuple[float, int | None]]) -> int | None:
        """``pid``'s USS: its ``last`` reading until that is ``private_interval_s`` old."""
        reading = last.get(pid)
        if reading is None or now - reading[0] >= self._private_interval_s:
            reading = (now, private_bytes(pid))
        self._private[pid] = reading
        return reading[1]


# -- scripted probes (tests and rehearsals) ----------------------------------------------------

class ScriptedGpuProbe:
    """Plays back GPU readings, one entry per sample, the last repeating; an exception entry
    is raised. ``worker_gpus``: the GPUs that hold the registered workers, whose pids they add
    to ``process_pids`` (None: the pids as scripted)."""

    def __init__(self, script: Sequence[Iterable[GpuSample] | BaseException], *,
                 worker_gpus: Iterable[int] | None = None) -> None:
        if not script:
            raise InputError("script", "ScriptedGpuProbe needs at least one entry", value=script,
                             fix="pass a list of GPU readings (one list of GpuSample per sample)")
        self._script = list(script)
        self._i = 0
        self.worker_gpus = None if worker_gpus is None else frozenset(worker_gpus)

    def sample(self, workers: Mapping[int, int | None] | None = None) -> tuple[GpuSample, ...]:
        entry = self._script[min(self._i, len(self._script) - 1)]
        self._i += 1
        if isinstance(entry, BaseException):
            raise entry
        if self.worker_gpus is None:
            return tuple(entry)
        pids = tuple(sorted(workers or ()))
        return tuple(dataclasses.replace(
            g, process_pids=tuple(g.process_pids or ()) + (pids if g.index in self.worker_gpus
                                                           else ())) for g in entry)


class ScriptedHostProbe:
    """Plays back host readings (the last repeats), with the registered workers' pids at
    ``worker_private_bytes`` each."""

    def __init__(self, script: Sequence[HostSample | BaseException], *,
                 worker_private_bytes: int = 0) -> None:
        if not script:
            raise InputError("script", "ScriptedHostProbe needs at least one entry", value=script,
                             fix="pass a list of HostSample readings (one per sample)")
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
        return dataclasses.replace(entry, workers=fake)


class ScriptedProbeFactory:
    """A picklable ``probe_factory(node_id) -> (gpu_probe, host_probe)`` for ``start_monitors``.
    ``gpu_script``: every node's script, or node id -> script (``default_gpu_script`` for the
    others); a None ``host_script`` keeps the real host probe."""

    def __init__(self, gpu_script: Sequence | Mapping[str, Sequence] | None,
                 host_script: Sequence | None = None, *,
                 default_gpu_script: Sequence | None = None,
                 worker_gpus: Iterable[int] | None = None) -> None:
        self.gpu_script = gpu_script
        self.host_script = host_script
        self.default_gpu_script = default_gpu_script
        self.worker_gpus = None if worker_gpus is None else tuple(worker_gpus)

    def __call__(self, node_id: str) -> tuple[ScriptedGpuProbe | None, ScriptedHostProbe | None]:
        script = self.gpu_script
        if isinstance(script, Mapping):
            script = script.get(node_id, self.default_gpu_script)
        gpu = ScriptedGpuProbe(script, worker_gpus=self.worker_gpus) \
            if script is not None else None
        host = ScriptedHostProbe(self.host_script) if self.host_script is not None else None
        return gpu, host


def default_gpu_probe() -> NvmlGpuProbe:
    """The real GPU probe; raises ProbeError where NVML is missing or turned off
    (:data:`~raytrain_guard.config.DISABLE_NVML_ENV`)."""
    if nvml_disabled():
        raise ProbeError(f"NVML disabled by {DISABLE_NVML_ENV}=1")
    return NvmlGpuProbe()


def takes_workers(probe: Any) -> bool:
    """True when ``probe.sample`` accepts the registered workers (``sample(workers)``)."""
    try:
        params = inspect.signature(probe.sample).parameters.values()
    except (TypeError, ValueError, AttributeError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
               for p in params)
