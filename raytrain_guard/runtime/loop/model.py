"""The model of the shared train loop, wrapped as planned, with its optimizer and scheduler."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch

from raytrain_guard.errors import InputError
from raytrain_guard.planner.memory_model import Strategy
from raytrain_guard.runtime.dist.bandwidth import measure_allreduce_curve, plan_bucket_cap
from raytrain_guard.runtime.dist.model import PlannedModel, wrap_model, wrap_optimizer
from raytrain_guard.runtime.loop.config import LoopConfig, call_factory

logger = logging.getLogger(__name__)


@dataclass
class WrappedModel:
    """``planned``: the wrapped module; ``curve``: the allreduce curve measured (None: not
    measured); ``bucket_plan``: the DDP bucket cap recommended from the gradients (and the
    curve); ``autocast``: the forward runs under bf16 autocast (``precision="amp-bf16"``;
    FSDP2's mixed-precision policies cast inside the wrapped model)."""

    planned: PlannedModel
    optimizer: Any
    scheduler: Any
    curve: Any
    bucket_plan: Any
    autocast: bool
    device: Any

    def forward_precision(self) -> Any:
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)


def check_model(model: Any) -> Any:
    if not isinstance(model, torch.nn.Module):
        raise InputError("model_factory", "did not return a torch.nn.Module",
                         value=type(model).__name__, fix="return an nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise InputError("model_factory", "returned a model without trainable parameters",
                         value=type(model).__name__, fix="leave some parameters trainable")
    return model


def wrap(config: LoopConfig, model: Any, *, device: Any, world_rank: int,
         world_size: int) -> WrappedModel:
    """Measure the allreduce curve (``measure_bandwidth``, a few collectives), plan the bucket
    cap (``bucket_cap_mb`` overrides it), wrap the model and its optimizer as the strategy
    says, and build the scheduler."""
    cfg = config
    curve = None
    if cfg.measure_bandwidth and world_size > 1:
        curve = measure_allreduce_curve(device=device)
        logger.info("rank %d: %s", world_rank, curve.describe(cfg.guard.bandwidth_peak_frac))
    bucket_plan = plan_bucket_cap(model, cfg.guard, curve)
    cap = cfg.bucket_cap_mb if cfg.bucket_cap_mb is not None else bucket_plan.bucket_cap_mb
    if cfg.strategy in (Strategy.DDP, Strategy.ZERO1):
        logger.info("rank %d: %s%s", world_rank, bucket_plan.reason,
                    f" (overridden: bucket_cap_mb={cap} as given)"
                    if cfg.bucket_cap_mb is not None else "")
    planned = wrap_model(model, strategy=cfg.strategy, bucket_cap_mb=cap,
                         gradient_as_bucket_view=cfg.gradient_as_bucket_view, device=device,
                         precision=cfg.precision, **({} if cfg.fsdp_grad_sync == "auto"
                                                     else {"fsdp_grad_sync": cfg.fsdp_grad_sync}))
    optimizer = call_factory("optimizer_factory", cfg.optimizer_factory,
                             planned.module.parameters())
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InputError("optimizer_factory", "did not return a torch.optim.Optimizer",
                         value=type(optimizer).__name__, fix="return e.g. AdamW(params)")
    scheduler = (call_factory("scheduler_factory", cfg.scheduler_factory, optimizer)
                 if cfg.scheduler_factory is not None else None)
    return WrappedModel(planned, wrap_optimizer(planned, optimizer), scheduler, curve,
                        bucket_plan, cfg.precision == "amp-bf16", device)
