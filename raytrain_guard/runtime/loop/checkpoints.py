"""Checkpoints, resume and the final results of the shared train loop."""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Mapping
from typing import Any

from raytrain_guard.core.decisions import Action
from raytrain_guard.core.steps import StepStats
from raytrain_guard.errors import GuardError
from raytrain_guard.runtime.loop.decisions import _OTHER_RANK_STOP

logger = logging.getLogger("raytrain_guard.runtime.train_loop")



class RestartRequested(GuardError):
    """Raised on every rank after a guard stop with ``restart_after_stop``: the checkpoint is
    written, and Ray's FailureConfig restarts the group from it in fresh processes."""


class CheckpointsMixin:
    """Sharded checkpoints every ``checkpoint_every_steps`` (each rank its part), a resume on any
    world size, and the run's results with the last checkpoint."""

    def _resume(self) -> None:
        from raytrain_guard.runtime.checkpoint import load_sharded

        with self.reporter.latest_checkpoint_dir() as directory:
            if directory is None:
                self.resumed_from = None
                return
            # every rank reads the parts of the shards it holds now (resharded to this world)
            state = load_sharded(directory, self.planned, self.optimizer, world_rank=self.rank)
        extra = state.get("extra", {})
        self._resume_batch_layout(extra.get("batch"), int(state.get("world_size",
                                                                     self.world_size)))
        self.loader.load_state_dict(state["loader"])
        if self.scheduler is not None and extra.get("scheduler") is not None:
            self.scheduler.load_state_dict(extra["scheduler"])
        guards = state.get("guard") or []
        if self.rank < len(guards) and guards[self.rank]:
            try:
                self.guard.load_state_dict(guards[self.rank])
            except Exception:
                logger.warning("rank %d: guard state not restored", self.rank, exc_info=True)
        self.step = int(state["step"])
        self.resumed_from = self.step
        self.guard.note_pause(self.step)     # fresh processes: their first steps settle
        logger.info("rank %d: resumed at step %d, loader %s", self.rank, self.step,
                    self.loader.state_dict())

    def _checkpoint(self, metrics: Mapping[str, Any]) -> None:
        """Every rank writes its shard (a collective: :func:`~raytrain_guard.runtime.checkpoint.
        save_sharded`) into a directory of its own and reports it; Ray Train merges the ranks'
        directories of one report into one checkpoint. No rank gathers the whole model."""
        from raytrain_guard.runtime.checkpoint import save_sharded

        with tempfile.TemporaryDirectory(prefix="rtg-ckpt-") as tmp:
            meta = save_sharded(
                tmp, self.planned, self.optimizer, step=self.step,
                loader_state=self.loader.state_dict(), guard_state=self.guard.state_dict(),
                extra={"batch": {"micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
                                 "changes": self.batch_changes},
                       "scheduler": self.scheduler.state_dict() if self.scheduler is not None
                       else None},
                loss=float(self._last_loss) if self._last_loss is not None else None)
            self.reporter.report(self._report_metrics(meta, metrics), tmp)
        self.guard.note_pause()
        logger.info("rank %d: checkpoint at step %d", self.rank, self.step)

    def _report_metrics(self, meta: Mapping[str, Any], metrics: Mapping[str, Any]
                        ) -> dict[str, Any]:
        """The step, the loss averaged over ranks (it rode on the checkpoint's gather), the
        gradient norm and learning rate, and ``metrics``."""
        losses = [x for x in meta.get("losses", ()) if x is not None]
        loss = sum(losses) / len(losses) if losses else None
        report = {"step": self.step, "loss": loss, **metrics}
        if self._grad_norm is not None:
            report["grad_norm"] = float(self._grad_norm.full_tensor()
                                        if hasattr(self._grad_norm, "full_tensor")
                                        else self._grad_norm)
        if self.scheduler is not None:
            report["lr"] = float(self.scheduler.get_last_lr()[0])
        return report

    def _finish(self, wall_s: float) -> dict[str, Any]:
        """Final figures; rank 0 names stragglers across ranks; a last checkpoint + report."""
        from raytrain_guard.core.gate import attribute_across_ranks
        from raytrain_guard.runtime.checkpoint import gather_objects

        own = {"world_rank": self.rank,
               "window": [s.to_dict() for s in self.guard.gate.window],   # warm-up left out
               "decisions": self.decisions, "loader": self.loader.stats(),
               "faults_applied": getattr(self.faults, "num_delays", 0),
               "batch_changes": [dict(c, world_rank=self.rank) for c in self.batch_changes]}
        per_rank = gather_objects(own)
        windows = [[StepStats.from_dict(s) for s in r["window"]] for r in per_rank]
        attribution = [{"world_rank": a.world_rank, "role": a.role.value, "reason": a.reason,
                        "median_step_s": a.total_s, "data_wait_s": a.data_wait_s,
                        "compute_s": a.compute_s, "comm_wait_s": a.comm_wait_s}
                       for a in attribute_across_ranks(
                           windows, straggler_frac=self.config.guard.straggler_frac)]
        stops = [d for r in per_rank for d in r["decisions"]
                 if d["action"] == Action.CHECKPOINT_AND_STOP.value]
        if self.stop_reason == _OTHER_RANK_STOP and stops:
            self.stop_reason = f"rank {stops[0]['world_rank']}: {stops[0]['reason']}"
        for a in attribution:
            if a["role"] != "normal":
                logger.warning("rank %d: %s", self.rank, a["reason"])
        results = {
            "step": self.step, "total_steps": self.total_steps,
            "stopped_early": self.stop_reason is not None, "stop_reason": self.stop_reason,
            "resumed_from": self.resumed_from, "world_size": self.world_size,
            "wall_s": round(wall_s, 3),
            "bandwidth": self.curve.to_dict(self.config.guard.bandwidth_peak_frac)
            if self.curve is not None else None,
            "bucket_plan": self.bucket_plan.to_dict(), "model": self.planned.describe(),
            "bucket_layout": self.planned.bucket_layout(),
            "attribution": attribution,
            "decisions": [d for r in per_rank for d in r["decisions"]],
            "loader": [r["loader"] for r in per_rank],
            "faults_applied": [r["faults_applied"] for r in per_rank],
            "micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
            "batch_changes": [c for r in per_rank for c in r["batch_changes"]],
            "control_rounds": self.control.num_rounds,    # stop/lockstep allreduces, this rank
        }
        # Ray keeps rank 0's metrics (Result.metrics) and logs every rank's report: the results
        # (the same on every rank, some KB) ride on rank 0's only
        final = {"kind": "final"}
        if self.rank == 0:
            final["results"] = json.dumps(results, default=str)
        self._checkpoint(final)
        return results
