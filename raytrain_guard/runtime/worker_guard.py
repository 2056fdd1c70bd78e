"""The worker side of the drop-in (:mod:`raytrain_guard.train`): one guard per training process.

A :class:`WorkerGuard` joins the existing pieces for a loop the user wrote:

* the model: planned DDP (``bucket_cap_mb`` from the gradients and the measured allreduce
  curve, :func:`~raytrain_guard.core.buckets.recommend_bucket_cap`) through Ray's own
  ``prepare_model``, or :func:`~raytrain_guard.runtime.model.wrap_model` for the strategies Ray
  lacks (``zero1``, FSDP2); the communication timer on DDP
  (:func:`~raytrain_guard.runtime.timing.attach_comm_timer`);
* the loader: a :class:`~raytrain_guard.runtime.dropin_loader.DropInDataLoader` (a
  :class:`~raytrain_guard.runtime.loader.GuardedDataLoader` with ``sampler.set_epoch``), which
  opens each step and times its data wait (:meth:`StepGuard.attach_loader`);
* the phases without a mark in the loop: a forward hook on the model puts a gradient hook on
  its output; when backward reaches the output, ``forward`` ends (forward and loss) and a
  callback queued on the autograd engine ends ``backward`` where the backward pass ends; the
  optimizer's step pre-hook ends ``backward`` again (what DDP's finishing allreduce and any
  clipping took is added to it), and its post-hook ends the step: the optimizer phase is the
  rest (:class:`~raytrain_guard.runtime.timing.StepTimer`);
* at each step end: the :class:`~raytrain_guard.runtime.step_guard.StepGuard` (timings, memory
  watermark, slow steps), the cluster's decisions through
  :class:`~raytrain_guard.cluster.client.ClusterDecisionSource` (lockstep every
  ``lockstep_every_steps``) and the stop flag on the shared control plane
  (:mod:`raytrain_guard.runtime.control_plane`): a ``checkpoint_and_stop`` from any rank's gate,
  from :meth:`WorkerGuard.request_stop` on any rank or from the coordinator turns
  :meth:`WorkerGuard.should_stop` true on every rank at the same step.

Per step: a few clock reads, one tensor hook, the step guard's fast path. No RPC, no NVML, no
device synchronization; every ``report_every_steps`` steps a batch of figures goes to the
gauges (:class:`~raytrain_guard.cluster.metrics.RankMetrics`) and, fire-and-forget, to the
coordinator. Every part fails open: a hook or probe that raises is logged once and training
goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Cause, Decision, due_at
from raytrain_guard.core.steps import StepStats
from raytrain_guard.runtime.dropin_loader import DropInDataLoader, default_collate, unguardable
from raytrain_guard.runtime.fail_open import FailOpen

logger = logging.getLogger(__name__)

OTHER_RANK_STOP = "another rank asked to checkpoint and stop"
#: the strategies Ray's prepare_model has (``parallel_strategy``); others go to wrap_model
RAY_STRATEGIES = ("ddp", "fsdp", None)


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


# -- the guard of one worker -------------------------------------------------------------------

class WorkerGuard:
    """One training process's guard for a loop the user wrote (see the module docstring).

    The parts are built by the first ``prepare_*`` call (every rank calls them at the same
    point of the script: building the control plane may be a collective). ``context``: the
    worker context (default: Ray Train's, or torch.distributed's, or one rank).
    """

    def __init__(self, settings: WorkerSettings | None = None, *, context: Any = None) -> None:
        self.settings = settings or WorkerSettings()
        self.config = self.settings.config
        self._context = context
        self.step = 0
        self.stop_reason: str | None = None
        self.stopped_at: int | None = None
        self.loader: DropInDataLoader | None = None
        self.loaders: list[DropInDataLoader] = []
        self.model_plan: dict[str, Any] = {}
        self.decision_log: list[dict[str, Any]] = []
        self.pending: list[Decision] = []
        self._now: list[Decision] = []
        self._local_stop: Decision | None = None
        self._checkpoint_now = False
        self._armed = False
        self._hooks: list[Any] = []
        self._fail_open = FailOpen(
            logger, lambda: f"rank {getattr(self, 'rank', '?')} step {self.step}")
        self._built = False
        self._closed = False
        self._last_release_s: float | None = None
        self.metrics: Any = None
        self.source: Any = None

    # -- set-up ----------------------------------------------------------------------------------
    def build(self) -> WorkerGuard:
        """The parts: device, step timer and guard, memory probe, control plane, decision
        source, gauges. Idempotent; every rank calls it at the same point."""
        if self._built:
            return self
        from raytrain_guard.runtime.context import current_context
        from raytrain_guard.runtime.control_plane import ControlPlane, shared_control_plane
        from raytrain_guard.runtime.step_guard import StepGuard
        from raytrain_guard.runtime.timing import StepTimer

        self._built = True
        self.ctx = self._context or current_context()
        self.rank, self.world_size = self.ctx.world_rank, self.ctx.world_size
        self.device = _device(self.ctx)
        timer = StepTimer(device=self.device, world_rank=self.rank)
        self.step_guard = StepGuard(self.config, probe=self._probe(), timer=timer,
                                    world_rank=self.rank)
        self.control = shared_control_plane() if self.world_size > 1 else ControlPlane(1)
        self.every_stop_check = self.config.lockstep_every_steps
        self._every = (self.config.report_every_steps, self.config.lockstep_every_steps)
        if self.settings.run_id is not None:
            from raytrain_guard.cluster.client import ClusterDecisionSource
            self.source = ClusterDecisionSource(self.settings.run_id,
                                                self.settings.namespace or "", self.config)
            self.source.bind_setup(self._setup)
        self.metrics = self._make_metrics()
        logger.info("rank %d/%d: guard on %s%s", self.rank, self.world_size, self.device,
                    f", run {self.settings.run_id}" if self.settings.run_id else
                    ", no cluster layer (local gate only)")
        return self

    def _probe(self) -> Any:
        from raytrain_guard.runtime.probes import CudaMemoryProbe, ProcessMemoryProbe
        try:
            if self.device.type == "cuda":
                return CudaMemoryProbe(self.device, config=self.config)
            return ProcessMemoryProbe(self.config,
                                      local_world_size=max(1, self.ctx.local_world_size))
        except Exception:  # fail open: timing rules only
            logger.warning("rank %d: no memory probe", self.rank, exc_info=True)
            return None

    def _make_metrics(self) -> Any:
        try:
            import ray
            if not ray.is_initialized():
                return None
            from raytrain_guard.cluster.metrics import RankMetrics
            return RankMetrics(self._run_name(), self.rank,
                               watermark_frac=self.config.memory_watermark_frac,
                               critical_frac=self.config.memory_critical_frac)
        except Exception:  # fail open: no gauges
            logger.debug("no ray.util.metrics", exc_info=True)
            return None

    def _run_name(self) -> str:
        if self.settings.run_name:
            return self.settings.run_name
        try:
            import ray.train
            return ray.train.get_context().get_experiment_name()
        except Exception:  # noqa: BLE001 - outside Ray Train
            return self.settings.run_id or "local"

    def _setup(self) -> dict[str, Any]:
        """This rank's batch layout for the coordinator's shrink and prefetch rules."""
        loader = self.loader
        if loader is None:
            return {}
        return {"micro_batch": loader.batch_size, "grad_accum": 1,
                "prefetch_factor": loader.plan.prefetch_factor or None}

    # -- the model -------------------------------------------------------------------------------
    def prepare_model(self, model: Any, move_to_device: Any = True,
                      parallel_strategy: str | None = "ddp",
                      parallel_strategy_kwargs: Mapping[str, Any] | None = None) -> Any:
        """Ray's ``prepare_model`` with the planned bucket cap, the communication timer and the
        phase hooks (see :func:`raytrain_guard.train.prepare_model`)."""
        from raytrain_guard.runtime.model import parse_strategy, wrap_model
        from raytrain_guard.runtime.timing import attach_comm_timer, attach_fsdp_comm_timer

        self.build()
        kwargs = dict(parallel_strategy_kwargs or {})
        ddp_like = parallel_strategy in ("ddp", "zero1")
        if ddp_like and self.world_size > 1:
            cap = self._planned_bucket_cap(model)
            if "bucket_cap_mb" in kwargs:
                logger.info("rank %d: bucket_cap_mb=%s as given (the guard's plan: %s)",
                            self.rank, kwargs["bucket_cap_mb"], self.model_plan["reason"])
            else:
                kwargs["bucket_cap_mb"] = cap
        in_ray = self.ctx.source == "ray"
        if in_ray and parallel_strategy in RAY_STRATEGIES:
            from ray.train.torch import prepare_model as ray_prepare_model
            module = ray_prepare_model(model, move_to_device=move_to_device,
                                       parallel_strategy=parallel_strategy,
                                       parallel_strategy_kwargs=kwargs or None)
        else:
            if parallel_strategy is None:
                module = model.to(self.device) if move_to_device is not False else model
            else:
                planned = wrap_model(model, strategy=parse_strategy(parallel_strategy),
                                     bucket_cap_mb=kwargs.get("bucket_cap_mb"),
                                     gradient_as_bucket_view=bool(
                                         kwargs.get("gradient_as_bucket_view", False)),
                                     device=self.device, use_ray=in_ray)
                module = planned.module
        self.model_plan["wrapped"] = type(module).__name__
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            self.model_plan["bucket_cap_bytes"] = int(module.bucket_bytes_cap)
            try:
                attach_comm_timer(module, self.step_guard.timer)
            except Exception:  # fail open: no communication wait figures
                logger.warning("rank %d: communication timer not attached (a comm hook of "
                               "your own?)", self.rank, exc_info=True)
        elif self.world_size > 1 and _is_fsdp2(module):
            try:
                attach_fsdp_comm_timer(module, self.step_guard.timer)
            except Exception:  # fail open: no communication wait figures
                logger.warning("rank %d: FSDP2 communication timer not attached", self.rank,
                               exc_info=True)
        self._hooks.append(module.register_forward_hook(self._on_forward))
        return module

    def _planned_bucket_cap(self, model: Any) -> float:
        """``bucket_cap_mb`` from the gradients and, when measured, the allreduce curve."""
        from raytrain_guard.core.buckets import recommend_bucket_cap

        curve = None
        if self.settings.measure_bandwidth:
            try:
                from raytrain_guard.runtime.bandwidth import measure_allreduce_curve
                curve = measure_allreduce_curve(device=self.device)
            except Exception:  # a collective: every rank fails alike, no curve
                logger.warning("rank %d: allreduce curve not measured", self.rank,
                               exc_info=True)
        trainable = [p for p in model.parameters() if p.requires_grad]
        plan = recommend_bucket_cap(
            grad_bytes=sum(p.numel() * p.element_size() for p in trainable), config=self.config,
            param_bytes=[p.numel() * p.element_size() for p in reversed(trainable)],
            bandwidth_curve=curve.as_pairs() if curve is not None else None)
        self.model_plan.update(plan.to_dict(), reason=plan.reason)
        logger.info("rank %d: %s", self.rank, plan.reason)
        return plan.bucket_cap_mb

    # -- the data --------------------------------------------------------------------------------
    def prepare_data_loader(self, loader: Any, add_dist_sampler: bool = True,
                            move_to_device: bool = True, auto_transfer: bool = True) -> Any:
        """A :class:`DropInDataLoader` with the user's settings (see
        :func:`raytrain_guard.train.prepare_data_loader`); Ray's own for what it cannot guard."""
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
        given_workers = loader.num_workers or None        # 0: torch's default, sized here
        generator = loader.generator
        new = DropInDataLoader.keeping_settings(
            loader.dataset, loader.batch_size,
            shuffle=isinstance(loader.sampler, torch.utils.data.RandomSampler),
            seed=int(generator.initial_seed()) if generator is not None else 0,
            drop_last=loader.drop_last,
            collate_fn=None if loader.collate_fn is default_collate() else loader.collate_fn,
            config=self.config,
            world_rank=self.rank if add_dist_sampler else 0,
            world_size=self.world_size if add_dist_sampler else 1,
            gpus_per_node=max(1, self.ctx.local_world_size),
            device=self.device if move_to_device else None,
            num_workers=given_workers,
            prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
            persistent_workers=bool(loader.persistent_workers) or given_workers is None,
            multiprocessing_context=loader.multiprocessing_context,
            device_prefetch_depth=1 if auto_transfer or not move_to_device else 0)
        self.loaders.append(new)
        if self.loader is None:           # the first loader is the training loader: it opens
            self.loader = new             # the steps and times their data wait
            self.step_guard.attach_loader(new)
            if self.metrics is not None:
                self._safe("metrics", self.metrics.record_loader, new.plan.num_workers,
                           new.plan.prefetch_factor)
        return new

    # -- the optimizer ---------------------------------------------------------------------------
    def prepare_optimizer(self, optimizer: Any) -> Any:
        """The step ends where ``optimizer`` steps: its pre-hook ends ``backward``, its
        post-hook ends the step (see the module docstring). Returns ``optimizer``."""
        self.build()
        if not isinstance(optimizer, torch.optim.Optimizer):
            from raytrain_guard.errors import InputError
            raise InputError("optimizer", "is not a torch.optim.Optimizer",
                             value=type(optimizer).__name__,
                             fix="pass the optimizer the loop steps, e.g. AdamW(model.parameters())")
        self._hooks.append(optimizer.register_step_pre_hook(self._before_optimizer))
        self._hooks.append(optimizer.register_step_post_hook(self._after_optimizer))
        return optimizer

    # -- hooks (the hot path) ----------------------------------------------------------------------
    def _on_forward(self, module: Any, args: Any, output: Any) -> None:
        if self._armed or not torch.is_grad_enabled():
            return
        try:
            tensor = _first_grad_tensor(output)
            if tensor is not None:
                tensor.register_hook(self._on_backward_start)
                self._armed = True
        except Exception:  # noqa: BLE001 - fail open: no forward/backward split
            self._failed_once("forward hook")

    def _on_backward_start(self, grad: Any) -> None:
        self._armed = False
        self.step_guard.mark("forward")
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        except Exception:  # noqa: BLE001 - the optimizer pre-hook still ends backward
            self._failed_once("backward callback")

    def _on_backward_end(self) -> None:
        self.step_guard.mark("backward")

    def _before_optimizer(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.step_guard.mark("backward")

    def _after_optimizer(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        step = self.step
        try:
            local = self.step_guard.end_step(step)
        except Exception:  # noqa: BLE001 - fail open
            self._failed_once("end_step")
            local = []
        self.step = step + 1
        self._boundary(self.step, local)

    # -- the step boundary -----------------------------------------------------------------------
    def _boundary(self, step: int, local: list[Decision]) -> None:
        """After ``step`` steps: local decisions, the cluster's (lockstep), the stop agreement.
        The collectives run on every rank at the same steps (they depend on ``step`` only)."""
        now: list[Decision] = []
        self._checkpoint_now = False
        for decision in local:
            self._record(step, decision)
            now.append(decision)
            if decision.action is Action.CHECKPOINT_AND_STOP and self._local_stop is None:
                self._local_stop = decision
        stats = self.step_guard.drain_stats() if self._stats_due(step, local) else []
        if stats and self.metrics is not None:
            self._safe("metrics", self.metrics.record, stats)
        control = self.control
        control.local_stop = self._local_stop is not None      # rides on a lockstep round
        rounds_before = control.num_rounds
        polled = self.source.poll(step, stats) if self.source is not None else ()
        due, self.pending = due_at(step, self.pending, polled)
        stop = None
        for decision in due:
            mine = self._concerns_me(decision)
            self._record(step, decision, applied=mine)
            if mine:
                self._apply_cluster(decision)
                now.append(decision)
            if decision.action is Action.CHECKPOINT_AND_STOP and stop is None:
                stop = decision.reason
        if stop is None:
            agreed = control.num_rounds != rounds_before
            if not agreed and step % self.every_stop_check == 0:
                control.agree()
                agreed = True
            if agreed and control.agreed_stop:
                stop = self._local_stop.reason if self._local_stop is not None \
                    else OTHER_RANK_STOP
        if stop is not None and self.stop_reason is None:
            self.stop_reason, self.stopped_at = stop, step
            self._checkpoint_now = True
            logger.warning("rank %d: checkpoint and stop at step %d: %s", self.rank, step, stop)
        self._now = now

    def _stats_due(self, step: int, local: list[Decision]) -> bool:
        if local or any(step % every == 0 for every in self._every):
            return True
        return any(d.step is not None and d.step <= step for d in self.pending)

    def _concerns_me(self, decision: Decision) -> bool:
        scope = decision.scope
        return not scope.startswith("node:") or scope[len("node:"):] == self.ctx.node_id

    def _apply_cluster(self, decision: Decision) -> None:
        """Apply what the guard can apply itself; the rest is the loop's (:meth:`decisions`)."""
        from raytrain_guard.runtime.cache_release import release_cache

        action = decision.action
        if action is Action.RELEASE_CACHE:
            now = time.monotonic()
            if self._last_release_s is None or \
                    now - self._last_release_s >= self.config.release_cache_min_interval_s:
                self._last_release_s = now
                self._safe("release_cache", release_cache)
        elif action is Action.PACE:
            self._safe("pace", self.step_guard.set_pace, decision.params.get("delay_s", 0.0))
        elif action is Action.SET_PREFETCH and self.loader is not None:
            if "prefetch_factor" in decision.params:
                self._safe("set_prefetch", self.loader.request_prefetch_factor,
                           decision.params["prefetch_factor"])
            if "device_prefetch_depth" in decision.params:
                self._safe("set_prefetch", self.loader.set_device_prefetch_depth,
                           int(decision.params["device_prefetch_depth"]))
        elif action is Action.CHECKPOINT:
            self._checkpoint_now = True
        elif action is Action.SHRINK_MICRO_BATCH:
            logger.warning("rank %d: %s: the loop owns its batch size; see get_guard()."
                           "decisions()", self.rank, decision)

    def _record(self, step: int, decision: Decision, *, applied: bool = True) -> None:
        entry = decision.to_dict()
        entry.update(applied_at=step, world_rank=self.rank, applied=applied)
        self.decision_log.append(entry)
        if applied and self.metrics is not None:
            self._safe("metrics", self.metrics.record_decision, decision)

    # -- what the loop asks ----------------------------------------------------------------------
    def should_stop(self) -> bool:
        """True from the step at which every rank agreed to checkpoint and stop (the same step
        on every rank): save a checkpoint (``ray.train.report``) and leave the loop."""
        return self.stop_reason is not None

    def should_checkpoint(self) -> bool:
        """True at the step boundary where a ``checkpoint`` decision (or the stop) applies."""
        return self._checkpoint_now

    def decisions(self) -> list[Decision]:
        """The decisions applied at the latest step boundary (the guard has acted on what it
        can: cache release, pacing, prefetch; ``checkpoint``, ``checkpoint_and_stop`` and
        ``shrink_micro_batch`` are the loop's)."""
        return list(self._now)

    def request_stop(self, reason: str) -> None:
        """Ask every rank to checkpoint and stop: carried by the next agreement round (every
        ``lockstep_every_steps`` steps), after which :meth:`should_stop` is true on every rank."""
        if self._local_stop is None:
            self._local_stop = Decision(Action.CHECKPOINT_AND_STOP,
                                        f"stop requested on rank {self.rank}: {reason}",
                                        cause=Cause.UNKNOWN, scope="rank")
            self._record(self.step, self._local_stop)

    def own_summary(self) -> dict[str, Any]:
        """This rank's figures (JSON-able): its step window, decisions, loader settings and
        data wait, stop. No collective."""
        window = []
        if self._built:
            window = [s.to_dict() for s in self.step_guard.gate.window]
        loader = None
        if self.loader is not None:
            stats = self.loader.stats()
            loader = {**self.loader.settings(),
                      "data_wait_frac": round(stats["data_wait_frac"], 4),
                      "data_wait_total_s": round(stats["data_wait_total_s"], 4),
                      "batches": stats["batches"]}
        return {"world_rank": getattr(self, "rank", 0), "step": self.step, "window": window,
                "decisions": list(self.decision_log), "loader": loader,
                "model": dict(self.model_plan), "stop_reason": self.stop_reason,
                "stopped_at": self.stopped_at}

    def summary(self, *, gather: bool = True) -> dict[str, Any]:
        """Attribution per rank with reasons, data wait, decisions, the loaders' settings in
        force, the stop. With ``gather`` (default) a collective: every rank calls it at the same
        point and gets every rank's figures (for the loop's final ``ray.train.report``)."""
        own = self.own_summary()
        per_rank = [own]
        if gather and getattr(self, "world_size", 1) > 1:
            from raytrain_guard.runtime.checkpoint import gather_objects
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
        left = self._safe("close", self.step_guard.drain_stats) or []
        if left and self.metrics is not None:
            self._safe("metrics", self.metrics.record, left)
        finish = getattr(getattr(self.source, "_source", None), "finish", None)
        if callable(finish):
            self._safe("close", finish, left)
        if self.settings.run_id is not None:
            self._safe("close", self._post_summary)
        for loader in self.loaders:
            self._safe("close", loader.close)

    def _post_summary(self) -> None:
        """The one method that touches ``ray.get`` (at the end of the run, with a timeout)."""
        import ray

        from raytrain_guard.cluster.client import coordinator_name
        handle = ray.get_actor(coordinator_name(self.settings.run_id),
                               namespace=self.settings.namespace)
        ray.get(handle.report_summary.remote(self.rank, self.own_summary()), timeout=10)

    # -- fail open -------------------------------------------------------------------------------
    def _safe(self, part: str, fn: Callable[..., Any], *args: Any) -> Any:
        return self._fail_open.call(part, fn, *args)

    def _failed_once(self, part: str) -> None:
        self._fail_open.note(part)


def combine_summaries(per_rank: list[Mapping[str, Any]], *,
                      straggler_frac: float) -> dict[str, Any]:
    """Every rank's :meth:`WorkerGuard.own_summary` -> the run's (pure but for StepStats):
    attribution across ranks, data wait and loader settings per rank, every decision, the
    stop (a rank that only heard of it learns whose it was)."""
    from raytrain_guard.core.gate import attribute_across_ranks

    ranks = sorted(per_rank, key=lambda r: r.get("world_rank", 0))
    windows = [[StepStats.from_dict(s) for s in r.get("window") or ()] for r in ranks]
    attribution = [{"world_rank": a.world_rank, "role": a.role.value, "reason": a.reason}
                   for a in attribute_across_ranks(windows, straggler_frac=straggler_frac)]
    decisions = [d for r in ranks for d in r.get("decisions") or ()]
    reasons = [r.get("stop_reason") for r in ranks if r.get("stop_reason")]
    own = [x for x in reasons if x != OTHER_RANK_STOP]
    return {"world_size": len(ranks), "steps": max((r.get("step", 0) for r in ranks), default=0),
            "stopped_early": bool(reasons), "stop_reason": (own or reasons or [None])[0],
            "stopped_at": sorted({r.get("stopped_at") for r in ranks if r.get("stopped_at")
                                  is not None}),
            "attribution": attribution,
            "data_wait_frac": {r.get("world_rank", 0): (r.get("loader") or {}).get(
                "data_wait_frac") for r in ranks},
            "loader": [r.get("loader") for r in ranks],
            "model": ranks[0].get("model") if ranks else {},
            "decisions": decisions}


# -- helpers -------------------------------------------------------------------------------------

def _first_grad_tensor(output: Any) -> Any:
    """The first tensor of a module's output that backward will reach (None: none)."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    values = output.values() if isinstance(output, Mapping) else \
        output if isinstance(output, (tuple, list)) else ()
    for value in values:
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return value
    return None


def _device(ctx: Any) -> Any:
    if ctx.source == "ray":
        from ray.train.torch import get_device
        return torch.device(get_device())
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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


def _is_fsdp2(module: Any) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(module, FSDPModule)
