"""A short measurement of the live process group: allreduce time against message size.

At start-up every rank allreduces a few message sizes a few times; the slowest rank's time per
size (max over ranks) gives a bus-bandwidth curve, and the smallest message that reaches
``GuardConfig.bandwidth_peak_frac`` of the curve's peak is the bucket size where bigger buckets
stop paying off. :func:`plan_bucket_cap` hands that curve to the planner's bucket recommendation.

Bus bandwidth follows the nccl-tests convention for allreduce: ``2 (n - 1) / n x bytes / time``
(a ring moves each byte ``2 (n - 1) / n`` times), so figures from different world sizes compare.

The curve arithmetic is pure; only :func:`measure_allreduce_curve` touches torch.distributed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import InputError, check_int
from raytrain_guard.planner.buckets import BucketPlan, recommend_bucket_cap
from raytrain_guard.units import KiB, MiB, format_bytes

logger = logging.getLogger(__name__)

#: Message sizes measured on CPU (gloo), a factor 4 apart.
CPU_SIZES_BYTES: tuple[int, ...] = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
#: On CUDA (NCCL) the curve flattens later.
CUDA_SIZES_BYTES: tuple[int, ...] = (256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)


def bus_bytes_per_s(size_bytes: int, time_s: float, world_size: int) -> float:
    """Allreduce bus bandwidth: ``2 (n - 1) / n x size / time``; plain size / time when n == 1."""
    if time_s <= 0:
        return float("inf")
    factor = 2.0 * (world_size - 1) / world_size if world_size > 1 else 1.0
    return factor * size_bytes / time_s


@dataclass(frozen=True)
class BandwidthPoint:
    """One message size: the slowest rank's seconds per allreduce and the bus bandwidth."""

    size_bytes: int
    time_s: float
    bus_bytes_per_s: float


@dataclass(frozen=True)
class BandwidthCurve:
    """Allreduce bus bandwidth against message size, measured on the live process group."""

    world_size: int
    backend: str
    points: tuple[BandwidthPoint, ...]
    measure_s: float = 0.0     # wall time the whole measurement took on this rank

    @classmethod
    def from_times(cls, sizes_bytes: Sequence[int], times_s: Sequence[float], *, world_size: int,
                   backend: str = "", measure_s: float = 0.0) -> BandwidthCurve:
        """The curve of given per-size times (seconds per allreduce, max over ranks)."""
        if len(sizes_bytes) != len(times_s) or not sizes_bytes:
            raise InputError("sizes_bytes", "needs one time per size and at least one size",
                             value=(len(sizes_bytes), len(times_s)),
                             fix="pass equally long, non-empty sequences")
        points = tuple(BandwidthPoint(int(s), float(t), bus_bytes_per_s(int(s), float(t),
                                                                        world_size))
                       for s, t in sorted(zip(sizes_bytes, times_s)))
        return cls(world_size, backend, points, measure_s)

    @property
    def peak_bus_bytes_per_s(self) -> float:
        return max(p.bus_bytes_per_s for p in self.points)

    def knee_bytes(self, peak_frac: float) -> int:
        """Smallest measured message size whose bus bandwidth reaches ``peak_frac`` of the peak.

        When only the largest size reaches it, the curve had not flattened within the measured
        range and the true knee may lie beyond (see :attr:`saturated`).
        """
        if not 0.0 < peak_frac <= 1.0:
            raise InputError("peak_frac", "must be in (0, 1]", value=peak_frac,
                             fix="use GuardConfig.bandwidth_peak_frac, e.g. 0.8")
        target = peak_frac * self.peak_bus_bytes_per_s
        return next(p.size_bytes for p in self.points if p.bus_bytes_per_s >= target)

    def saturated(self, peak_frac: float) -> bool:
        """Whether a size below the largest already reaches ``peak_frac`` of the peak."""
        return len(self.points) > 1 and self.knee_bytes(peak_frac) < self.points[-1].size_bytes

    def as_pairs(self) -> tuple[tuple[int, float], ...]:
        """``((message bytes, seconds per allreduce), ...)``, smallest first: the form
        :func:`raytrain_guard.planner.buckets.recommend_bucket_cap` takes as ``bandwidth_curve``."""
        return tuple((p.size_bytes, p.time_s) for p in self.points)

    def to_dict(self, peak_frac: float | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "world_size": self.world_size, "backend": self.backend,
            "measure_s": round(self.measure_s, 4),
            "sizes_bytes": [p.size_bytes for p in self.points],
            "times_s": [p.time_s for p in self.points],
            "bus_gbps": [round(p.bus_bytes_per_s / 1e9, 4) for p in self.points],
            "peak_bus_gbps": round(self.peak_bus_bytes_per_s / 1e9, 4),
        }
        if peak_frac is not None:
            out["peak_frac"] = peak_frac
            out["knee_bytes"] = self.knee_bytes(peak_frac)
            out["saturated"] = self.saturated(peak_frac)
        return out

    def describe(self, peak_frac: float) -> str:
        """One log line: the curve and its knee."""
        body = ", ".join(f"{format_bytes(p.size_bytes)}: {p.bus_bytes_per_s / 1e9:.2f} GB/s"
                         for p in self.points)
        knee = self.knee_bytes(peak_frac)
        tail = "" if self.saturated(peak_frac) else " (curve still rising: knee may lie beyond)"
        return (f"allreduce bus bandwidth on {self.world_size} ranks ({self.backend}), "
                f"measured in {self.measure_s * 1e3:.0f} ms: {body}; "
                f"{peak_frac:.0%} of peak reached at {format_bytes(knee)}{tail}")


