"""Node probes: the only code that reads NVML or psutil, plus scripted probes for rehearsals.

A host probe has ``sample(workers: Mapping[int, int | None]) -> HostSample`` where ``workers``
maps each registered train-worker pid to its world rank; a GPU probe has ``sample() ->
tuple[GpuSample, ...]`` or, to mark the GPUs that hold those workers, ``sample(workers)``.
A GPU's ``process_pids`` (None when unknown) is how the policy tells this run's GPUs from
another job's on the same node. Probes raise :class:`ProbeError` (or anything
else) when they cannot read; the node monitor turns that into host-only mode, never a crash.

Scripted probes ship with the package so a user can rehearse a hot GPU, a throttled one, host
memory pressure, another job's GPU or an NVML failure without the hardware::

    gpu = ScriptedGpuProbe([[GpuSample(0, 70 * GiB, 80 * GiB)],
                            [GpuSample(0, 76 * GiB, 80 * GiB, throttle_reasons=("thermal",))]])
    monitor = NodeMonitor("node-a", config, gpu_probe=gpu, host_probe=ScriptedHostProbe([...]))
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any, Callable, Iterable, Mapping, Sequence

from raytrain_guard.config import DISABLE_NVML_ENV, nvml_disabled
from raytrain_guard.core.node_samples import GpuSample, HostSample, WorkerMemory
from raytrain_guard.errors import GuardError, InputError
from raytrain_guard.host_memory import host_memory, private_bytes

logger = logging.getLogger(__name__)


class ProbeError(GuardError):
    """A probe cannot read its source (NVML missing, driver error, process gone)."""


# -- NVML --------------------------------------------------------------------------------------

class NvmlGpuProbe:
    """Every GPU of this node through NVML: memory, utilization, temperature, power, throttling,
    and the pids of the compute processes on it (None when NVML cannot list them).

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
            out.append(GpuSample(index, int(mem.used), int(mem.total), util, temp, power, reasons,
                                 _optional(lambda: self._pids(handle))))
        return tuple(out)

    def _pids(self, handle: Any) -> tuple[int, ...]:
        """The compute processes on one GPU (pids as the driver sees them: in a container
        with its own pid namespace they may not match; the policy then counts every GPU)."""
        return tuple(int(p.pid) for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle))


def _optional(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except Exception:
        return None


# -- psutil ------------------------------------------------------------------------------------

class PsutilHostProbe:
    """Host memory (narrowed to the container's cgroup limit), swap and CPU, and the private
    memory of each registered train worker.

    Memory comes from :mod:`raytrain_guard.host_memory`: ``host_memory()`` for the host (on
    Ray-on-Kubernetes the pod's limit, not the machine's RAM) and ``private_bytes(pid)`` (USS,
    pages no other process shares) per process. A worker's DataLoader workers are its child
    processes, found fresh at every sample (they come and go with epochs).
    """

    def __init__(self) -> None:
        import psutil
        self._psutil = psutil
        psutil.cpu_percent(None)   # prime: the first call always returns 0.0

    def sample(self, workers: Mapping[int, int | None]) -> HostSample:
        ps = self._psutil
        total, available = host_memory()
        sw = ps.swap_memory()
        memories = []
        for pid, rank in sorted(workers.items()):
            try:
                children = ps.Process(pid).children(recursive=True)
            except ps.Error:
                continue   # gone: the monitor stops sampling it
            own = private_bytes(pid)
            if own is None:
                continue
            loaders = [private_bytes(c.pid) for c in children]
            memories.append(WorkerMemory(pid, rank, own, sum(b for b in loaders if b),
                                         len(children)))
        return HostSample(memory_total_bytes=total, memory_available_bytes=available,
                          swap_used_bytes=int(sw.used), swap_total_bytes=int(sw.total),
                          cpu_frac=ps.cpu_percent(None) / 100.0, workers=tuple(memories))


# -- scripted probes (tests and rehearsals) ----------------------------------------------------

class ScriptedGpuProbe:
    """Plays back a script of GPU readings, one entry per sample; the last entry repeats.

    An entry that is an exception instance is raised instead (rehearse an NVML failure).
    ``worker_gpus``: the indexes of the GPUs that hold this node's registered train workers;
    those GPUs report the workers' pids as ``process_pids`` (added to any scripted ones) and
    the others report only their scripted pids, so a rehearsal can put another job's hot GPU
    next to the run's. None (the default) leaves ``process_pids`` as scripted.
    """

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
    """Plays back host readings (the last repeats); fills in the registered workers' pids
    with ``worker_private_bytes`` each, so registration can be rehearsed without processes."""

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
        return HostSample(entry.memory_total_bytes, entry.memory_available_bytes,
                          entry.swap_used_bytes, entry.swap_total_bytes, entry.cpu_frac, fake)


class ScriptedProbeFactory:
    """A picklable ``probe_factory(node_id) -> (gpu_probe, host_probe)`` for ``start_monitors``.

    ``gpu_script`` / ``host_script``: the script every node plays back, or a mapping from node
    id to its own script (a node missing from the mapping uses ``default_gpu_script``). A None
    host script keeps the real psutil host probe. ``worker_gpus``: see
    :class:`ScriptedGpuProbe`. Rehearse a hot or throttled node with it.
    """

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


def default_host_probe() -> PsutilHostProbe:
    return PsutilHostProbe()
