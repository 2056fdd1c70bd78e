"""Where the loop reports: checkpoints and results through Ray Train or a plain directory,
per-step gauges through Ray's metrics."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from typing import Any

from raytrain_guard.config import GuardConfig

logger = logging.getLogger("raytrain_guard.runtime.train_loop")


class RayTrainReporter:
    """Checkpoints and results through ``ray.train`` (a barrier across all workers)."""

    def latest_checkpoint_dir(self) -> contextlib.AbstractContextManager[str | None]:
        import ray.train
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return contextlib.nullcontext(None)
        return checkpoint.as_directory()

    def report(self, metrics: Mapping[str, Any], checkpoint_dir: str | None) -> None:
        import ray.train
        checkpoint = (ray.train.Checkpoint.from_directory(checkpoint_dir)
                      if checkpoint_dir is not None else None)
        ray.train.report(dict(metrics), checkpoint=checkpoint)


class DirectoryReporter:
    """Outside Ray: checkpoints go to ``root/checkpoint_<step>``; results are kept in memory."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.reports: list[dict[str, Any]] = []

    def latest_checkpoint_dir(self) -> contextlib.AbstractContextManager[str | None]:
        found = sorted((d for d in os.listdir(self.root) if d.startswith("checkpoint_")),
                       key=lambda d: int(d.split("_")[1])) if os.path.isdir(self.root) else []
        return contextlib.nullcontext(os.path.join(self.root, found[-1]) if found else None)

    def report(self, metrics: Mapping[str, Any], checkpoint_dir: str | None) -> None:
        self.reports.append(dict(metrics))
        if checkpoint_dir is not None:
            import shutil
            target = os.path.join(self.root, f"checkpoint_{metrics['step']}")
            shutil.copytree(checkpoint_dir, target, dirs_exist_ok=True)


class _NoMetrics:
    """Outside Ray, or where Ray's metrics fail: the loop records nowhere."""

    def record(self, stats: Any) -> int:
        return 0

    def record_decision(self, decision: Any) -> None:
        pass

    def record_loader(self, num_workers: int, prefetch_factor: int) -> None:
        pass


def _rank_metrics(world_rank: int, guard: GuardConfig, loader: Any) -> Any:
    """The rank's gauges (:class:`~raytrain_guard.cluster.metrics.RankMetrics`, labelled with
    Ray Train's run name and world rank, so Grafana joins them with Ray's train panels)."""
    try:
        import ray
        if not ray.is_initialized():
            return _NoMetrics()
        import ray.train

        from raytrain_guard.cluster.metrics import RankMetrics
        metrics = RankMetrics(ray.train.get_context().get_experiment_name(), world_rank,
                              watermark_frac=guard.memory_watermark_frac,
                              critical_frac=guard.memory_critical_frac)
        metrics.record_loader(loader.plan.num_workers, loader.plan.prefetch_factor)
        return metrics
    except Exception:
        logger.debug("no ray.util.metrics", exc_info=True)
        return _NoMetrics()