def measure_allreduce_curve(*, sizes_bytes: Sequence[int] | None = None, num_iters: int = 3,
                            num_warmup: int = 1, device: Any = None, group: Any = None,
                            clock: Callable[[], float] = time.perf_counter) -> BandwidthCurve:
    """Time allreduce of each size on the live process group: a sequence of collectives,
    which every rank of ``group`` calls with the same sizes. Per size: ``num_warmup`` untimed
    allreduces, then ``num_iters`` timed ones, maxed over ranks: the curve is what the slowest
    rank saw. ``device`` defaults to the current CUDA device under NCCL and CPU otherwise.
    """
    check_int("num_iters", num_iters, at_least=1, fix="use e.g. 3")
    if not dist.is_available() or not dist.is_initialized():
        raise InputError("process group", "torch.distributed is not initialized",
                         fix="call it inside a TorchTrainer worker or after init_process_group")
    backend = str(dist.get_backend(group))
    world_size = dist.get_world_size(group)
    if device is None:
        device = (torch.device("cuda", torch.cuda.current_device())
                  if backend == "nccl" and torch.cuda.is_available() else torch.device("cpu"))
    device = torch.device(device)
    if sizes_bytes is None:
        sizes_bytes = CUDA_SIZES_BYTES if device.type == "cuda" else CPU_SIZES_BYTES
    sizes = sorted({max(4, int(s)) // 4 * 4 for s in sizes_bytes})

    buffer = torch.zeros(sizes[-1] // 4, dtype=torch.float32, device=device)
    # the ranks line up first: the time one waits for the others to arrive (their set-up) is
    # no part of what the measurement costs
    dist.all_reduce(buffer[:1], group=group)
    _synchronize(device)
    start = clock()
    times = []
    for size in sizes:
        message = buffer[: size // 4]
        for _ in range(num_warmup):
            dist.all_reduce(message, group=group)
        _synchronize(device)
        t0 = clock()
        for _ in range(num_iters):
            dist.all_reduce(message, group=group)
        _synchronize(device)
        times.append((clock() - t0) / num_iters)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    del buffer
    return BandwidthCurve.from_times(sizes, slowest.cpu().tolist(), world_size=world_size,
                                     backend=backend, measure_s=clock() - start)


def plan_bucket_cap(model: Any, config: GuardConfig, curve: BandwidthCurve | None) -> BucketPlan:
    """DDP's bucket cap recommended from ``model``'s trainable gradients (in the order backward
    makes them) and, when measured, the allreduce ``curve``."""
    sizes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
    return recommend_bucket_cap(grad_bytes=sum(sizes), config=config, param_bytes=sizes[::-1],
                                bandwidth_curve=curve.as_pairs() if curve is not None else None)


def _synchronize(device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
