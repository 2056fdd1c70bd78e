"""What a worker's guard is built on, the train loop's and the drop-in's, each read once at
set-up and failing open: the device, the memory probe and the rank's gauges."""

from __future__ import annotations

import logging
from typing import Any

import torch

from raytrain_guard.config import GuardConfig
from raytrain_guard.runtime.guard.metrics import RankMetrics
from raytrain_guard.runtime.guard.probes import CudaMemoryProbe, ProcessMemoryProbe

logger = logging.getLogger(__name__)


def worker_device(ctx: Any) -> Any:
    """Ray Train's device for this worker, else the current CUDA device, else the CPU."""
    if ctx.source == "ray":
        from ray.train.torch import get_device
        return torch.device(get_device())
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def memory_probe(device: Any, ctx: Any, config: GuardConfig) -> Any:
    """The card's memory on CUDA, else this process's share of host memory (None: no probe)."""
    try:
        if device.type == "cuda":
            return CudaMemoryProbe(device, config=config)
        return ProcessMemoryProbe(config, local_world_size=max(1, ctx.local_world_size))
    except Exception:
        logger.warning("rank %d: no memory probe", ctx.world_rank, exc_info=True)
        return None


def rank_metrics(world_rank: int, config: GuardConfig, *, run_name: str | None = None,
                 run_id: str | None = None) -> Any:
    """The rank's gauges on Ray's metrics, labelled with ``run_name`` (default: Ray Train's)
    and the world rank (None: Ray not initialized, or no metrics)."""
    try:
        import ray
        if not ray.is_initialized():
            return None
        return RankMetrics(run_name or _run_name(run_id), world_rank,
                           watermark_frac=config.memory_watermark_frac,
                           critical_frac=config.memory_critical_frac)
    except Exception:
        logger.debug("no ray.util.metrics", exc_info=True)
        return None


def _run_name(run_id: str | None) -> str:
    try:
        import ray.train
        return ray.train.get_context().get_experiment_name()
    except Exception:  # noqa: BLE001 - outside Ray Train
        return run_id or "local"
