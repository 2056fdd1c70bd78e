"""The host memory of one node's training processes, as the planner counts it (pure).

Per GPU: the DataLoader's prefetch budget (or the planned loader's bytes, if larger) plus what
the rank stages in host memory while ``torch.distributed.checkpoint`` writes its part of a
checkpoint (:func:`checkpoint_shard`); times the GPUs of a node, within
``host_memory_watermark_frac`` of host RAM. What each strategy writes and why DCP holds it:
docs/memory_model.md ("Host memory of a node").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from raytrain_guard.config import GuardConfig
from raytrain_guard.planner.dataloader_sizing import host_budget_bytes
from raytrain_guard.planner.memory_model import (
    FSDP_SHARD_BYTES,
    MASTER_BYTES,
    PARAM_BYTES,
    STATE_BYTES,
    STATE_COPIES,
    Strategy,
    TrainingSetup,
    per_rank_numel,
    zero1_rank_numel,
)
from raytrain_guard.planner.model_stats import ModelStats
from raytrain_guard.units import format_bytes


@dataclass(frozen=True)
class CheckpointShard:
    """What the most loaded rank writes, and stages in host memory, per checkpoint."""

    bytes: int
    reason: str


def checkpoint_shard(model: ModelStats, setup: TrainingSetup) -> CheckpointShard:
    """The bytes the most loaded rank writes per checkpoint, with the sum: ``ddp`` the model
    state / N plus its largest tensor (DCP writes each replicated tensor once), ``zero1`` that
    for the replicated parameters plus its partition's optimizer state, FSDP its shards."""
    n, prec = setup.world_size, setup.precision
    trainable = model.num_trainable_params
    copies = STATE_COPIES[setup.optimizer]
    if setup.strategy in (Strategy.FSDP_FULL, Strategy.FSDP_GRAD_OP):
        param_b, opt_b = FSDP_SHARD_BYTES[prec], copies * STATE_BYTES[prec]
        params = per_rank_numel(model.num_params, n) * param_b
        optim = per_rank_numel(trainable, n) * opt_b
        buffers = per_rank_numel(model.buffer_bytes, n)
        return CheckpointShard(params + optim + buffers, (
            f"{setup.strategy.value}: its shards, parameters {format_bytes(params)} + "
            f"optimizer {format_bytes(optim)} + buffers {format_bytes(buffers)} (1/{n} each)"))
    param_b = PARAM_BYTES[prec]
    opt_b = MASTER_BYTES[prec] + copies * STATE_BYTES[prec]
    largest_numel = max(model.param_numels, default=0) if n > 1 else 0
    if setup.strategy is Strategy.ZERO1:
        replicated = model.num_params * param_b + model.buffer_bytes
        optim = zero1_rank_numel(model, n) * opt_b
        what = f"zero1: replicated parameters and buffers {format_bytes(replicated)}"
        tail = f" + its partition's optimizer state {format_bytes(optim)}"
        elem = param_b
    else:
        replicated = model.num_params * param_b + model.buffer_bytes + trainable * opt_b
        optim, tail = 0, ""
        what = f"ddp: model state {format_bytes(replicated)}"
        # the largest tensor: a parameter, one of its optimizer states or its master copy
        elem = max(param_b, STATE_BYTES[prec] if copies else 0, MASTER_BYTES[prec])
    largest = largest_numel * elem
    if n == 1:
        spread = ""
    elif largest:
        spread = f" / {n} + largest tensor {format_bytes(largest)} (DCP de-duplicates)"
    else:
        spread = f" / {n} (DCP de-duplicates; tensor sizes unknown: an even split)"
    return CheckpointShard(per_rank_numel(replicated, n) + largest + optim, what + spread + tail)


@dataclass(frozen=True)
class HostAccount:
    """Host bytes per GPU and per node, against the host watermark."""

    checkpoint_staging_bytes: int   # per GPU: what one rank stages while saving
    prefetch_bytes: int             # per GPU: the prefetch budget (or the planned loader's bytes)
    gpus_per_node: int
    node_bytes: int                 # (staging + prefetch) x gpus_per_node
    limit_bytes: int                # host_memory_watermark_frac x host RAM
    host_memory_bytes: int
    fits: bool
    arithmetic: str
    staging_reason: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def host_account(*, model: ModelStats, setup: TrainingSetup, host_memory_bytes: int,
                 gpus_per_node: int, config: GuardConfig,
                 loader_host_bytes: int | None = None) -> HostAccount:
    """Checkpoint staging and DataLoader prefetch of every GPU of a node, against
    ``host_memory_watermark_frac`` of its RAM."""
    shard = checkpoint_shard(model, setup)
    prefetch = max(host_budget_bytes(host_memory_bytes, gpus_per_node, config),
                   loader_host_bytes or 0)
    node = (shard.bytes + prefetch) * gpus_per_node
    limit = int(config.host_memory_watermark_frac * host_memory_bytes)
    arithmetic = (f"host: checkpoint staging {format_bytes(shard.bytes)} + prefetch "
                  f"{format_bytes(prefetch)} per GPU x {gpus_per_node} = "
                  f"{format_bytes(node)} {'within' if node <= limit else 'over'} "
                  f"{format_bytes(limit)} ({config.host_memory_watermark_frac:.0%} of "
                  f"{format_bytes(host_memory_bytes)}, the host watermark); staging: "
                  f"{shard.reason}")
    return HostAccount(shard.bytes, prefetch, gpus_per_node, node, limit, host_memory_bytes,
                       node <= limit, arithmetic, shard.reason)
