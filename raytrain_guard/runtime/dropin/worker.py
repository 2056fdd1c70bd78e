"""The worker side of the drop-in (:mod:`raytrain_guard.train`): one :class:`WorkerGuard` per
training process joins the planned model, the guarded loader, the phases timed from hooks, the
step boundary (:mod:`~raytrain_guard.runtime.guard.boundary`) and the summary for a loop the
user wrote. Per step: a few clock reads, one tensor hook, the step guard's fast path; no RPC,
no NVML, no device synchronization. Every part fails open. docs/drop_in.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from raytrain_guard.config import GuardConfig
from raytrain_guard.coordination.client import ClusterDecisionSource
from raytrain_guard.coordination.context import current_context
from raytrain_guard.coordination.control_plane import ControlPlane, shared_control_plane
from raytrain_guard.core.decisions import Decision
from raytrain_guard.errors import InputError
from raytrain_guard.runtime.dist.checkpoint import gather_objects
from raytrain_guard.runtime.dropin import model as dropin_model
from raytrain_guard.runtime.dropin.loader import DropInDataLoader, unguardable
from raytrain_guard.runtime.dropin.phases import PhaseHooks
from raytrain_guard.runtime.dropin.summary import combine_summaries, rank_summary, report_summary
from raytrain_guard.runtime.guard.boundary import BoundaryActions, StepBoundary
from raytrain_guard.runtime.guard.fail_open import FailOpen
from raytrain_guard.runtime.guard.parts import memory_probe, rank_metrics, worker_device
from raytrain_guard.runtime.guard.step_guard import StepGuard
from raytrain_guard.runtime.guard.timing import StepTimer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    """What the driver's :class:`raytrain_guard.train.TorchTrainer` hands every worker."""

    config: GuardConfig = field(default_factory=GuardConfig)
    """The run's one config (the plan, the actors and every worker use it)."""
    run_id: str | None = None
    """The run's id: the coordinator ``raytrain_guard:coordinator:<run id>``; None: no cluster
    layer (``prepare_*`` used under Ray's own TorchTrainer), the local gate only."""
    namespace: str | None = None
    """The Ray namespace of the run's actors."""
    run_name: str | None = None
    """Ray Train's run name (``RunConfig.name``): the ``ray_train_run_name`` label."""
    measure_bandwidth: bool = True
    """Measure the allreduce curve in ``prepare_model`` (a few collectives, once) for the
    bucket cap; False: the cap from the gradient bytes alone."""


