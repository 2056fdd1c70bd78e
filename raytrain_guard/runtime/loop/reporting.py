"""Where the loop reports: checkpoints and results through Ray Train or a plain directory,
per-step gauges through Ray's metrics."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.runtime.checkpoint import META_FILE, is_complete

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
    """Outside Ray: checkpoints go to ``root/checkpoint_<step>``; results are kept in memory.

    A checkpoint is copied under a temporary name next to its place and renamed into it; the
    ranks of one step that share ``root`` merge their parts file by file, each rank's meta file
    last. A copy cut short leaves no ``checkpoint_<step>``, or one that is not complete: resume
    takes the newest complete one (:func:`~raytrain_guard.runtime.checkpoint.is_complete`: its
    meta file and every shard file its metadata names), skipping torn ones with a warning."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.reports: list[dict[str, Any]] = []

    def latest_checkpoint_dir(self) -> contextlib.AbstractContextManager[str | None]:
        names = os.listdir(self.root) if os.path.isdir(self.root) else []
        steps = sorted(((int(m.group(1)), n) for n in names
                        if (m := _CHECKPOINT_NAME.fullmatch(n))), reverse=True)
        for _, name in steps:
            path = os.path.join(self.root, name)
            if is_complete(path):
                return contextlib.nullcontext(path)
            logger.warning("checkpoint %s is torn (no meta file, or a shard missing or short): "
                           "skipped, resuming from an older one", path)
        return contextlib.nullcontext(None)

    def report(self, metrics: Mapping[str, Any], checkpoint_dir: str | None) -> None:
        self.reports.append(dict(metrics))
        if checkpoint_dir is not None:
            _copy_into_place(checkpoint_dir,
                             os.path.join(self.root, f"checkpoint_{metrics['step']}"))


_CHECKPOINT_NAME = re.compile(r"checkpoint_(\d+)")


def _copy_into_place(source: str, target: str) -> None:
    """Copy the directory ``source`` to ``target`` so that ``target`` never holds part of one
    file: copied under a temporary name in ``target``'s folder (the same file system), then
    renamed; when ``target`` already holds another rank's part, each file is moved in with
    ``os.replace``, the meta file last."""
    parent, name = os.path.split(target)
    os.makedirs(parent or ".", exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=parent or ".")
    try:
        shutil.copytree(source, tmp, dirs_exist_ok=True)
        try:
            os.rename(tmp, target)          # atomic; fails when target holds files already
            return
        except OSError:
            pass
        for entry in sorted(os.listdir(tmp), key=lambda n: n == META_FILE):
            os.replace(os.path.join(tmp, entry), os.path.join(target, entry))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
