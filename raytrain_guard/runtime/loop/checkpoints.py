"""Checkpoints of the shared train loop: each rank writes its shard, and a resume on any world
size reads the parts it holds now; they and the results are reported through Ray Train, or to a
directory."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

from raytrain_guard.errors import GuardError
from raytrain_guard.runtime.dist.checkpoint import (
    META_FILE,
    is_complete,
    load_sharded,
    save_sharded,
)

logger = logging.getLogger(__name__)


class RestartRequested(GuardError):
    """Raised on every rank after a guard stop with ``restart_after_stop``: the checkpoint is
    written, and Ray's FailureConfig restarts the group from it in fresh processes."""


class Checkpointer:
    """Sharded checkpoints of ``model`` (a :class:`~raytrain_guard.runtime.loop.model.
    WrappedModel`) with the loader's position, the guard's state and the batch ``layout``,
    reported through ``reporter``."""

    def __init__(self, reporter: Any, *, model: Any, layout: Any, guard: Any,
                 world_rank: int) -> None:
        self.reporter = reporter
        self.model, self.layout, self.guard = model, layout, guard
        self.rank = world_rank

    def resume(self) -> int | None:
        """Load the latest checkpoint, if any (a collective: every rank reads the parts of the
        shards it holds now, resharded to this world); returns its step."""
        model, layout = self.model, self.layout
        with self.reporter.latest_checkpoint_dir() as directory:
            if directory is None:
                return None
            state = load_sharded(directory, model.planned, model.optimizer, world_rank=self.rank)
        extra = state.get("extra", {})
        layout.resume(extra.get("batch"), int(state.get("world_size", layout.world_size)))
        layout.loader.load_state_dict(state["loader"])
        if model.scheduler is not None and extra.get("scheduler") is not None:
            model.scheduler.load_state_dict(extra["scheduler"])
        guards = state.get("guard") or []
        if self.rank < len(guards) and guards[self.rank]:
            try:
                self.guard.load_state_dict(guards[self.rank])
            except Exception:
                logger.warning("rank %d: guard state not restored", self.rank, exc_info=True)
        step = int(state["step"])
        self.guard.note_pause(step)     # fresh processes: their first steps settle
        logger.info("rank %d: resumed at step %d, loader %s", self.rank, step,
                    layout.loader.state_dict())
        return step

    def save(self, steps: Any, metrics: Mapping[str, Any]) -> None:
        """A checkpoint after ``steps.step`` steps (a collective), reported with the step, the
        loss averaged over ranks (it rides on the checkpoint's gather), the gradient norm, the
        learning rate and ``metrics``."""
        model, layout = self.model, self.layout
        scheduler = model.scheduler
        with tempfile.TemporaryDirectory(prefix="rtg-ckpt-") as tmp:
            meta = save_sharded(
                tmp, model.planned, model.optimizer, step=steps.step,
                loader_state=layout.loader.state_dict(), guard_state=self.guard.state_dict(),
                extra={"batch": {"micro_batch": layout.micro_batch,
                                 "grad_accum": layout.grad_accum, "changes": layout.changes},
                       "scheduler": scheduler.state_dict() if scheduler is not None else None},
                loss=float(steps.last_loss) if steps.last_loss is not None else None)
            losses = [x for x in meta.get("losses", ()) if x is not None]
            report = {"step": steps.step, "loss": sum(losses) / len(losses) if losses else None,
                      **metrics}
            norm = steps.grad_norm
            if norm is not None:
                report["grad_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor")
                                            else norm)
            if scheduler is not None:
                report["lr"] = float(scheduler.get_last_lr()[0])
            self.reporter.report(report, tmp)
        self.guard.note_pause()
        logger.info("rank %d: checkpoint at step %d", self.rank, steps.step)


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
    """Outside Ray: checkpoints go to ``root/checkpoint_<step>`` (:func:`_copy_into_place`);
    results are kept in memory. Resume takes the newest complete checkpoint
    (:func:`~raytrain_guard.runtime.dist.checkpoint.is_complete`), skipping torn ones with a
    warning."""

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
    file: under a temporary name in ``target``'s folder, then renamed; when ``target`` holds
    another rank's part already, each file is moved in with ``os.replace``, the meta file last."""
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