class WorkerGuard:
    """One training process's guard for a loop the user wrote. The first ``prepare_*`` call
    builds the parts (every rank at the same point: the control plane may be a collective).
    ``context``: the worker context (default: Ray Train's, or torch.distributed's, or one
    rank)."""

    def __init__(self, settings: WorkerSettings | None = None, *, context: Any = None) -> None:
        self.settings = settings or WorkerSettings()
        self.config = self.settings.config
        self._context = context
        self.loader: DropInDataLoader | None = None
        self.loaders: list[DropInDataLoader] = []
        self.model_plan: dict[str, Any] = {}
        self.boundary: StepBoundary | None = None
        self._hooks: list[Any] = []
        self._fail_open = FailOpen(
            logger, lambda: f"rank {getattr(self, 'rank', '?')} step {self.step}")
        self._built = False
        self._closed = False
        self.metrics: Any = None
        self.source: Any = None

    # -- set-up ----------------------------------------------------------------------------------
    def build(self) -> WorkerGuard:
        """The parts: device, step guard with its timer and probe, control plane, decision
        source, gauges, step boundary, phase hooks. Idempotent."""
        if self._built:
            return self
        self._built = True
        self.ctx = self._context or current_context()
        self.rank, self.world_size = self.ctx.world_rank, self.ctx.world_size
        self.device = worker_device(self.ctx)
        timer = StepTimer.for_worker(device=self.device, world_rank=self.rank,
                                     local_rank=self.ctx.local_rank,
                                     local_world_size=self.ctx.local_world_size)
        self.step_guard = StepGuard(self.config, probe=memory_probe(self.device, self.ctx,
                                                                    self.config),
                                    timer=timer, world_rank=self.rank)
        control = shared_control_plane() if self.world_size > 1 else ControlPlane(1)
        if self.settings.run_id is not None:
            self.source = ClusterDecisionSource(self.settings.run_id,
                                                self.settings.namespace or "", self.config)
            self.source.bind_setup(self._setup)
        self.metrics = rank_metrics(self.rank, self.config, run_name=self.settings.run_name,
                                    run_id=self.settings.run_id)
        self._actions = BoundaryActions(self.rank)
        self.boundary = StepBoundary(self.config, world_rank=self.rank,
                                     node_id=self.ctx.node_id, step_guard=self.step_guard,
                                     control=control, source=self.source, metrics=self.metrics,
                                     actions=self._actions, fail_open=self._fail_open)
        self._phases = PhaseHooks(self.step_guard, end_step=self.boundary.end_step,
                                  fail_open=self._fail_open)
        logger.info("rank %d/%d: guard on %s%s", self.rank, self.world_size, self.device,
                    f", run {self.settings.run_id}" if self.settings.run_id else
                    ", no cluster layer (local gate only)")
        return self

    def _setup(self) -> dict[str, Any]:
        """This rank's batch layout for the coordinator's shrink and prefetch rules."""
        loader = self.loader
        if loader is None:
            return {}
        return {"micro_batch": loader.batch_size, "grad_accum": 1,
                "prefetch_factor": loader.plan.prefetch_factor or None}

    # -- prepare_* -------------------------------------------------------------------------------
    def prepare_model(self, model: Any, move_to_device: Any = True,
                      parallel_strategy: str | None = "ddp",
                      parallel_strategy_kwargs: Mapping[str, Any] | None = None) -> Any:
        """Ray's ``prepare_model`` with the planned bucket cap, the communication timer and the
        phase hooks (:func:`raytrain_guard.train.prepare_model`)."""
        self.build()
        module = dropin_model.prepare_model(
            model, plan=self.model_plan, ctx=self.ctx, device=self.device, config=self.config,
            timer=self.step_guard.timer, measure_bandwidth=self.settings.measure_bandwidth,
            move_to_device=move_to_device, parallel_strategy=parallel_strategy,
            parallel_strategy_kwargs=parallel_strategy_kwargs)
        self._hooks.append(self._phases.hook_model(module))
        return module

    def prepare_data_loader(self, loader: Any, add_dist_sampler: bool = True,
                            move_to_device: bool = True, auto_transfer: bool = True) -> Any:
        """A :class:`DropInDataLoader` with the user's settings
        (:func:`raytrain_guard.train.prepare_data_loader`); Ray's own for what it cannot guard."""
        self.build()
        why = unguardable(loader)
        if why is not None:
            logger.warning("rank %d: DataLoader not guarded (%s): Ray's prepare_data_loader "
                           "takes it, dropping prefetch_factor and persistent_workers",
                           self.rank, why)
            if self.ctx.source == "ray":
                from ray.train.torch import prepare_data_loader as ray_prepare
                return ray_prepare(loader, add_dist_sampler=add_dist_sampler,
                                   move_to_device=move_to_device, auto_transfer=auto_transfer)
            return loader
        new = DropInDataLoader.rebuilt_from(
            loader, config=self.config, world_rank=self.rank, world_size=self.world_size,
            gpus_per_node=max(1, self.ctx.local_world_size), device=self.device,
            add_dist_sampler=add_dist_sampler, move_to_device=move_to_device,
            auto_transfer=auto_transfer)
        self.loaders.append(new)
        if self.loader is None:           # the first loader is the training loader: it opens
            self.step_guard.attach_loader(new)        # the steps and times their data wait
            self.attach_loader(new)
        return new

    def prepare_optimizer(self, optimizer: Any) -> Any:
        """The step ends where ``optimizer`` steps: its pre-hook ends ``backward``, its
        post-hook ends the step. Returns ``optimizer``."""
        self.build()
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InputError("optimizer", "is not a torch.optim.Optimizer",
                             value=type(optimizer).__name__,
                             fix="pass the optimizer the loop steps, e.g. "
                                 "AdamW(model.parameters())")
        self._hooks.extend(self._phases.hook_optimizer(optimizer))
        return optimizer

    # -- a trainer's own model, optimizer and loader (the integrations) -------------------------
    def guard_model(self, model: Any) -> Any:
        """Time ``forward`` and ``backward`` of a model a trainer wrapped itself (Hugging Face's,
        Lightning's): the phase hooks only, nothing re-wrapped. Returns ``model``."""
        self.build()
        self._hooks.append(self._phases.hook_model(model))
        return model

    def guard_optimizer(self, optimizer: Any) -> Any:
        """:meth:`prepare_optimizer` on the torch optimizer inside a trainer's wrapper
        (accelerate's ``.optimizer``, Lightning's ``._optimizer``), whose ``step()`` runs once
        per optimizer step. Returns that torch optimizer."""
        return self.prepare_optimizer(unwrap_optimizer(optimizer))

    def attach_loader(self, loader: Any) -> None:
        """A loader the trainer built (not the guard): its ``settings()`` and ``stats()`` go to
        the summary, a SET_PREFETCH decision to its ``request_prefetch_factor``. The first one
        only (the training loader)."""
        self.build()
        if self.loader is not None:
            return
        self.loader = loader
        self._actions.loader = loader
        if self.metrics is not None:
            self._safe("metrics", self.metrics.record_loader, loader.plan.num_workers,
                       loader.plan.prefetch_factor)

    def start_at(self, step: int) -> None:
        """Count steps from ``step`` (a trainer restored at that global step): stops and
        decisions are then at the trainer's steps, alike on every rank."""
        self.build()
        self.boundary.step = int(step)
        self.note_pause()

    def note_pause(self) -> None:
        """The trainer paused between steps (a checkpoint, an evaluation, a restore): the next
        steps settle before the slow-step rules judge them, and the next step opens now."""
        if self._built:
            self._safe("note_pause", self.step_guard.note_pause, self.step)
            self._safe("note_pause", self.step_guard.begin_step, self.step)

    def mark(self, phase: str) -> None:
        """End ``phase`` now (``"data"`` where a trainer has fetched the step's batches)."""
        if self._built:
            self._safe("mark", self.step_guard.mark, phase)

    # -- what the loop asks ----------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The optimizer steps taken."""
        return self.boundary.step if self.boundary is not None else 0

    @property
    def stop_reason(self) -> str | None:
        """Why every rank stopped (None: no stop)."""
        return self.boundary.stop_reason if self.boundary is not None else None

    @property
    def stopped_at(self) -> int | None:
        """The step at which every rank stopped (None: no stop)."""
        return self.boundary.stopped_at if self.boundary is not None else None

    @property
    def decision_log(self) -> list[dict[str, Any]]:
        """Every decision recorded on this rank, applied or not (JSON-able)."""
        return self.boundary.decision_log if self.boundary is not None else []

    def should_stop(self) -> bool:
        """True from the step at which every rank agreed to checkpoint and stop (the same step
        on every rank): save a checkpoint (``ray.train.report``) and leave the loop."""
        return self.stop_reason is not None

    def should_checkpoint(self) -> bool:
        """True at the step boundary where a ``checkpoint`` decision (or the stop) applies."""
        return self.boundary is not None and self.boundary.checkpoint_now

    def decisions(self) -> list[Decision]:
        """The decisions applied at the latest step boundary: the guard applied cache release,
        pacing and prefetch; ``checkpoint``, ``checkpoint_and_stop`` and ``shrink_micro_batch``
        are the loop's."""
        return list(self.boundary.now) if self.boundary is not None else []

    def request_stop(self, reason: str) -> None:
        """Ask every rank to checkpoint and stop: carried by the next agreement round (every
        ``lockstep_every_steps`` steps), after which :meth:`should_stop` is true on every rank."""
        self.boundary.request_stop(reason)

    def own_summary(self) -> dict[str, Any]:
        """This rank's figures (JSON-able): its step window, decisions, loader settings and
        data wait, stop. No collective."""
        return rank_summary(world_rank=getattr(self, "rank", 0), step=self.step,
                            window=self.step_guard.gate.window if self._built else (),
                            loader=self.loader, decisions=self.decision_log,
                            model_plan=self.model_plan, stop_reason=self.stop_reason,
                            stopped_at=self.stopped_at)

    def summary(self, *, gather: bool = True) -> dict[str, Any]:
        """Attribution per rank with reasons, data wait, decisions, the loaders' settings in
        force, the stop. With ``gather`` (default) a collective: every rank calls it at the same
        point and gets every rank's figures (for the loop's final ``ray.train.report``)."""
        own = self.own_summary()
        per_rank = [own]
        if gather and getattr(self, "world_size", 1) > 1:
            per_rank = gather_objects(own)
        return combine_summaries(per_rank, straggler_frac=self.config.straggler_frac)

    # -- the end ---------------------------------------------------------------------------------
    def close(self) -> None:
        """The loop returned (or raised): hooks off, the last figures to the coordinator (the
        steps no report carried, this rank's summary), the loaders' workers stopped."""
        if self._closed:
            return
        self._closed = True
        for handle in self._hooks:
            self._safe("close", handle.remove)
        self._hooks = []
        if not self._built:
            return
        self.boundary.finish()
        if self.settings.run_id is not None:
            self._safe("close", lambda: report_summary(
                self.settings.run_id, self.settings.namespace, self.rank, self.own_summary()))
        for loader in self.loaders:
            self._safe("close", loader.close)
        self._safe("close", self.step_guard.timer.close)

    def _safe(self, part: str, fn: Callable[..., Any], *args: Any) -> Any:
        return self._fail_open.call(part, fn, *args)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside trainers' wrappers (``.optimizer``, ``._optimizer``)."""
    inner = optimizer
    for _ in range(4):                  # wrappers nest at most a few deep
        wrapped = getattr(inner, "optimizer", None) or getattr(inner, "_optimizer", None)
        if not isinstance(wrapped, torch.optim.Optimizer):
            break
        inner = wrapped
    return inner


# -- the process's guard -------------------------------------------------------------------------

_current: WorkerGuard | None = None


def install(settings: WorkerSettings | None) -> WorkerGuard:
    """Make a fresh guard this process's (the drop-in's train function does, before the
    user's loop)."""
    global _current
    _current = WorkerGuard(settings)
    return _current


def uninstall(guard: WorkerGuard) -> None:
    global _current
    if _current is guard:
        _current = None


def current_guard() -> WorkerGuard:
    """This process's guard; one with the defaults and no cluster layer when the drop-in's
    TorchTrainer did not install one (``prepare_*`` under Ray's own TorchTrainer)."""
    global _current
    if _current is None:
        _current = WorkerGuard()
    return _current
