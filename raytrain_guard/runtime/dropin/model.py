"""The drop-in's model (:func:`raytrain_guard.train.prepare_model`): planned DDP through Ray's
own ``prepare_model``, or :func:`~raytrain_guard.runtime.dist.model.wrap_model` for the strategies Ray
lacks (``zero1``, FSDP2), with the communication timer attached."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from raytrain_guard.config import GuardConfig

logger = logging.getLogger(__name__)

#: the strategies Ray's prepare_model has (``parallel_strategy``); others go to wrap_model
RAY_STRATEGIES = ("ddp", "fsdp", None)


def prepare_model(model: Any, *, plan: dict[str, Any], ctx: Any, device: Any,
                  config: GuardConfig, timer: Any, measure_bandwidth: bool, move_to_device: Any,
                  parallel_strategy: str | None,
                  parallel_strategy_kwargs: Mapping[str, Any] | None) -> Any:
    """The wrapped model; the bucket plan and the wrapper it got are written to ``plan`` as
    they are made (the summary's ``model``). DDP's ``bucket_cap_mb`` is planned unless
    ``parallel_strategy_kwargs`` has one; ``timer`` (the step timer) gets the communication
    waits."""
    rank = ctx.world_rank
    kwargs = dict(parallel_strategy_kwargs or {})
    if parallel_strategy in ("ddp", "zero1") and ctx.world_size > 1:
        bucket = _planned_bucket_cap(model, config=config, device=device,
                                     measure_bandwidth=measure_bandwidth, rank=rank)
        plan.update(bucket.to_dict(), reason=bucket.reason)
        if "bucket_cap_mb" in kwargs:
            logger.info("rank %d: bucket_cap_mb=%s as given (the guard's plan: %s)",
                        rank, kwargs["bucket_cap_mb"], bucket.reason)
        else:
            kwargs["bucket_cap_mb"] = bucket.bucket_cap_mb
    module = _wrap(model, ctx=ctx, device=device, move_to_device=move_to_device,
                   parallel_strategy=parallel_strategy, kwargs=kwargs)
    plan["wrapped"] = type(module).__name__
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        plan["bucket_cap_bytes"] = int(module.bucket_bytes_cap)
    _attach_comm_timer(module, timer, world_size=ctx.world_size, rank=rank)
    return module


def _wrap(model: Any, *, ctx: Any, device: Any, move_to_device: Any,
          parallel_strategy: str | None, kwargs: dict[str, Any]) -> Any:
    from raytrain_guard.runtime.dist.model import parse_strategy, wrap_model

    in_ray = ctx.source == "ray"
    if in_ray and parallel_strategy in RAY_STRATEGIES:
        from ray.train.torch import prepare_model as ray_prepare_model
        return ray_prepare_model(model, move_to_device=move_to_device,
                                 parallel_strategy=parallel_strategy,
                                 parallel_strategy_kwargs=kwargs or None)
    if parallel_strategy is None:
        return model.to(device) if move_to_device is not False else model
    return wrap_model(model, strategy=parse_strategy(parallel_strategy),
                      bucket_cap_mb=kwargs.get("bucket_cap_mb"),
                      gradient_as_bucket_view=bool(kwargs.get("gradient_as_bucket_view", False)),
                      device=device, use_ray=in_ray).module


def _planned_bucket_cap(model: Any, *, config: GuardConfig, device: Any,
                        measure_bandwidth: bool, rank: int) -> Any:
    """The bucket plan from the gradients and, when measured, the allreduce curve."""
    from raytrain_guard.planner.buckets import recommend_bucket_cap

    curve = None
    if measure_bandwidth:
        try:
            from raytrain_guard.runtime.dist.bandwidth import measure_allreduce_curve
            curve = measure_allreduce_curve(device=device)
        except Exception:  # a collective: every rank fails alike, no curve
            logger.warning("rank %d: allreduce curve not measured", rank, exc_info=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    plan = recommend_bucket_cap(
        grad_bytes=sum(p.numel() * p.element_size() for p in trainable), config=config,
        param_bytes=[p.numel() * p.element_size() for p in reversed(trainable)],
        bandwidth_curve=curve.as_pairs() if curve is not None else None)
    logger.info("rank %d: %s", rank, plan.reason)
    return plan


def _attach_comm_timer(module: Any, timer: Any, *, world_size: int, rank: int) -> None:
    from raytrain_guard.runtime.guard.comm_timers import attach_comm_timer, attach_fsdp_comm_timer

    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        try:
            attach_comm_timer(module, timer)
        except Exception:  # fail open: no communication wait figures
            logger.warning("rank %d: communication timer not attached (a comm hook of "
                           "your own?)", rank, exc_info=True)
    elif world_size > 1 and _is_fsdp2(module):
        try:
            attach_fsdp_comm_timer(module, timer)
        except Exception:  # fail open: no communication wait figures
            logger.warning("rank %d: FSDP2 communication timer not attached", rank,
                           exc_info=True)


def _is_fsdp2(module: Any) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(module, FSDPModule)
