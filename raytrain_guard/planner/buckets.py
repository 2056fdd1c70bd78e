"""DDP ``bucket_cap_mb`` from the model's gradient bytes instead of the fixed 25 MiB (pure).

The rule, in order:

1. Overlap target: ``grad_bytes / config.target_num_buckets``, so early buckets are all-reduced
   while backward still produces the rest.
2. With a measured bandwidth curve (message bytes -> allreduce seconds): at least the smallest
   message that reaches ``config.bandwidth_peak_frac`` of the peak bandwidth, so each allreduce
   is efficient.
3. Clamped to ``[config.min_bucket_cap_mb, config.max_bucket_cap_mb]``.
4. At least the largest parameter: DDP never splits a parameter, so a smaller cap only makes
   the bucket holding it overshoot.
5. Bounded by memory: ``config.num_buckets_in_flight`` buckets of the cap must fit in
   ``memory_slack_bytes`` (the device memory left free by the plan). Memory wins over 2-4.

Every input used lands in ``BucketPlan.inputs`` and the rule that decided in ``reason``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import PlanInputError, check_int
from raytrain_guard.planner.memory_model import PARAM_BYTES, Strategy, TrainingSetup
from raytrain_guard.planner.model_stats import ModelStats
from raytrain_guard.units import MiB, format_bytes


@dataclass(frozen=True)
class BucketPlan:
    """A recommended ``bucket_cap_mb`` (MiB, as DDP reads it) and why."""

    bucket_cap_mb: float
    num_buckets: int
    reason: str
    inputs: Mapping[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"bucket_cap_mb": self.bucket_cap_mb, "num_buckets": self.num_buckets,
                "reason": self.reason, "inputs": dict(self.inputs)}


def efficient_message_bytes(bandwidth_curve: Sequence[tuple[int, float]],
                            peak_frac: float) -> tuple[int, float]:
    """The smallest message reaching ``peak_frac`` of the curve's peak bandwidth, and that peak.

    Bandwidth is ``bytes / seconds`` (algorithm bandwidth). Bus bandwidth differs from it by the
    factor ``2 (n - 1) / n``, the same for every message size, so the fraction of the peak is
    the same in either measure.
    """
    points = []
    for i, point in enumerate(bandwidth_curve):
        try:
            size, seconds = int(point[0]), float(point[1])
        except (TypeError, ValueError, IndexError):
            raise PlanInputError(f"bandwidth_curve[{i}]", "not a (message bytes, seconds) pair",
                                 value=point, fix="pass pairs like (4194304, 0.0012)") from None
        if size <= 0 or not seconds > 0 or not math.isfinite(seconds):
            raise PlanInputError(f"bandwidth_curve[{i}]", "bytes and seconds must be positive",
                                 value=point, fix="drop the point or measure it again")
        points.append((size, size / seconds))
    if not points:
        raise PlanInputError("bandwidth_curve", "is empty", value=list(bandwidth_curve),
                             fix="pass at least one (message bytes, seconds) pair, or None")
    points.sort()
    peak = max(bw for _, bw in points)
    return next(size for size, bw in points if bw >= peak_frac * peak), peak


def count_buckets(cap_bytes: float, param_bytes: Sequence[int], grad_bytes: int) -> int:
    """Buckets DDP builds for ``cap_bytes``.

    With parameter sizes (in DDP's bucket order): DDP's greedy assignment, which adds each
    parameter to the open bucket and closes the bucket once it reaches the cap (so buckets
    overshoot by at most one parameter). Without: ``ceil(grad_bytes / cap)``.
    """
    if not param_bytes:
        return max(1, math.ceil(grad_bytes / cap_bytes))
    buckets, open_bytes = 0, 0
    for size in param_bytes:
        open_bytes += size
        if open_bytes >= cap_bytes:
            buckets, open_bytes = buckets + 1, 0
    return buckets + (1 if open_bytes else 0)


def recommend_bucket_cap(*, grad_bytes: int, config: GuardConfig,
                         param_bytes: Sequence[int] = (),
                         bandwidth_curve: Sequence[tuple[int, float]] | None = None,
                         memory_slack_bytes: int | None = None) -> BucketPlan:
    """Recommend DDP's ``bucket_cap_mb`` for ``grad_bytes`` of gradients (see module rule)."""
    check_int("grad_bytes", grad_bytes, at_least=1, error=PlanInputError,
              fix="pass the trainable parameters' gradient bytes")
    if memory_slack_bytes is not None and memory_slack_bytes < 0:
        raise PlanInputError("memory_slack_bytes", "must be >= 0", value=memory_slack_bytes,
                             fix="pass the free device memory left by the plan, or None")
    largest_param = max(param_bytes, default=0)
    target = grad_bytes / config.target_num_buckets
    inputs: dict[str, float] = {
        "grad_bytes": grad_bytes, "target_num_buckets": config.target_num_buckets,
        "overlap_target_bytes": target, "largest_param_bytes": largest_param,
        "min_bucket_cap_mb": config.min_bucket_cap_mb,
        "max_bucket_cap_mb": config.max_bucket_cap_mb}
    cap = target
    why = (f"{format_bytes(grad_bytes)} of gradients / {config.target_num_buckets} buckets "
           f"= {target / MiB:.1f} MiB keeps the allreduce overlapped with backward")
    if bandwidth_curve is not None:
        efficient, peak = efficient_message_bytes(bandwidth_curve, config.bandwidth_peak_frac)
        inputs.update(efficient_message_bytes=efficient, peak_bandwidth_bytes_per_s=peak)
        if efficient > cap:
            cap = efficient
            why += (f"; raised to {efficient / MiB:.1f} MiB, the smallest message reaching "
                    f"{config.bandwidth_peak_frac:.0%} of the measured peak "
                    f"{peak / 1e9:.2f} GB/s")
        else:
            why += (f"; every bucket is at least the smallest efficient message "
                    f"({efficient / MiB:.1f} MiB at {config.bandwidth_peak_frac:.0%} of the "
                    f"measured peak {peak / 1e9:.2f} GB/s)")
    low, high = config.min_bucket_cap_mb * MiB, config.max_bucket_cap_mb * MiB
    if cap < low:
        cap, why = low, why + f"; clamped up to min_bucket_cap_mb={config.min_bucket_cap_mb:g}"
    elif cap > high:
        cap, why = high, why + f"; clamped down to max_bucket_cap_mb={config.max_bucket_cap_mb:g}"
    if largest_param > cap:
        cap = largest_param
        why += (f"; raised to the largest parameter ({largest_param / MiB:.1f} MiB), which DDP "
                f"never splits")
    bounded_by_memory = False
    if memory_slack_bytes is not None:
        bound = memory_slack_bytes / config.num_buckets_in_flight
        inputs.update(memory_slack_bytes=memory_slack_bytes,
                      num_buckets_in_flight=config.num_buckets_in_flight,
                      memory_bound_bytes=bound)
        if bound < cap:
            cap, bounded_by_memory = bound, True
            why += (f"; lowered so {config.num_buckets_in_flight} buckets in flight fit the "
                    f"{format_bytes(memory_slack_bytes)} left free")
    cap_mb = _round_mb(cap / MiB, down=bounded_by_memory)
    if cap_mb <= 0:
        raise PlanInputError("memory_slack_bytes", "leaves no room for a gradient bucket",
                             value=memory_slack_bytes,
                             fix="free device memory (smaller micro-batch, sharding) first")
    num_buckets = count_buckets(cap_mb * MiB, param_bytes, grad_bytes)
    inputs["bucket_cap_bytes"] = cap_mb * MiB
    return BucketPlan(cap_mb, num_buckets, f"bucket_cap_mb={cap_mb:g} ({num_buckets} buckets): "
                      + why, inputs)


def _round_mb(mb: float, *, down: bool) -> float:
    """Round to 1/16 MiB for a readable value: down under a memory bound (never above it),
    otherwise up (never below the largest parameter or the efficient message size)."""
    return (math.floor(mb * 16) if down else math.ceil(mb * 16 - 1e-9)) / 16


def in_flight_bytes(model: ModelStats, setup: TrainingSetup, config: GuardConfig,
                    bandwidth_curve) -> int:
    """``num_buckets_in_flight`` buckets of the cap recommended without a memory bound; 0 when
    no DDP buckets exist (FSDP, one rank, nothing trainable)."""
    if setup.strategy not in (Strategy.DDP, Strategy.ZERO1) or setup.world_size == 1 or \
            model.num_trainable_params == 0:
        return 0
    free = _recommend(model, setup, config, bandwidth_curve, None)
    return int(config.num_buckets_in_flight * free.bucket_cap_mb * MiB)


def bucket_plan(model: ModelStats, setup: TrainingSetup, config: GuardConfig,
                bandwidth_curve, slack: int, warnings: list[str],
                notes: list[str]) -> BucketPlan | None:
    """The plan's bucket cap for ``setup``, bounded by the device memory left free (``slack``);
    None where no DDP buckets exist (FSDP, one rank, nothing trainable), said in ``notes``."""
    if setup.strategy not in (Strategy.DDP, Strategy.ZERO1):
        notes.append(f"{setup.strategy.value}: FSDP does not use bucket_cap_mb")
        return None
    if model.num_trainable_params == 0:
        notes.append("no trainable parameters: no gradient buckets")
        return None
    if setup.world_size == 1:   # the memory model's note says why: no DDP wrapper, no buckets
        return None
    if slack < config.num_buckets_in_flight * MiB / 16:
        warnings.append("no device memory left for larger DDP buckets: bucket_cap_mb not "
                        "bounded by memory (the plan is already at or over its budget)")
        slack = None
    return _recommend(model, setup, config, bandwidth_curve, slack)


def _recommend(model, setup, config, bandwidth_curve, slack: int | None) -> BucketPlan:
    elem = PARAM_BYTES[setup.precision]
    return recommend_bucket_cap(grad_bytes=model.num_trainable_params * elem, config=config,
                                param_bytes=tuple(n * elem for n in model.param_numels),
                                bandwidth_curve=bandwidth_curve, memory_slack_bytes=slack)
