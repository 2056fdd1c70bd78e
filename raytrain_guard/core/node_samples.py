"""What a node monitor measured at one moment: GPUs, host, train workers (pure); and the batch
layout a rank reports (:class:`RunSetup`). They travel as dicts; ``from_dict`` raises
``ValueError`` (or ``KeyError``/``TypeError``) on a malformed one, which the coordinator counts
and ignores.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from raytrain_guard.errors import check_int

THROTTLE_REASONS = ("thermal", "power", "slowdown")
"""Clock throttle reasons the monitor reports (NVML's thermal, power-cap/brake and HW slowdown)."""


@dataclass(frozen=True)
class GpuSample:
    """One GPU as NVML sees it. NVML's used memory counts every process and the CUDA context.

    ``process_pids``: the pids of the compute processes on this GPU (NVML's
    ``nvmlDeviceGetComputeRunningProcesses``), so the policy can count only the GPUs that hold
    this run's workers; None when the probe cannot tell.
    """

    index: int
    memory_used_bytes: int
    memory_total_bytes: int
    utilization_frac: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    throttle_reasons: tuple[str, ...] = ()
    process_pids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.memory_total_bytes <= 0 or self.memory_used_bytes < 0:
            raise ValueError(f"GPU {self.index}: memory used {self.memory_used_bytes} of "
                             f"{self.memory_total_bytes} bytes is not a valid reading")
        unknown = set(self.throttle_reasons) - set(THROTTLE_REASONS)
        if unknown:
            raise ValueError(f"GPU {self.index}: unknown throttle reasons {sorted(unknown)}")

    @property
    def memory_frac(self) -> float:
        return self.memory_used_bytes / self.memory_total_bytes

    @property
    def is_throttled(self) -> bool:
        return bool(self.throttle_reasons)


@dataclass(frozen=True)
class WorkerMemory:
    """Private (unshared) memory of one registered train worker and its DataLoader workers."""

    pid: int
    world_rank: int | None
    private_bytes: int
    loader_private_bytes: int = 0
    num_loader_processes: int = 0


@dataclass(frozen=True)
class HostSample:
    """Host memory, swap and CPU, plus the registered train workers' private memory."""

    memory_total_bytes: int
    memory_available_bytes: int
    swap_used_bytes: int = 0
    swap_total_bytes: int = 0
    cpu_frac: float | None = None
    workers: tuple[WorkerMemory, ...] = ()

    def __post_init__(self) -> None:
        if self.memory_total_bytes <= 0 or not 0 <= self.memory_available_bytes:
            raise ValueError(f"host memory available {self.memory_available_bytes} of "
                             f"{self.memory_total_bytes} bytes is not a valid reading")

    @property
    def memory_used_frac(self) -> float:
        """1 - available / total: the fraction Ray's memory monitor compares with its 0.95 line."""
        return 1.0 - self.memory_available_bytes / self.memory_total_bytes


@dataclass(frozen=True)
class NodeSample:
    """One sampling round of one node monitor.

    ``seq`` counts the monitor's samples; ``monitor_epoch`` changes when the monitor restarts
    (its ``seq`` starts again), so the coordinator can tell an old sample from a new monitor's.
    ``gpu_error`` says why there are no GPU figures (NVML missing or failing): host-only mode.
    """

    node_id: str
    seq: int
    monitor_epoch: str
    time_s: float
    host: HostSample | None
    gpus: tuple[GpuSample, ...] = ()
    gpu_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id, "seq": self.seq, "monitor_epoch": self.monitor_epoch,
            "time_s": self.time_s, "gpu_error": self.gpu_error,
            "host": None if self.host is None else {
                **vars(self.host), "workers": [vars(w).copy() for w in self.host.workers]},
            "gpus": [{**vars(g), "throttle_reasons": list(g.throttle_reasons),
                      "process_pids": None if g.process_pids is None else list(g.process_pids)}
                     for g in self.gpus],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> NodeSample:
        """Rebuild a sample; raises ValueError/KeyError/TypeError when it is malformed."""
        node_id = d["node_id"]
        if not isinstance(node_id, str) or not node_id:
            raise ValueError(f"node_id must be a non-empty string, got {node_id!r}")
        h = d.get("host")
        host = None if h is None else HostSample(
            memory_total_bytes=int(h["memory_total_bytes"]),
            memory_available_bytes=int(h["memory_available_bytes"]),
            swap_used_bytes=int(h.get("swap_used_bytes", 0)),
            swap_total_bytes=int(h.get("swap_total_bytes", 0)),
            cpu_frac=_opt_float(h.get("cpu_frac")),
            workers=tuple(WorkerMemory(**w) for w in h.get("workers", ())))
        gpus = tuple(GpuSample(**{**g, "throttle_reasons": tuple(g.get("throttle_reasons", ())),
                                  "process_pids": _opt_ints(g.get("process_pids"))})
                     for g in d.get("gpus", ()))
        return cls(node_id=node_id, seq=int(d["seq"]), monitor_epoch=str(d["monitor_epoch"]),
                   time_s=float(d["time_s"]), host=host, gpus=gpus,
                   gpu_error=d.get("gpu_error"))


def _opt_float(x: Any) -> float | None:
    return None if x is None else float(x)


def _opt_ints(x: Any) -> tuple[int, ...] | None:
    return None if x is None else tuple(int(v) for v in x)


def _reported_int(d: Mapping[str, Any], key: str, *, at_least: int) -> int | None:
    """A rank's ``setup[key]``: None when it does not say, else an integer >= ``at_least``
    (an InputError, so a ValueError, for a malformed report)."""
    v = d.get(key)
    return None if v is None else check_int(
        f"setup {key}", v, at_least=at_least,
        fix=f"report {key} as an integer >= {at_least}, or leave it out")


#: what a rank may say it runs on: "simulated" is a card simulated on CPU (the experiment's)
DEVICES = ("cuda", "cpu", "simulated")


@dataclass(frozen=True)
class RunSetup:
    """The batch layout a rank reports running with; the policy's shrink and prefetch input."""

    micro_batch: int | None = None
    grad_accum: int | None = None
    prefetch_factor: int | None = None
    # optional, for the policy's predictions; None when the rank does not say
    device: str | None = None             # "cuda", "cpu" or "simulated" (a card simulated on
                                          # CPU, rehearsing a GPU): no cache but on "cuda"
    device_index: int | None = None       # the GPU this rank runs on (torch.cuda.current_device)
    allocated_bytes: int | None = None    # torch.cuda.memory_allocated() at the step's end
    reserved_bytes: int | None = None     # torch.cuda.memory_reserved() at the step's end
    device_total_bytes: int | None = None  # the card's memory (torch.cuda.mem_get_info()[1])
    num_workers: int | None = None        # DataLoader workers of this rank
    batch_bytes: int | None = None        # host bytes of one batch in flight (pinned copy
                                          # included when pin_memory)

    @property
    def without_cache(self) -> bool:
        """Known to hold no allocator cache to release: a CPU rank, or a simulated card."""
        return self.device in ("cpu", "simulated")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> RunSetup:
        if not d:
            return cls()
        values: dict[str, Any] = {}
        for key in ("micro_batch", "grad_accum", "prefetch_factor"):
            values[key] = _reported_int(d, key, at_least=1)
        for key in ("device_index", "allocated_bytes", "reserved_bytes", "device_total_bytes",
                    "num_workers", "batch_bytes"):
            values[key] = _reported_int(d, key, at_least=0)
        device = d.get("device")
        if device is not None and device not in DEVICES:
            raise ValueError(f"setup device must be one of {', '.join(DEVICES)}, got {device!r}")
        values["device"] = device
        return cls(**values)

    @property
    def cached_free_bytes(self) -> int | None:
        """Reserved minus allocated: what a cache release can hand back (None: not reported)."""
        reserved, allocated = self.reserved_bytes, self.allocated_bytes
        return None if reserved is None or allocated is None else max(0, reserved - allocated)

