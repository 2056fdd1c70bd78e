"""The drop-in's model (:func:`raytrain_guard.train.prepare_model`): planned DDP through Ray's
own ``prepare_model``, or :func:`~raytrain_guard.runtime.dist.model.wrap_model` for the strategies Ray
lacks (``zero1``, FSDP2), with the communication timer attached."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from raytrain_guard.config import GuardConfig
from raytrain_guard.runtime.dist.bandwidth import measure_allreduce_curve, plan_bucket_cap
from raytrain_guard.runtime.dist.model import parse_strategy, wrap_model
from raytrain_guard.runtime.guard.comm_timers import attach_comm_timers

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
        curve = None
        if measure_bandwidth:
            try:
                curve = measure_allreduce_curve(device=device)
            except Exception:  # a collective: every rank fails alike, no curve
                logger.warning("rank %d: allreduce curve not measured", rank, exc_info=True)
        bucket = plan_bucket_cap(model, config, curve)
        logger.info("rank %d: %s", rank, bucket.reason)
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
    attach_comm_timers(module, timer, world_rank=rank)
    return module


def _wrap(model: Any, *, ctx: Any, device: Any, move_to_device: Any,
          parallel_strategy: str | None, kwargs: dict[str, Any]) -> Any:
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
