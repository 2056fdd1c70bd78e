"""The shared train loop template: hand :func:`train_loop_per_worker` to a TorchTrainer.

::

    trainer = TorchTrainer(train_loop_per_worker, train_loop_config={
        "model_factory": "mypkg.models:make_model",        # () -> nn.Module
        "dataset_factory": "mypkg.data:make_dataset",      # () -> Dataset (map-style)
        "optimizer_factory": "mypkg.optim:make_optimizer", # (params) -> Optimizer
        "loss_fn": "mypkg.loss:loss_fn",                   # (model, batch) -> scalar tensor
        "micro_batch": 32, "grad_accum": 4, "epochs": 2, "strategy": "ddp"},
        scaling_config=ScalingConfig(num_workers=8, use_gpu=True))

:class:`GuardedTrainLoop` builds a worker's run (loader, model wrapping, guard) and runs it; its
parts live in :mod:`raytrain_guard.runtime.loop`, one responsibility a module: the config
(``config``), the epoch loop and accumulation (``steps``), oversized batches (``spikes``), the
batch layout (``layout``), decisions at a boundary (``decisions``), checkpoints and results
(``checkpoints``), the experiment's seams (``rehearsal``), reporting (``reporting``). What it
does and every key: docs/train_loop.md.
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from raytrain_guard.core.decisions import Decision
from raytrain_guard.core.memory_model import Strategy
from raytrain_guard.errors import InputError
from raytrain_guard.runtime.loop.checkpoints import CheckpointsMixin, RestartRequested
from raytrain_guard.runtime.loop.config import LoopConfig, _call_factory, _check_loss
from raytrain_guard.runtime.loop.decisions import DecisionsMixin
from raytrain_guard.runtime.loop.layout import LayoutMixin, relayout, shrink_verdict
from raytrain_guard.runtime.loop.rehearsal import RehearsalMixin, _fault_injector
from raytrain_guard.runtime.loop.reporting import DirectoryReporter, RayTrainReporter, _rank_metrics
from raytrain_guard.runtime.loop.spikes import SpikesMixin
from raytrain_guard.runtime.loop.steps import StepsMixin

__all__ = [
    "DirectoryReporter",
    "GuardedTrainLoop",
    "LoopConfig",
    "RayTrainReporter",
    "RestartRequested",
    "_check_loss",
    "relayout",
    "shrink_verdict",
    "train_loop_per_worker",
]

logger = logging.getLogger(__name__)


def train_loop_per_worker(config: dict) -> dict[str, Any]:
    """The TorchTrainer entry point: run the guarded loop of ``config`` on this worker."""
    return GuardedTrainLoop(LoopConfig.from_dict(config)).run()


class GuardedTrainLoop(StepsMixin, SpikesMixin, LayoutMixin, DecisionsMixin,
                       CheckpointsMixin, RehearsalMixin):
    """One worker's guarded training run (see the module docstring).

    ``reporter``: :class:`RayTrainReporter` inside Ray Train (default there), else a
    :class:`DirectoryReporter`. No method here calls torch.distributed itself: the stop
    agreement is the shared :class:`~raytrain_guard.runtime.control_plane.ControlPlane`'s
    round (one 16-byte CPU all_reduce on a gloo side group every K steps, which the lockstep
    exchange also rides on); bandwidth, wrapping and checkpoint/result gathering live in their
    modules.
    """

    def __init__(self, config: LoopConfig, *, reporter: Any = None, context: Any = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        from raytrain_guard.runtime.context import current_context

        self.config = config
        self.ctx = context or current_context()
        self.reporter = reporter or (RayTrainReporter() if self.ctx.source == "ray"
                                     else DirectoryReporter(tempfile.mkdtemp(prefix="rtg-")))
        self._clock = clock
        self.rank = self.ctx.world_rank
        self.world_size = self.ctx.world_size
        self.step = 0
        self.decisions: list[dict[str, Any]] = []
        self.pending: list[Decision] = []      # from the decision source, for later steps
        self.stop_reason: str | None = None
        self._local_stop: Decision | None = None
        self._last_loss: Any = None
        self._audit = None
        self.results: dict[str, Any] = {}
        # the batch layout now: the config's until a shrink (or a resumed checkpoint) changes it
        self.micro_batch, self.grad_accum = _first_layout(config, self.world_size)
        self.batch_changes: list[dict[str, Any]] = []     # applied and refused shrinks
        self._requested_prefetch: int | None = None        # last SET_PREFETCH cap, kept on rebuild
        # the cadences at which a boundary reads the guard's StepStats (_stats_due)
        self._stats_every = (config.guard.report_every_steps, config.guard.lockstep_every_steps,
                             config.every_stop_check, config.every_checkpoint)
        # the experiment's seams (all None in a plain run): injected faults, a simulated card,
        # the hang watchdog, the per-rank trace; attempt: this process's try at the run
        self.fault_runtime: Any = None
        self.sim_device: Any = None
        # what prices a micro-batch before its forward: the simulated card, or CUDA's allocator
        self.card: Any = None
        self.device_time: Any = None      # the experiment's GPU-like device time (CPU runs)
        self.watchdog: Any = None
        self.node_waits: Any = None       # NodeCpuWaits of this node (None: alone on it)
        self._trace: Any = None
        self.attempt = f"{os.getpid()}-{time.time_ns() % 10**12}"
        self._grad_norm: Any = None               # the last step's norm before clipping
        self.scheduler: Any = None
        self._autocast = False
        self._act_per_elem: float | None = None   # activation bytes per batch element, learned
        self._batch_elements: deque[int] = deque(maxlen=64)   # sizes of the batches seen
        self._split_pending: list[dict[str, Any]] = []   # splits of this step, measured at its end
        self._loader_workers_at: int | None = None    # step of the last loader-worker change
        self.restart_reason: str | None = None

    def _build(self) -> None:
        import torch

        cfg = self.config
        device = self._device()
        self.device = device
        _seed_everything(cfg.seed)                  # same initial weights on every rank
        dataset = _call_factory("dataset_factory", cfg.dataset_factory)
        self._build_faults(device)
        if self.fault_runtime is not None:
            dataset = self.fault_runtime.wrap_dataset(dataset)
        self.loader = self._make_loader(dataset, self.micro_batch)
        model = _call_factory("model_factory", cfg.model_factory)
        if not isinstance(model, torch.nn.Module):
            raise InputError("model_factory", "did not return a torch.nn.Module",
                             value=type(model).__name__, fix="return an nn.Module")
        if not any(p.requires_grad for p in model.parameters()):
            raise InputError("model_factory", "returned a model without trainable parameters",
                             value=type(model).__name__, fix="leave some parameters trainable")
        if self.device_time is not None:
            self.device_time.attach(model)
        self.steps_per_epoch = self._steps_per_epoch(self.loader, self.grad_accum)
        if self.steps_per_epoch == 0 or self.grad_accum > len(self.loader):
            raise InputError("grad_accum", f"exceeds the {len(self.loader)} micro-batches of "
                             f"an epoch on each rank", value=cfg.grad_accum,
                             fix="use a smaller grad_accum or micro_batch, or more data")
        self.total_steps = self.steps_per_epoch * cfg.epochs
        if cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        self._model = model

    def _plan_and_wrap(self) -> None:
        from raytrain_guard.core.buckets import recommend_bucket_cap
        from raytrain_guard.runtime.bandwidth import measure_allreduce_curve
        from raytrain_guard.runtime.model import wrap_model, wrap_optimizer

        cfg, model = self.config, self._model
        self.curve = None
        if cfg.measure_bandwidth and self.world_size > 1:
            self.curve = measure_allreduce_curve(device=self.device)
            logger.info("rank %d: %s", self.rank, self.curve.describe(cfg.guard.bandwidth_peak_frac))
        trainable = [p for p in model.parameters() if p.requires_grad]
        grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
        self.bucket_plan = recommend_bucket_cap(
            grad_bytes=grad_bytes, config=cfg.guard,
            param_bytes=[p.numel() * p.element_size() for p in reversed(trainable)],
            bandwidth_curve=self.curve.as_pairs() if self.curve is not None else None)
        cap = cfg.bucket_cap_mb if cfg.bucket_cap_mb is not None else self.bucket_plan.bucket_cap_mb
        if cfg.strategy in (Strategy.DDP, Strategy.ZERO1):
            logger.info("rank %d: %s%s", self.rank, self.bucket_plan.reason,
                        f" (overridden: bucket_cap_mb={cap} as given)"
                        if cfg.bucket_cap_mb is not None else "")
        self.planned = wrap_model(model, strategy=cfg.strategy, bucket_cap_mb=cap,
                                  gradient_as_bucket_view=cfg.gradient_as_bucket_view,
                                  device=self.device, precision=cfg.precision,
                                  **({} if cfg.fsdp_grad_sync == "auto"
                                     else {"fsdp_grad_sync": cfg.fsdp_grad_sync}))
        optimizer = _call_factory("optimizer_factory", cfg.optimizer_factory,
                                  self.planned.module.parameters())
        import torch
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InputError("optimizer_factory", "did not return a torch.optim.Optimizer",
                             value=type(optimizer).__name__, fix="return e.g. AdamW(params)")
        self.optimizer = wrap_optimizer(self.planned, optimizer)
        self.scheduler = (_call_factory("scheduler_factory", cfg.scheduler_factory, optimizer)
                          if cfg.scheduler_factory is not None else None)
        self._autocast = cfg.precision == "amp-bf16"
        if self.sim_device is not None:
            self.sim_device.measure_static(self.planned.module, self.optimizer)

    def _build_guard(self) -> None:
        from raytrain_guard.runtime.probes import FaultInjector
        from raytrain_guard.runtime.node_cpu_waits import NodeCpuWaits
        from raytrain_guard.runtime.step_guard import StepGuard
        from raytrain_guard.runtime.timing import (
            StepTimer,
            attach_comm_timer,
            attach_fsdp_comm_timer,
        )

        cfg = self.config
        self.faults = _fault_injector(cfg.faults, self.rank, FaultInjector)
        self.memory_faults = [m for m in cfg.faults.get("memory", ())
                              if int(m.get("rank", 0)) == self.rank]
        self.node_waits = NodeCpuWaits.for_group(self.ctx.local_rank, self.ctx.local_world_size)
        timer = StepTimer.measuring_cpu_wait(device=self.device, world_rank=self.rank,
                                             node_waits=self.node_waits)
        self.guard = StepGuard(cfg.guard, probe=self._probe(), timer=timer,
                               world_rank=self.rank, fault_injector=self.faults, act=cfg.act)
        # the loader opens the steps and times their data phase (see _train); not with faults
        self.guard.attach_loader(self.loader)
        if self.planned.kind == "ddp":
            try:
                attach_comm_timer(self.planned.module, timer, hook=self.fault_runtime.comm_hook()
                                  if self.fault_runtime is not None else None)
            except Exception:
                logger.warning("rank %d: communication timer not attached", self.rank,
                               exc_info=True)
        elif self.planned.kind == "fsdp2":
            try:
                attach_fsdp_comm_timer(self.planned.module, timer, before_reduce_scatter=(
                    self.fault_runtime.delay_comm if self.fault_runtime is not None else None))
            except Exception:
                logger.warning("rank %d: FSDP2 communication timer not attached", self.rank,
                               exc_info=True)
        self.metrics = _rank_metrics(self.rank, cfg.guard, self.loader)

    def _probe(self) -> Any:
        from raytrain_guard.runtime.faults import SimulatedDeviceProbe
        from raytrain_guard.runtime.probes import CudaMemoryProbe, ProcessMemoryProbe
        if self.sim_device is not None:
            return SimulatedDeviceProbe(self.sim_device)
        try:
            if self.device.type == "cuda":
                return CudaMemoryProbe(self.device, config=self.config.guard)
            return ProcessMemoryProbe(self.config.guard,
                                      local_world_size=max(1, self.ctx.local_world_size))
        except Exception:
            logger.warning("rank %d: no memory probe", self.rank, exc_info=True)
            return None

    def run(self) -> dict[str, Any]:
        start = self._clock()
        cfg = self.config
        if cfg.trace_dir:
            os.makedirs(cfg.trace_dir, exist_ok=True)
            self._trace = open(os.path.join(cfg.trace_dir, f"rank{self.rank}.jsonl"), "a")
        try:
            self._build()
            self._plan_and_wrap()
            self._build_guard()
            self.control = _control_plane(self.world_size)
            self._resume()
            self._trace_event("start", resumed_from=self.resumed_from,
                              world_size=self.world_size, micro_batch=self.micro_batch,
                              grad_accum=self.grad_accum, total_steps=self.total_steps,
                              node_id=self.ctx.node_id)
            bind = getattr(cfg.decision_source, "bind_setup", None)
            if callable(bind):
                try:
                    bind(self.setup)
                except Exception:
                    logger.warning("rank %d: decision source did not take the setup", self.rank,
                                   exc_info=True)
            if cfg.audit_dir:
                os.makedirs(cfg.audit_dir, exist_ok=True)
                self._audit = open(os.path.join(cfg.audit_dir, f"rank{self.rank}.jsonl"), "a")
            self._start_watchdog()
            try:
                self._train()
            finally:
                if self.watchdog is not None:
                    self.watchdog.close()
                if self.fault_runtime is not None:
                    self.fault_runtime.close()
                if self._audit is not None:
                    self._audit.close()
                if self.node_waits is not None:
                    self.node_waits.close()
                self.loader.close()
            if self.restart_reason is not None:
                self._checkpoint({"kind": "restart"})
                # Ray's controller takes one report per poll: this one returns once it took
                # the checkpoint's, so the restarted group resumes from it, not an older one
                self.reporter.report({"step": self.step, "kind": "restart_flush"}, None)
                raise RestartRequested(f"rank {self.rank}: checkpointed at step {self.step} and "
                                       f"restarting the group: {self.restart_reason}")
            self.results = self._finish(self._clock() - start)
            self._trace_event("end", step=self.step)
            return self.results
        except BaseException as exc:
            self._trace_event("error", error=type(exc).__name__, message=str(exc)[:400],
                              step=self.step)
            raise
        finally:
            if self._trace is not None:
                self._trace.close()
                self._trace = None

    def _device(self) -> Any:
        import torch
        if self.ctx.source == "ray":
            from ray.train.torch import get_device
            return torch.device(get_device())
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _first_layout(config: LoopConfig, world_size: int) -> tuple[int, int]:
    """The config's micro-batch and accumulation; with ``global_batch``, the layout of it on
    this many ranks (:func:`relayout`: the largest micro-batch up to the config's that divides a
    rank's share), so a run started at any size of an elastic range trains the same steps."""
    if config.global_batch is None:
        return config.micro_batch, config.grad_accum
    layout = relayout(config.global_batch, world_size, config.micro_batch)
    if layout is None:
        raise InputError("global_batch", f"{config.global_batch} samples cannot be shared "
                         f"evenly by {world_size} workers", value=config.global_batch,
                         fix="use a global batch that every worker count the run may have "
                             "divides (e.g. a multiple of the least common multiple of min..max)")
    return layout


def _control_plane(world_size: int) -> Any:
    """The process's shared control plane (every rank calls this at the same point: it may
    create the gloo side group); a one-rank plane for a world of one."""
    from raytrain_guard.runtime.control_plane import ControlPlane, shared_control_plane
    return shared_control_plane() if world_size > 1 else ControlPlane(1)


def _seed_everything(seed: int) -> None:
    import torch
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
        numpy.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass
