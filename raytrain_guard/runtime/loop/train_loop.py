"""The shared train loop template: hand :func:`train_loop_per_worker` to a TorchTrainer.

::

    trainer = TorchTrainer(train_loop_per_worker, train_loop_config={
        "model_factory": "mypkg.models:make_model",        # () -> nn.Module
        "dataset_factory": "mypkg.data:make_dataset",      # () -> Dataset (map-style)
        "optimizer_factory": "mypkg.optim:make_optimizer", # (params) -> Optimizer
        "loss_fn": "mypkg.loss:loss_fn",                   # (model, batch) -> scalar tensor
        "micro_batch": 32, "grad_accum": 4, "epochs": 2, "strategy": "ddp"},
        scaling_config=ScalingConfig(num_workers=8, use_gpu=True))

:class:`GuardedTrainLoop` builds a worker's parts and hands them to each other. What it does
and every key: docs/train_loop.md.
"""

from __future__ import annotations

import json
import logging
import random
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from raytrain_guard.coordination.context import current_context
from raytrain_guard.coordination.control_plane import ControlPlane, shared_control_plane
from raytrain_guard.core.decisions import Action
from raytrain_guard.core.gate import attribute_across_ranks
from raytrain_guard.core.steps import StepStats
from raytrain_guard.errors import InputError
from raytrain_guard.runtime.dist.checkpoint import gather_objects
from raytrain_guard.runtime.guard.boundary import OTHER_RANK_STOP, StepBoundary
from raytrain_guard.runtime.guard.comm_timers import attach_comm_timers
from raytrain_guard.runtime.guard.cuda_card import CudaCard
from raytrain_guard.runtime.guard.fail_open import FailOpen
from raytrain_guard.runtime.guard.parts import memory_probe, rank_metrics, worker_device
from raytrain_guard.runtime.guard.step_guard import StepGuard
from raytrain_guard.runtime.guard.timing import StepTimer
from raytrain_guard.runtime.guard.watchdog import StepWatchdog
from raytrain_guard.runtime.loop.actions import LoopActions
from raytrain_guard.runtime.loop.checkpoints import (
    Checkpointer,
    DirectoryReporter,
    RayTrainReporter,
    RestartRequested,
)
from raytrain_guard.runtime.loop.config import REHEARSAL, LoopConfig, call_factory
from raytrain_guard.runtime.loop.hang import HangExit
from raytrain_guard.runtime.loop.layout import BatchLayout
from raytrain_guard.runtime.loop.model import check_model, wrap
from raytrain_guard.runtime.loop.recorder import RunRecorder
from raytrain_guard.runtime.loop.spikes import SpikeSplitter
from raytrain_guard.runtime.loop.steps import StepLoop

__all__ = ["DirectoryReporter", "GuardedTrainLoop", "LoopConfig", "RayTrainReporter",
           "RestartRequested", "train_loop_per_worker"]

logger = logging.getLogger(__name__)


def train_loop_per_worker(config: dict) -> dict[str, Any]:
    """The TorchTrainer entry point: run the guarded loop of ``config`` on this worker."""
    return GuardedTrainLoop(LoopConfig.from_dict(config)).run()


class GuardedTrainLoop:
    """One worker's guarded training run. ``reporter``: :class:`RayTrainReporter` inside Ray
    Train (the default there), else a :class:`DirectoryReporter`."""

    def __init__(self, config: LoopConfig, *, reporter: Any = None, context: Any = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = config
        self.ctx = context or current_context()
        self.reporter = reporter or (RayTrainReporter() if self.ctx.source == "ray"
                                     else DirectoryReporter(tempfile.mkdtemp(prefix="rtg-")))
        self._clock = clock
        self.rank, self.world_size = self.ctx.world_rank, self.ctx.world_size
        self.recorder = RunRecorder(trace_dir=config.trace_dir, audit_dir=config.audit_dir,
                                    world_rank=self.rank, sample_id_key=config.sample_id_key)
        self.rehearsal: Any = None
        self.steps: StepLoop | None = None
        self.results: dict[str, Any] = {}

    def _build(self) -> None:
        """What needs no collective, so that bad input fails alike on every rank before any:
        the rehearsal, the dataset and its batch layout, the model."""
        cfg = self.config
        self.device = device = worker_device(self.ctx)
        _seed_everything(cfg.seed)                  # same initial weights on every rank
        dataset = call_factory("dataset_factory", cfg.dataset_factory)
        if cfg.rehearsal is not None:
            self.rehearsal = call_factory("rehearsal", cfg.rehearsal, cfg,
                                          world_rank=self.rank, device=device)
            dataset = self.rehearsal.wrap_dataset(dataset)
        if cfg.device_memory_bytes is not None:
            if device.type == "cuda":
                total = torch.cuda.get_device_properties(device).total_memory
                torch.cuda.set_per_process_memory_fraction(
                    min(1.0, cfg.device_memory_bytes / total), device)
            elif getattr(self.rehearsal, "card", None) is None:
                raise InputError("device_memory_bytes", "caps a CUDA card; on a CPU a "
                                 "rehearsal simulates the card", value=cfg.device_memory_bytes,
                                 fix=f"set rehearsal={REHEARSAL!r}, or leave it out")
        self.layout = BatchLayout(cfg, dataset, world_rank=self.rank,
                                  world_size=self.world_size, device=device)
        self._model = check_model(call_factory("model_factory", cfg.model_factory))
        if self.rehearsal is not None:
            self.rehearsal.attach(self._model)

    def _build_guard(self) -> None:
        """The card that prices micro-batches, the step guard with its probe and timer (and
        the communication timer on the wrapped model), the rank's gauges."""
        cfg, rehearsal, planned = self.config, self.rehearsal, self.model.planned
        self.card = getattr(rehearsal, "card", None)
        if self.card is None and self.device.type == "cuda" and cfg.split_spikes:
            self.card = CudaCard(self.device, cfg.device_memory_bytes)
        probe = rehearsal.probe() if rehearsal is not None else None
        timer = StepTimer.for_worker(device=self.device, world_rank=self.rank,
                                     local_rank=self.ctx.local_rank,
                                     local_world_size=self.ctx.local_world_size)
        self.guard = StepGuard(cfg.guard, timer=timer, world_rank=self.rank, act=cfg.act,
                               probe=probe or memory_probe(self.device, self.ctx, cfg.guard),
                               fault_injector=getattr(rehearsal, "marks", None))
        attach_comm_timers(planned.module, timer, world_rank=self.rank,
                           hook=rehearsal.comm_hook() if rehearsal else None,
                           before_reduce_scatter=rehearsal.delay_comm if rehearsal else None)
        self.metrics = rank_metrics(self.rank, cfg.guard)
        if self.metrics is not None:
            plan = self.layout.loader.plan
            self.metrics.record_loader(plan.num_workers, plan.prefetch_factor)

    def _connect(self) -> None:
        """The control plane (every rank at the same point: it may create the gloo side
        group), the checkpoints and the resume, the step boundary and the steps."""
        cfg, rank, recorder, guard = self.config, self.rank, self.recorder, self.guard
        self.control = shared_control_plane() if self.world_size > 1 else ControlPlane(1)
        self.checkpointer = Checkpointer(self.reporter, model=self.model, layout=self.layout,
                                         guard=guard, world_rank=rank)
        resumed = self.checkpointer.resume()
        guard.attach_loader(self.layout.loader)  # it opens the steps and times their data
        actions = LoopActions(self.layout, guard=guard, control=self.control,
                              metrics=self.metrics, log=recorder)
        fail_open = FailOpen(logger, lambda: f"rank {rank} step {self.boundary.step}")
        self.boundary = StepBoundary(
            cfg.guard, world_rank=rank, node_id=self.ctx.node_id, step_guard=guard,
            control=self.control, source=cfg.decision_source, metrics=self.metrics,
            actions=actions, fail_open=fail_open, act=cfg.act, stop_every=cfg.every_stop_check,
            log=recorder, on_stats=self._trace_stats if recorder.trace is not None else None)
        self.boundary.step = resumed or 0
        splitter = SpikeSplitter(cfg, self.card, world_rank=rank, world_size=self.world_size,
                                 control=self.control, timer=guard.timer, log=recorder) \
            if self.card is not None and cfg.split_spikes else None
        try:
            watchdog = StepWatchdog(
                floor_s=cfg.guard.hang_floor_s, step_multiple=cfg.guard.hang_step_multiple,
                on_hang=HangExit(recorder, source=cfg.decision_source, act=cfg.act),
                world_rank=rank, node_id=self.ctx.node_id or "", world_size=self.world_size)
        except Exception:
            logger.warning("rank %d: no hang watchdog", rank, exc_info=True)
            watchdog = None
        self.steps = StepLoop(cfg, layout=self.layout, model=self.model, guard=guard,
                              boundary=self.boundary, checkpointer=self.checkpointer,
                              recorder=recorder, card=self.card, splitter=splitter,
                              rehearsal=self.rehearsal, watchdog=watchdog)
        self.steps.step, self.steps.resumed_from = resumed or 0, resumed

    def run(self) -> dict[str, Any]:
        start = self._clock()
        recorder = self.recorder
        recorder.open()
        try:
            self._build()
            self.model = wrap(self.config, self._model, device=self.device,
                              world_rank=self.rank, world_size=self.world_size)
            if self.rehearsal is not None:
                self.rehearsal.measure(self.model.planned.module, self.model.optimizer)
            self._build_guard()
            self._connect()
            steps, layout = self.steps, self.layout
            recorder.event("start", resumed_from=steps.resumed_from, world_size=self.world_size,
                           micro_batch=layout.micro_batch, grad_accum=layout.grad_accum,
                           total_steps=layout.total_steps, node_id=self.ctx.node_id)
            bind = getattr(self.config.decision_source, "bind_setup", None)
            if callable(bind):
                try:
                    bind(self.setup)
                except Exception:
                    logger.warning("rank %d: decision source did not take the setup",
                                   self.rank, exc_info=True)
            try:
                steps.run()
            finally:
                for part in (steps.watchdog, self.rehearsal, self.guard.timer, layout.loader):
                    if part is not None:
                        part.close()
            if steps.restart_reason is not None:
                self.checkpointer.save(steps, {"kind": "restart"})
                # Ray's controller takes one report per poll: this one returns once it took
                # the checkpoint's, so the restarted group resumes from it, not an older one
                self.reporter.report({"step": steps.step, "kind": "restart_flush"}, None)
                raise RestartRequested(f"rank {self.rank}: checkpointed at step {steps.step} "
                                       f"and restarting the group: {steps.restart_reason}")
            self.results = self._finish(self._clock() - start)
            recorder.event("end", step=steps.step)
            return self.results
        except BaseException as exc:
            recorder.event("error", error=type(exc).__name__, message=str(exc)[:400],
                           step=self.steps.step if self.steps is not None else 0,
                           **_memory_asked(exc))
            raise
        finally:
            recorder.close()

    def _trace_stats(self, stats: list[StepStats]) -> None:
        self.recorder.steps(stats, micro_batch=self.layout.micro_batch,
                            grad_accum=self.layout.grad_accum)

    def setup(self) -> dict[str, Any]:
        """The batch layout and memory this rank runs with now, what the coordinator prices
        its actions with (:mod:`raytrain_guard.core.effects`); read when the client reports.
        CUDA's counters are the allocator's: no synchronization."""
        layout, device = self.layout, self.device
        plan = layout.loader.plan
        setup = {"micro_batch": layout.micro_batch, "grad_accum": layout.grad_accum,
                 "prefetch_factor": plan.prefetch_factor or None, "device": device.type,
                 "num_workers": plan.num_workers, "batch_bytes": layout.loader.probe_batch_bytes}
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            setup.update(device_index=index,
                         allocated_bytes=torch.cuda.memory_allocated(index),
                         reserved_bytes=torch.cuda.memory_reserved(index),
                         device_total_bytes=torch.cuda.get_device_properties(index).total_memory)
        elif self.card is not None:   # a simulated card: no cache, nothing to release
            used = self.card.base_bytes
            setup.update(device="simulated", allocated_bytes=used, reserved_bytes=used,
                         device_total_bytes=self.card.capacity_bytes)
        return setup

    def _finish(self, wall_s: float) -> dict[str, Any]:
        """The run's results from every rank's figures (a gather), with the last checkpoint."""
        rank, steps, layout, model = self.rank, self.steps, self.layout, self.model
        own = {"world_rank": rank, "decisions": self.recorder.decisions,
               "window": [s.to_dict() for s in self.guard.gate.window],   # warm-up left out
               "loader": layout.loader.stats(),
               "faults_applied": self.rehearsal.num_applied if self.rehearsal else 0,
               "batch_changes": [dict(c, world_rank=rank) for c in layout.changes]}
        per_rank = gather_objects(own)
        windows = [[StepStats.from_dict(s) for s in r["window"]] for r in per_rank]
        attribution = [{"world_rank": a.world_rank, "role": a.role.value, "reason": a.reason,
                        "median_step_s": a.total_s, "data_wait_s": a.data_wait_s,
                        "compute_s": a.compute_s, "comm_wait_s": a.comm_wait_s}
                       for a in attribute_across_ranks(
                           windows, straggler_frac=self.config.guard.straggler_frac)]
        for a in attribution:
            if a["role"] != "normal":
                logger.warning("rank %d: %s", rank, a["reason"])
        decisions = [d for r in per_rank for d in r["decisions"]]
        stop_reason = self.boundary.stop_reason
        stops = [d for d in decisions if d["action"] == Action.CHECKPOINT_AND_STOP.value]
        if stop_reason == OTHER_RANK_STOP and stops:
            stop_reason = f"rank {stops[0]['world_rank']}: {stops[0]['reason']}"
        curve = model.curve
        results = {
            "step": steps.step, "total_steps": layout.total_steps,
            "stopped_early": stop_reason is not None, "stop_reason": stop_reason,
            "resumed_from": steps.resumed_from, "world_size": self.world_size,
            "wall_s": round(wall_s, 3), "bucket_plan": model.bucket_plan.to_dict(),
            "bandwidth": curve.to_dict(self.config.guard.bandwidth_peak_frac) if curve else None,
            "model": model.planned.describe(), "bucket_layout": model.planned.bucket_layout(),
            "attribution": attribution, "decisions": decisions,
            "loader": [r["loader"] for r in per_rank],
            "faults_applied": [r["faults_applied"] for r in per_rank],
            "micro_batch": layout.micro_batch, "grad_accum": layout.grad_accum,
            "batch_changes": [c for r in per_rank for c in r["batch_changes"]],
            "control_rounds": self.control.num_rounds,    # stop/lockstep allreduces, this rank
        }
        # Ray keeps rank 0's metrics (Result.metrics) and logs every rank's report: the results
        # (the same on every rank, some KB) ride on rank 0's only
        final: dict[str, Any] = {"kind": "final"}
        if rank == 0:
            final["results"] = json.dumps(results, default=str)
        self.checkpointer.save(steps, final)
        return results


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
        numpy.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass


def _memory_asked(exc: BaseException) -> dict[str, int]:
    """An out-of-memory error's ``needed_bytes`` (what the card would have held had the
    allocation fitted) and ``capacity_bytes``, where it carries them (the simulated card's
    does); else nothing."""
    return {k: v for k in ("needed_bytes", "capacity_bytes")
            if isinstance(v := getattr(exc, k, None), int)}
