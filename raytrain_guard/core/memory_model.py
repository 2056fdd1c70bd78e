"""Per-GPU memory model of one training step (pure).

CONTRACT (filled in by the memory-model work; the planner calls :func:`estimate`):

memory = params + gradients + optimizer states + activations + communication buffers
         + runtime reserve (CUDA context + allocator fragmentation).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.model_stats import ActivationProfile, ModelStats


class Strategy(str, enum.Enum):
    DDP = "ddp"                    # full replica of params, grads, optimizer state
    ZERO1 = "zero1"                # DDP + ZeroRedundancyOptimizer: optimizer state sharded
    FSDP_GRAD_OP = "fsdp-grad-op"  # FSDP SHARD_GRAD_OP (ZeRO-2): grads + optimizer sharded
    FSDP_FULL = "fsdp-full"        # FSDP FULL_SHARD (ZeRO-3): params + grads + optimizer sharded


class Precision(str, enum.Enum):
    FP32 = "fp32"
    AMP_BF16 = "amp-bf16"          # autocast: fp32 params/grads, bf16 activations
    BF16_MASTER = "bf16-master"    # bf16 params/grads, fp32 master weights with optimizer state
    BF16 = "bf16"                  # everything bf16


class OptimizerKind(str, enum.Enum):
    SGD = "sgd"
    SGD_MOMENTUM = "sgd-momentum"
    ADAM = "adam"
    ADAMW = "adamw"


@dataclass(frozen=True, kw_only=True)
class TrainingSetup:
    """How the model is trained: everything besides the model that changes memory."""

    strategy: Strategy = Strategy.DDP
    precision: Precision = Precision.FP32
    optimizer: OptimizerKind = OptimizerKind.ADAMW
    micro_batch: int = 1
    grad_accum: int = 1
    world_size: int = 1                     # data-parallel ranks in total
    bucket_cap_mb: float = 25.0             # DDP's default cap
    gradient_as_bucket_view: bool = False   # DDP's default


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU bytes of one steady-state step.

    ``peak_bytes`` is the tensor bytes at the peak (not the plain sum of the categories:
    ``breakdown`` holds each category's bytes *at the peak moment*, plus ``reserve``);
    ``total_bytes = peak_bytes + breakdown["reserve"]``. ``peak_phase`` says when the peak
    happens ("backward", "optimizer", "forward").
    """

    peak_bytes: int
    total_bytes: int
    breakdown: Mapping[str, int]    # params, grads, optimizer, activations, comm, reserve
    peak_phase: str
    notes: tuple[str, ...] = field(default_factory=tuple)


def estimate(model: ModelStats, activations: ActivationProfile, setup: TrainingSetup,
             config: GuardConfig = GuardConfig()) -> MemoryEstimate:
    """The per-GPU memory of one steady-state training step."""
    raise NotImplementedError("memory model not written yet")
