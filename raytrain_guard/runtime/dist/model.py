"""Planned DDP / FSDP: the user's module wrapped the way the plan says (torch is imported by the
functions that wrap: :func:`parse_strategy` also serves the driver's configs, without torch).

``ddp`` and ``zero1`` are DistributedDataParallel with the plan's ``bucket_cap_mb`` (``zero1``
also shards the optimizer state); ``fsdp-grad-op`` and ``fsdp-full`` are FSDP2 ``fully_shard``
over the planner's units, on CPU with gloo too. What each mode does: docs/train_loop.md ("The
model wrapping").
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from raytrain_guard.coordination.context import current_context
from raytrain_guard.errors import InputError
from raytrain_guard.log import warn_once
from raytrain_guard.planner.fsdp_units import wrap_units
from raytrain_guard.planner.memory_model import DEFAULT_GRAD_SYNC, GradSync, Strategy

logger = logging.getLogger(__name__)


#: How the module ended up wrapped.
KIND_DDP = "ddp"
KIND_FSDP2 = "fsdp2"
KIND_LOCAL = "local"     # world size 1 or no process group: no wrapper


def parse_strategy(value: Any, *, field_name: str = "strategy") -> Strategy:
    """``"ddp"``, ``"zero1"``, ``"fsdp-grad-op"``, ``"fsdp-full"`` (or a Strategy) -> Strategy."""
    if isinstance(value, Strategy):
        return value
    aliases = {"fsdp": Strategy.FSDP_FULL, "fsdp2": Strategy.FSDP_FULL}
    text = str(value).strip().lower().replace("_", "-")
    if text in aliases:
        return aliases[text]
    try:
        return Strategy(text)
    except ValueError:
        raise InputError(field_name, "unknown parallel strategy", value=value,
                         fix="use one of " + ", ".join(s.value for s in Strategy)) from None


@dataclass
class PlannedModel:
    """The wrapped module, how it was wrapped, and the settings really applied.

    Call :attr:`module` for forward; :attr:`inner` is the user's module (DDP's ``.module``, or
    the FSDP2 module itself, which FSDP2 shards in place).
    """

    module: Any
    inner: Any
    strategy: Strategy
    kind: str
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = False
    applied: dict[str, Any] = field(default_factory=dict)
    fsdp_grad_sync: GradSync = DEFAULT_GRAD_SYNC

    @contextlib.contextmanager
    def grad_sync(self, enabled: bool) -> Iterator[None]:
        """Within this block, backward synchronizes gradients only if ``enabled``.

        Use ``grad_sync(False)`` for all but the last micro-batch of an accumulation window.
        Under FSDP2 with ``fsdp_grad_sync`` ``every_micro_batch`` nothing is skipped: every
        backward reduce-scatters, so the accumulated gradients stay sharded.
        """
        if enabled or self.kind == KIND_LOCAL or (
                self.kind == KIND_FSDP2 and self.fsdp_grad_sync is GradSync.EVERY_MICRO_BATCH):
            yield
        elif self.kind == KIND_DDP:
            with self.module.no_sync():
                yield
        else:
            self.module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.module.set_requires_gradient_sync(True)

    def bucket_layout(self) -> dict[str, Any]:
        """DDP's bucket settings as the reducer holds them (empty unless DDP): the cap and,
        from DDP's private logging data, the bytes of each bucket as last built (left out,
        warned once, where that data is missing or in another shape)."""
        if self.kind != KIND_DDP:
            return {}
        layout: dict[str, Any] = {
            "bucket_cap_bytes": int(self.module.bucket_bytes_cap),
            "gradient_as_bucket_view": bool(getattr(self.module, "gradient_as_bucket_view",
                                                    self.gradient_as_bucket_view))}
        try:
            return {**layout, **_bucket_sizes(self.module._get_ddp_logging_data())}
        except Exception as exc:  # noqa: BLE001 - a private API missing or changed: the cap only
            warn_once(logger, "ddp_logging_data", "DistributedDataParallel._get_ddp_logging_data "
                      f"is missing, failed or answered in another shape ({exc!r}): the bucket "
                      "layout holds the cap only")
            return layout

    def describe(self) -> dict[str, Any]:
        return {"strategy": self.strategy.value, "kind": self.kind,
                "bucket_cap_mb": self.bucket_cap_mb,
                "fsdp_grad_sync": self.fsdp_grad_sync.value,
                "gradient_as_bucket_view": self.gradient_as_bucket_view, **self.applied}


def _bucket_sizes(data: Any) -> dict[str, Any]:
    """The buckets in DDP's logging data (a mapping; ``bucket_sizes`` and, once rebuilt,
    ``rebuilt_bucket_sizes`` as comma-separated bytes); raises on any other shape."""
    if not isinstance(data, Mapping):
        raise TypeError(f"logging data is a {type(data).__name__}, not a mapping")
    text = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    if not isinstance(text, str):
        raise TypeError(f"bucket sizes are a {type(text).__name__}, not text")
    sizes = [int(s) for s in text.replace(" ", "").split(",") if s]
    return {"bucket_sizes": sizes, "num_buckets": len(sizes),
            "has_rebuilt_buckets": bool(data.get("has_rebuilt_buckets", 0))}


def wrap_model(model: Any, *, strategy: Strategy | str = Strategy.DDP,
               bucket_cap_mb: float | None = None, gradient_as_bucket_view: bool = False,
               device: Any = None, use_ray: bool | None = None,
               precision: str = "fp32",
               fsdp_grad_sync: GradSync | str = DEFAULT_GRAD_SYNC) -> PlannedModel:
    """Wrap ``model`` for data-parallel training as planned.

    ``use_ray``: go through ``ray.train.torch.prepare_model`` (default: when running inside a
    Ray Train worker). Outside Ray the process group must already be initialized (or the world
    size is 1, and the module is only moved to ``device``). ``precision`` (the planner's):
    under FSDP2 ``bf16-master`` is ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)`` over fp32 shards and ``bf16`` is bf16 throughout; ``fp32`` and
    ``amp-bf16`` (the loop's autocast) leave the module's dtypes alone. ``fsdp_grad_sync``: the
    plan's (``Plan.fsdp_grad_sync``), ``every_micro_batch`` or ``last_micro_batch`` (default,
    the memory model's); :meth:`PlannedModel.grad_sync` applies it under FSDP2 only.
    """
    import torch
    import torch.distributed as dist

    strategy = parse_strategy(strategy)
    sync = parse_grad_sync(fsdp_grad_sync)
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        raise InputError("bucket_cap_mb", "must be > 0", value=bucket_cap_mb,
                         fix="pass the planner's bucket_cap_mb, or None for DDP's default 25")
    if not isinstance(model, torch.nn.Module):
        raise InputError("model", "is not a torch.nn.Module", value=type(model).__name__,
                         fix="make model_factory() return an nn.Module")
    if use_ray is None:
        use_ray = current_context().source == "ray"
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if device is None:
        device = _default_device(use_ray)
    device = torch.device(device)

    if world_size == 1:
        model = model.to(device)
        return PlannedModel(model, model, strategy, KIND_LOCAL, bucket_cap_mb,
                            gradient_as_bucket_view, {"world_size": 1}, sync)

    if strategy in (Strategy.FSDP_FULL, Strategy.FSDP_GRAD_OP):
        planned = _wrap_fsdp2(model, strategy, device, use_ray, world_size, precision)
        planned.fsdp_grad_sync = sync
        logger.info("FSDP2 gradient sync under accumulation: %s", sync.value)
        return planned

    kwargs: dict[str, Any] = {"gradient_as_bucket_view": bool(gradient_as_bucket_view)}
    if bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = float(bucket_cap_mb)
    if use_ray:
        from ray.train.torch import prepare_model
        wrapped = prepare_model(model, parallel_strategy="ddp", parallel_strategy_kwargs=kwargs)
    else:
        model = model.to(device)
        ids = [device.index] if device.type == "cuda" else None
        wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, **kwargs)
    planned = PlannedModel(wrapped, wrapped.module, strategy, KIND_DDP, bucket_cap_mb,
                           bool(gradient_as_bucket_view),
                           {"world_size": world_size,
                            "bucket_cap_bytes": int(wrapped.bucket_bytes_cap)}, sync)
    logger.info("wrapped model in DDP (%s): bucket_cap_mb=%s gradient_as_bucket_view=%s",
                strategy.value, bucket_cap_mb if bucket_cap_mb is not None else "25 (default)",
                gradient_as_bucket_view)
    return planned


def parse_grad_sync(value: Any, *, field_name: str = "fsdp_grad_sync") -> GradSync:
    """``"every_micro_batch"`` / ``"last_micro_batch"`` (or a GradSync) -> GradSync. ``"auto"``
    is the planner's to resolve (``Plan.fsdp_grad_sync``), not the wrapper's."""
    if isinstance(value, GradSync):
        return value
    text = str(value).strip().lower().replace("-", "_")
    try:
        return GradSync(text)
    except ValueError:
        fix = "pass the plan's choice (Plan.fsdp_grad_sync)" if text == "auto" else \
            "use every_micro_batch or last_micro_batch"
        raise InputError(field_name, "is not a gradient sync mode the wrapper applies",
                         value=value, fix=fix) from None


def _wrap_fsdp2(model: Any, strategy: Strategy, device: Any, use_ray: bool,
                world_size: int, precision: str = "fp32") -> PlannedModel:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if use_ray:
        from ray.train.torch import prepare_model
        model = prepare_model(model, parallel_strategy=None)
    else:
        model = model.to(device)
    mesh = init_device_mesh(device.type, (world_size,))
    reshard = strategy == Strategy.FSDP_FULL
    policy = {"bf16-master": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                  reduce_dtype=torch.float32),
              "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                           reduce_dtype=torch.bfloat16)}.get(precision)
    if precision == "bf16":
        model = model.to(torch.bfloat16)       # shards, gradients and optimizer state in bf16
    extra = {"mp_policy": policy} if policy is not None else {}
    units = wrap_units(model)
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, **extra)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **extra)
    logger.info("sharded model with FSDP2 (%s): %d units + root, reshard_after_forward=%s",
                strategy.value, len(units), reshard)
    return PlannedModel(model, model, strategy, KIND_FSDP2, None, False,
                        {"world_size": world_size, "fsdp_units": len(units) + 1,
                         "reshard_after_forward": reshard})


def wrap_optimizer(planned: PlannedModel, optimizer: Any) -> Any:
    """Under ``zero1``, re-create ``optimizer`` as a ZeroRedundancyOptimizer (state sharded).

    The user's optimizer class, its defaults and every parameter group with its own settings
    (lr, weight decay ...) are kept; other strategies get the optimizer back unchanged.
    """
    if planned.strategy != Strategy.ZERO1 or planned.kind != KIND_DDP:
        return optimizer
    from torch.distributed.optim import ZeroRedundancyOptimizer

    # defaults as constructor arguments (some group keys, e.g. AdamW's decoupled_weight_decay,
    # are not); each group goes in whole, with its own settings
    accepted = inspect.signature(type(optimizer)).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [dict(group, params=list(group["params"])) for group in optimizer.param_groups]
    zero = ZeroRedundancyOptimizer(groups[:1], optimizer_class=type(optimizer), **defaults)
    for group in groups[1:]:
        zero.add_param_group(group)
    return zero


def _default_device(use_ray: bool) -> Any:
    import torch
    if use_ray:
        from ray.train.torch import get_device
        return get_device()
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
