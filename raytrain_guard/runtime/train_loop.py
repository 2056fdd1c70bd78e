"""The shared train loop template: hand :func:`train_loop_per_worker` to a TorchTrainer.

::

    trainer = TorchTrainer(train_loop_per_worker, train_loop_config={
        "model_factory": "mypkg.models:make_model",        # () -> nn.Module
        "dataset_factory": "mypkg.data:make_dataset",      # () -> Dataset (map-style)
        "optimizer_factory": "mypkg.optim:make_optimizer", # (params) -> Optimizer
        "loss_fn": "mypkg.loss:loss_fn",                   # (model, batch) -> scalar tensor
        "micro_batch": 32, "grad_accum": 4, "epochs": 2, "checkpoint_every_steps": 200,
        "strategy": "ddp", "guard": {"memory_watermark_frac": 0.85}},
        scaling_config=ScalingConfig(num_workers=8, use_gpu=True))

Factories are ``"module:attr"`` strings or callables (``functools.partial`` for arguments).
``loss_fn(model, batch)`` receives the wrapped model and the batch already on the device, and
returns the scalar loss of that micro-batch (the loop divides by ``grad_accum``; the reported
``loss`` is the step's, the mean of its micro-batch losses, so it does not depend on the split).

What the loop does, per worker: builds the guarded DataLoader (sharded, sized, resumable) and
validates the dataset and batch before any collective; measures allreduce bandwidth on the live
process group; wraps the model as planned (DDP with the recommended ``bucket_cap_mb``, ZeRO-1,
FSDP2); accumulates gradients without synchronizing all but the last micro-batch; runs the
step gate every step; checkpoints every ``checkpoint_every_steps`` through
``ray.train.report(checkpoint=...)`` (all ranks report, rank 0 writes); resumes from
``ray.train.get_checkpoint()`` at the same step and the same next sample; and stops cleanly on
a ``CHECKPOINT_AND_STOP`` once every rank agrees (a stop flag in the control plane's one
16-byte CPU allreduce on a gloo side group every ``stop_check_every_steps`` steps, default
``GuardConfig.lockstep_every_steps``, shared with the lockstep exchange's newest decision id:
see :mod:`raytrain_guard.runtime.control_plane`).

Seam for the cluster layer: ``decision_source`` (an object with ``poll(step, stats) ->
list[Decision]``) is called on every rank at every step boundary; each decision it returns is
applied at exactly that step (a decision carrying a later ``step`` waits for it). ``stats``
are the StepStats of the steps since the last read, oldest first: read every
``guard.report_every_steps`` steps and at the boundaries that may stop or checkpoint
(:meth:`GuardedTrainLoop._stats_due`), ``[]`` in between (a read builds the StepStats of the
steps waiting in the step guard's fast path but leaves them waiting: its gate is still fed in
batches). A source with ``bind_setup(fn)`` is
handed ``fn() -> {"micro_batch", "grad_accum", "prefetch_factor"}``, the batch layout this rank
runs with now, which the coordinator's shrink rule needs.

Shrinking the micro-batch (``SHRINK_MICRO_BATCH``, params ``micro_batch`` and ``grad_accum``):
at the step boundary the decision applies to (the same on every rank), each rank rebuilds its
loader with the new micro-batch at the current position of the epoch permutation (the loader's
resume state, ``samples_consumed``, counts positions of all ranks together, so it does not
depend on the batch size) and runs ``grad_accum`` micro-batches per step from then on, dividing
each loss by the new ``grad_accum``. Rank ``r`` takes every ``W``-th position of the
permutation, so a step of ``grad_accum x micro_batch`` samples per rank takes the same samples
on each rank whatever the split: the per-step sample sets and the mathematics are those of the
unshrunk run (only the summation order changes). One exception, as in any re-batching: at the
end of an epoch whose per-rank shard is not a multiple of the old micro-batch, the last partial
micro-batch is grouped differently, so the steps around it differ (no sample is lost or
repeated). A shrink that would change the global batch (``new micro_batch x new grad_accum !=
old``), a micro-batch that does not divide the old one, or a ``grad_accum`` above the
micro-batches of an epoch is refused and logged (:func:`shrink_verdict`). Checkpoints record the
current ``micro_batch``/``grad_accum`` and a resumed run continues with them; the results list
every change (``batch_changes``).
"""

from __future__ import annotations

import contextlib
import difflib
import itertools
import json
import logging
import os
import random
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Cause, Decision
from raytrain_guard.core.memory_model import Strategy
from raytrain_guard.core.steps import StepStats
from raytrain_guard.errors import GuardError, InputError
from raytrain_guard.factories import load_object
from raytrain_guard.runtime.model import parse_strategy

logger = logging.getLogger(__name__)


# -- configuration -----------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    """``train_loop_config`` of the template, validated (:meth:`from_dict`)."""

    model_factory: Callable[[], Any]
    dataset_factory: Callable[[], Any]
    optimizer_factory: Callable[[Any], Any]
    loss_fn: Callable[[Any, Any], Any]
    micro_batch: int = 32
    grad_accum: int = 1
    epochs: int = 1
    max_steps: int | None = None
    checkpoint_every_steps: int | None = None    # None: guard.checkpoint_every_steps
    seed: int = 0
    strategy: Strategy = Strategy.DDP
    bucket_cap_mb: float | None = None           # None: recommended from gradients + curve
    gradient_as_bucket_view: bool = False
    measure_bandwidth: bool = True
    stop_check_every_steps: int | None = None    # None: guard.lockstep_every_steps
    num_workers: int | None = None               # DataLoader workers; None: the guard sizes
    guard: GuardConfig = field(default_factory=GuardConfig)
    decision_source: Any = None
    audit_dir: str | None = None                 # per-rank consumed sample ids (JSON lines)
    sample_id_key: str = "id"
    faults: Mapping[str, Any] = field(default_factory=dict)
    scheduler_factory: Callable[[Any], Any] | None = None  # (optimizer) -> LR scheduler
    max_grad_norm: float | None = None           # clip the global gradient norm to this
    precision: str = "fp32"                      # the planner's: fp32, amp-bf16, bf16-master, bf16
    fsdp_grad_sync: str = "auto"                 # FSDP with accumulation: every_micro_batch
                                                 # (sharded gradients, more traffic),
                                                 # last_micro_batch, or auto (the plan's)
    epoch_tail: str = "short_step"               # an epoch's leftover micro-batches: a shorter
                                                 # last step ("short_step") or none ("drop")
    allow_global_batch_change: bool = False      # a resume at another world size may change it
    act: bool = True                             # False: measure and decide, apply nothing
    restart_after_stop: bool = False             # a guard stop checkpoints, then restarts
    device_memory_bytes: int | None = None       # a simulated card of this size on CPU
    trace_dir: str | None = None                 # per-rank JSON lines of steps and events

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoopConfig:
        """Validate ``train_loop_config``; each bad entry raises InputError naming it."""
        if not isinstance(data, Mapping):
            raise InputError("train_loop_config", "must be a dict", value=type(data).__name__,
                             fix="pass train_loop_config={...} to TorchTrainer")
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1)
                raise InputError(f"train_loop_config[{key!r}]", "unknown key",
                                 fix=f"did you mean {close[0]!r}?" if close
                                 else "known keys: " + ", ".join(sorted(known)))
        values = dict(data)
        for name in ("model_factory", "dataset_factory", "optimizer_factory", "loss_fn"):
            if name not in values:
                raise InputError(f"train_loop_config[{name!r}]", "missing",
                                 fix="pass a 'module:attr' string or a callable")
            values[name] = load_object(values[name], field_name=name)
        for name, lo in (("micro_batch", 1), ("grad_accum", 1), ("epochs", 1), ("seed", 0)):
            if name in values:
                values[name] = _as_int(name, values[name], lo)
        for name in ("max_steps", "checkpoint_every_steps", "num_workers",
                     "stop_check_every_steps"):
            if values.get(name) is not None:
                values[name] = _as_int(name, values[name], 0 if name == "num_workers" else 1)
        if "strategy" in values:
            values["strategy"] = parse_strategy(values["strategy"])
        guard = values.get("guard", {})
        if isinstance(guard, Mapping):
            values["guard"] = GuardConfig.from_dict(guard, source="train_loop_config['guard']")
        elif not isinstance(guard, GuardConfig):
            raise InputError("guard", "must be a dict of GuardConfig fields",
                             value=type(guard).__name__, fix="e.g. {'headroom_frac': 0.2}")
        if values.get("bucket_cap_mb") is not None and not float(values["bucket_cap_mb"]) > 0:
            raise InputError("bucket_cap_mb", "must be > 0", value=values["bucket_cap_mb"],
                             fix="omit it to use the recommended cap")
        source = values.get("decision_source")
        if source is not None and not callable(getattr(source, "poll", None)):
            raise InputError("decision_source", "has no poll(step, stats) method",
                             value=type(source).__name__, fix="pass a LockstepDecisionSource")
        if not isinstance(values.get("faults", {}), Mapping):
            raise InputError("faults", "must be a dict", value=values["faults"],
                             fix="e.g. {'delay': [{'seconds': 0.05, 'ranks': [1]}]}")
        if values.get("scheduler_factory") is not None:
            values["scheduler_factory"] = load_object(values["scheduler_factory"],
                                                      field_name="scheduler_factory")
        if values.get("max_grad_norm") is not None and not float(values["max_grad_norm"]) > 0:
            raise InputError("max_grad_norm", "must be > 0", value=values["max_grad_norm"],
                             fix="e.g. 1.0, or leave it out for no clipping")
        precisions = ("fp32", "amp-bf16", "bf16-master", "bf16")
        if values.get("precision", "fp32") not in precisions:
            raise InputError("precision", "unknown precision", value=values["precision"],
                             fix="use one of " + ", ".join(precisions))
        if values.get("precision") in ("bf16-master", "bf16") and \
                parse_strategy(values.get("strategy", "ddp")) not in (Strategy.FSDP_FULL,
                                                                      Strategy.FSDP_GRAD_OP):
            raise InputError("precision", "bf16-master and bf16 are FSDP2 mixed-precision "
                             "policies", value=values["precision"],
                             fix="use amp-bf16 (autocast) under ddp or zero1, or an fsdp strategy")
        if values.get("fsdp_grad_sync", "auto") not in ("auto", "every_micro_batch",
                                                        "last_micro_batch"):
            raise InputError("fsdp_grad_sync", "unknown", value=values["fsdp_grad_sync"],
                             fix="use every_micro_batch, last_micro_batch or auto")
        if values.get("epoch_tail", "short_step") not in ("short_step", "drop"):
            raise InputError("epoch_tail", "unknown", value=values["epoch_tail"],
                             fix="use 'short_step' (train the leftover micro-batches) or 'drop'")
        if values.get("device_memory_bytes") is not None:
            values["device_memory_bytes"] = _as_int("device_memory_bytes",
                                                    values["device_memory_bytes"], 1)
        return cls(**values)

    @property
    def every_checkpoint(self) -> int:
        return self.checkpoint_every_steps or self.guard.checkpoint_every_steps

    @property
    def every_stop_check(self) -> int:
        """Steps between stop agreements. Default ``guard.lockstep_every_steps``, so that the
        stop flag rides on the lockstep round (one collective, not two): the tiny all_reduce
        costs about 2 ms per call on gloo on a 2-core box (benchmarks/stop_flag_cost.py), half
        a toy step; a rank that hits critical memory then waits at most K - 1 steps."""
        return self.stop_check_every_steps or self.guard.lockstep_every_steps


def _as_int(name: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise InputError(name, f"must be an integer >= {lo}", value=value,
                         fix=f"set {name} to an integer >= {lo}")
    return value


# -- reporting: Ray Train, or a plain directory outside Ray ---------------------------------------

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


# -- the loop ------------------------------------------------------------------------------------

def train_loop_per_worker(config: dict) -> dict[str, Any]:
    """The TorchTrainer entry point: run the guarded loop of ``config`` on this worker."""
    return GuardedTrainLoop(LoopConfig.from_dict(config)).run()


class GuardedTrainLoop:
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
        self.micro_batch = config.micro_batch
        self.grad_accum = config.grad_accum
        self.batch_changes: list[dict[str, Any]] = []     # applied and refused shrinks
        self._requested_prefetch: int | None = None        # last SET_PREFETCH cap, kept on rebuild
        self._last_cluster_release_s: float | None = None   # clock of the last cluster release
        # the cadences at which a boundary reads the guard's StepStats (_stats_due)
        self._stats_every = (config.guard.report_every_steps, config.guard.lockstep_every_steps,
                             config.every_stop_check, config.every_checkpoint)
        # the experiment's seams (all None in a plain run): injected faults, a simulated card,
        # the hang watchdog, the per-rank trace; attempt: this process's try at the run
        self.fault_runtime: Any = None
        self.sim_device: Any = None
        self.watchdog: Any = None
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

    # -- set-up ----------------------------------------------------------------------------------
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
        self.steps_per_epoch = self._steps_per_epoch(self.loader, self.grad_accum)
        if self.steps_per_epoch == 0 or self.grad_accum > len(self.loader):
            raise InputError("grad_accum", f"exceeds the {len(self.loader)} micro-batches of "
                             f"an epoch on each rank", value=cfg.grad_accum,
                             fix="use a smaller grad_accum or micro_batch, or more data")
        self.total_steps = self.steps_per_epoch * cfg.epochs
        if cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        self._model = model
        # Everything above is local: a bad input fails on every rank before any collective.

    def _build_faults(self, device: Any) -> None:
        """Injected faults (``faults["inject"]``: FaultSpec dicts) and the card they count on:
        ``device_memory_bytes`` simulates one on CPU and caps the real one on CUDA."""
        import torch

        from raytrain_guard.core.faults import FaultSpec
        from raytrain_guard.runtime.faults import FaultRuntime, SimulatedDevice

        cfg = self.config
        if cfg.device_memory_bytes is not None:
            if device.type == "cuda":
                total = torch.cuda.get_device_properties(device).total_memory
                torch.cuda.set_per_process_memory_fraction(
                    min(1.0, cfg.device_memory_bytes / total), device)
            else:
                self.sim_device = SimulatedDevice(cfg.device_memory_bytes, world_rank=self.rank)
        specs = [FaultSpec.from_dict(d) for d in cfg.faults.get("inject", ())]
        if any(s.kind == "comm_delay" for s in specs) and cfg.strategy not in (
                Strategy.DDP, Strategy.ZERO1):
            raise InputError("faults", "comm_delay is injected in the DDP communication hook",
                             value=cfg.strategy.value, fix="use strategy ddp or zero1 with it")
        if specs:
            self.fault_runtime = FaultRuntime(
                specs, world_rank=self.rank, marker_dir=cfg.faults.get("marker_dir"),
                device=self.sim_device, torch_device=device)

    def _steps_per_epoch(self, loader: Any, grad_accum: int) -> int:
        """Steps of an epoch: its micro-batches in steps of ``grad_accum``; the leftover ones
        make a shorter last step (``epoch_tail="short_step"``) or are dropped."""
        if self.config.epoch_tail == "drop":
            return len(loader) // grad_accum
        return -(-len(loader) // grad_accum)

    def _make_loader(self, dataset: Any, micro_batch: int, num_workers: int | None = None) -> Any:
        from raytrain_guard.runtime.loader import GuardedDataLoader

        cfg = self.config
        return GuardedDataLoader(
            dataset, micro_batch, shuffle=True, seed=cfg.seed, config=cfg.guard,
            world_rank=self.rank, world_size=self.world_size, device=self.device,
            num_workers=cfg.num_workers if num_workers is None else num_workers)

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
        from raytrain_guard.runtime.step_guard import StepGuard
        from raytrain_guard.runtime.timing import StepTimer, attach_comm_timer

        cfg = self.config
        self.faults = _fault_injector(cfg.faults, self.rank, FaultInjector)
        self.memory_faults = [m for m in cfg.faults.get("memory", ())
                              if int(m.get("rank", 0)) == self.rank]
        timer = StepTimer(device=self.device, world_rank=self.rank)
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
        logger.info("rank %d: resumed at step %d, loader %s", self.rank, self.step,
                    self.loader.state_dict())

    def _resume_batch_layout(self, saved: Mapping[str, Any] | None, saved_world: int) -> None:
        """Continue with the checkpoint's micro_batch/grad_accum (a shrink before the restart)
        when they keep this config's global batch; otherwise keep the config's, with a warning.
        On another world size (a restore with another ScalingConfig, an elastic resize) the
        checkpoint's global batch is kept: micro-batch and accumulation are laid out again
        (:func:`relayout`), or the resume is refused unless ``allow_global_batch_change``."""
        if saved:
            self.batch_changes = [dict(c) for c in saved.get("changes", ())]
        if saved_world != self.world_size:
            mb, ga = ((int(saved["micro_batch"]), int(saved["grad_accum"])) if saved
                      else (self.micro_batch, self.grad_accum))
            self._resume_on_other_world(mb, ga, saved_world)
            return
        if not saved:
            return
        mb, ga = int(saved["micro_batch"]), int(saved["grad_accum"])
        if (mb, ga) == (self.micro_batch, self.grad_accum):
            return
        if mb * ga != self.micro_batch * self.grad_accum:
            logger.warning("rank %d: checkpoint ran with micro_batch %d x grad_accum %d, this "
                           "config asks %d x %d (another global batch): keeping the config's",
                           self.rank, mb, ga, self.micro_batch, self.grad_accum)
            return
        logger.info("rank %d: resuming with the checkpoint's micro_batch %d and grad_accum %d "
                    "(config: %d and %d)", self.rank, mb, ga, self.micro_batch, self.grad_accum)
        self._rebatch(mb, ga)

    def _resume_on_other_world(self, mb: int, ga: int, saved_world: int) -> None:
        global_batch = mb * ga * saved_world
        layout = relayout(global_batch, self.world_size, mb)
        changed = layout is None
        if changed:
            if not self.config.allow_global_batch_change:
                raise InputError(
                    "world_size", f"resumed on {self.world_size} workers, but the checkpoint's "
                    f"global batch {global_batch} (micro_batch {mb} x grad_accum {ga} x "
                    f"{saved_world} workers) is no multiple of {self.world_size}",
                    value=self.world_size, fix="resume on a number of workers that divides "
                    "it, or set allow_global_batch_change=True to accept another global batch")
            layout = (mb, max(1, round(global_batch / (mb * self.world_size))))
        new_mb, new_ga = layout
        entry = {"step": None, "kind": "world_size", "from_world_size": saved_world,
                 "world_size": self.world_size, "from_micro_batch": mb, "from_grad_accum": ga,
                 "micro_batch": new_mb, "grad_accum": new_ga, "applied": True,
                 "global_batch": new_mb * new_ga * self.world_size,
                 "reason": f"resumed on {self.world_size} workers (checkpoint: {saved_world}): "
                           f"micro_batch {new_mb} x grad_accum {new_ga} "
                           + ("changes the global batch from "
                              f"{global_batch} to {new_mb * new_ga * self.world_size} "
                              "(allow_global_batch_change)" if changed
                              else f"keeps the global batch {global_batch}")}
        (logger.warning if changed else logger.info)("rank %d: %s", self.rank, entry["reason"])
        self.batch_changes.append(entry)
        if (new_mb, new_ga) != (self.micro_batch, self.grad_accum):
            self._rebatch(new_mb, new_ga)
        self.steps_per_epoch = self._steps_per_epoch(self.loader, new_ga)
        self.total_steps = self.steps_per_epoch * self.config.epochs
        if self.config.max_steps is not None:
            self.total_steps = min(self.total_steps, self.config.max_steps)

    # -- run -------------------------------------------------------------------------------------
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

    # -- the experiment's seams: trace, watchdog ------------------------------------------------
    def _trace_event(self, kind: str, **fields: Any) -> None:
        if self._trace is None:
            return
        try:
            self._trace.write(json.dumps({"t": kind, "attempt": self.attempt,
                                          "wall": time.time(), **fields}, default=str) + "\n")
            self._trace.flush()
        except Exception:
            logger.debug("rank %d: trace write failed", self.rank, exc_info=True)

    def _start_watchdog(self) -> None:
        from raytrain_guard.runtime.watchdog import StepWatchdog

        guard = self.config.guard
        try:
            self.watchdog = StepWatchdog(floor_s=guard.hang_floor_s,
                                         step_multiple=guard.hang_step_multiple,
                                         on_hang=self._on_hang, world_rank=self.rank,
                                         node_id=self.ctx.node_id or "")
        except Exception:
            logger.warning("rank %d: no hang watchdog", self.rank, exc_info=True)

    def _on_hang(self, record: Mapping[str, Any]) -> None:
        """The watchdog's call: write the hang down; when the guard acts, end this process so
        that Ray restarts the group from the last checkpoint (the hung step never returns)."""
        logger.error("hang: %s", record["reason"])
        self._trace_event("hang", **record, acted=self.config.act)
        if self.config.act:
            time.sleep(1.0)            # the other ranks' watchdogs write their records too
            logging.shutdown()
            os._exit(_HANG_EXIT_CODE)

    def _train(self) -> None:
        """The steps. The guard's StepStats are read (:meth:`_stats_due`) only at some
        boundaries and go, in order, to the gauges and the decision source; whatever a stop at
        another boundary leaves goes to the gauges after the loop, and to the decision source's
        ``finish`` (when it has one: the cluster client's last, partial report)."""
        cfg = self.config
        micro_batches = self._micro_batches()
        guard = self.guard
        watchdog, faults = self.watchdog, self.fault_runtime
        while self.step < self.total_steps:
            step = self.step
            if watchdog is not None:
                watchdog.begin(step)
            if faults is not None:
                faults.begin_step(step)
            if self.memory_faults:
                self._fill_memory(step)
            if not guard.loader_attached:      # else the loader opens the step (attach_loader)
                guard.begin_step(step)
            weights = self._step_weights(micro_batches)   # per micro-batch: its share
            step_loss = None                   # the step's loss: mean over its samples
            for micro, weight in enumerate(weights):
                batch = next(micro_batches)
                if not guard.loader_attached:  # else the loader marked it
                    guard.mark("data")
                if watchdog is not None:
                    watchdog.enter("forward")
                if faults is not None:
                    batch = faults.transform(batch)
                if self._audit is not None:
                    self._log_ids(step, batch)
                loss = self._micro_step(batch, weight, micro == len(weights) - 1)
                step_loss = loss if step_loss is None else step_loss + loss
            if watchdog is not None:
                watchdog.enter("optimizer")
            if cfg.max_grad_norm is not None:
                self._grad_norm = _clip_grad_norm(self.planned.module, cfg.max_grad_norm)
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            # no optimizer mark: from the last backward mark to end_step is the optimizer's
            self._last_loss = step_loss
            self.step = step + 1
            if self._split_pending:
                self._measure_splits()
            decisions = guard.end_step(step)
            if watchdog is not None:
                watchdog.end()
            new_stats = (guard.drain_stats() if self._stats_due(self.step, decisions)
                         else [])
            if new_stats:
                self.metrics.record(new_stats)
            if self._trace is not None:
                self._trace_steps(new_stats)
            if self._boundary(self.step, decisions, new_stats):
                break
        left = guard.drain_stats()          # a stop the source decided at another step
        if left:
            self.metrics.record(left)
        if self._trace is not None:
            self._trace_steps(left)
        finish = getattr(cfg.decision_source, "finish", None)
        if callable(finish):
            try:
                finish(left)
            except Exception:
                logger.warning("rank %d: decision source finish failed", self.rank,
                               exc_info=True)

    def _step_weights(self, micro_batches: Iterator[Any]) -> list[float]:
        """Each micro-batch's share of this step's samples, so that the step's loss (and
        gradient) is the mean over its samples: ``grad_accum`` micro-batches, fewer at an
        epoch's end (``epoch_tail="short_step"``; with ``"drop"`` the leftover ones are read
        and skipped). Sizes follow from the epoch's position: every rank holds
        ``ceil(N / world_size)`` samples an epoch (the sampler pads), in micro-batches of
        ``micro_batch``, the last one shorter."""
        loader, mb = self.loader, self.micro_batch
        per_epoch = len(loader)
        # the position in samples of all ranks: right also after a resume on another layout
        consumed = loader.state_dict()["samples_consumed"]
        position = -(-consumed // (mb * self.world_size)) % per_epoch if per_epoch else 0
        left = per_epoch - position
        if left < self.grad_accum and self.config.epoch_tail == "drop":
            for _ in range(left):
                next(micro_batches)
            position, left = 0, per_epoch
        per_rank = -(-loader.num_samples // self.world_size)
        sizes = [max(0, min(mb, per_rank - (position + j) * mb))
                 for j in range(min(self.grad_accum, left))]
        total = sum(sizes) or 1
        return [size / total for size in sizes]

    def _micro_step(self, batch: Any, weight: float, last: bool) -> Any:
        """Forward and backward of one micro-batch; its loss x ``weight`` (its share of the
        step's samples), detached. On a simulated card an oversized batch runs in pieces
        (:meth:`_pieces`), each weighted by its samples, so the gradient and the global batch
        are those of the whole micro-batch."""
        guard, faults, sim = self.guard, self.fault_runtime, self.sim_device
        pieces = self._pieces(batch) if sim is not None else ((batch, 1.0),)
        total = None
        for i, (piece, share) in enumerate(pieces):
            started = time.perf_counter() if faults is not None else 0.0
            with self.planned.grad_sync(last and i == len(pieces) - 1), \
                    (sim.tracking() if sim is not None else contextlib.nullcontext()):
                with self._forward_precision():
                    loss = self.config.loss_fn(self.planned.module, piece)
                _check_loss(loss, self.step)
                guard.mark("forward")
                if self.watchdog is not None:
                    self.watchdog.enter("backward")
                scaled = loss * (weight * share)
                scaled.backward()
                if faults is not None:
                    faults.after_backward(time.perf_counter() - started)
            guard.mark("backward")
            if sim is not None:
                self._learn_activations(piece)
            total = scaled.detach() if total is None else total + scaled.detach()
        return total

    def _forward_precision(self) -> Any:
        """Autocast to bf16 under ``precision="amp-bf16"``; nothing otherwise (FSDP2's
        mixed-precision policies cast inside the wrapped model)."""
        if not self._autocast:
            return contextlib.nullcontext()
        import torch
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def _learn_activations(self, batch: Any) -> None:
        """Activation bytes per batch element, the largest seen: what prices the next batch."""
        elements = _batch_elements(batch)
        if elements:
            self._batch_elements.append(elements)
            per_elem = self.sim_device.last_activation_bytes / elements
            if self._act_per_elem is None or per_elem > self._act_per_elem:
                self._act_per_elem = per_elem

    def _pieces(self, batch: Any) -> Any:
        """``((batch, 1.0),)``, or the batch in ``k`` pieces with their sample weights when it
        is larger than the batches so far (a spike in the data: longer sequences) and its
        activations, priced per element before the forward, would take the card past the
        watermark. Memory that grows under normal batches is the memory rules' to handle (a
        checkpoint before the out-of-memory). Only under DDP or ZeRO-1 (a rank may run extra
        forwards alone there; under FSDP every rank would have to agree first) and only when
        the guard acts."""
        from raytrain_guard.runtime.batches import leading_batch_size, map_tensors

        sim, per_elem = self.sim_device, self._act_per_elem
        if per_elem is None:
            return ((batch, 1.0),)
        elements = _batch_elements(batch)
        if elements <= _SPIKE_FACTOR * statistics.median(self._batch_elements):
            return ((batch, 1.0),)
        predicted = per_elem * elements
        room = sim.capacity_bytes * self.config.guard.memory_watermark_frac - sim.base_bytes
        if predicted <= room:
            return ((batch, 1.0),)
        size = leading_batch_size(batch) or 1
        pieces = min(size, max(2, -(-int(predicted) // max(1, int(room)))))
        fits = self.config.strategy in (Strategy.DDP, Strategy.ZERO1) and room > 0
        predicted_frac = (sim.base_bytes + predicted) / sim.capacity_bytes
        piece_frac = (sim.base_bytes + predicted / pieces) / sim.capacity_bytes
        reason = (f"rank {self.rank} step {self.step}: this micro-batch's activations are "
                  f"priced at {predicted / 2**20:.1f} MiB before its forward ({per_elem:.1f} "
                  f"bytes per element), which takes the card to {predicted_frac:.0%} "
                  f"(watermark {self.config.guard.memory_watermark_frac:.0%})")
        act = self.config.act and fits
        entry = {
            "action": "split_micro_batch", "step": self.step, "applied_at": self.step,
            "scope": "rank", "cause": "device_memory", "world_rank": self.rank,
            "decision_id": 0, "applied": act,
            "reason": reason + (f"; run in {pieces} pieces of the same optimizer step" if act
                                else "; not split (the guard observes only)" if fits else
                                "; not split (FSDP ranks would have to agree)"),
            "params": {"pieces": pieces if act else 1, "micro_batch": size},
            "predicted": {"peak_frac": round(piece_frac if act else predicted_frac, 4)}}
        if not act:                    # seen coming, written down now: the step may not end
            self.decisions.append(entry)
            self._trace_event("decision", **entry)
            return ((batch, 1.0),)
        self._split_pending.append(entry)
        bounds = [size * i // pieces for i in range(pieces + 1)]
        return tuple((map_tensors(batch, lambda t, lo=lo, hi=hi: t[lo:hi]), (hi - lo) / size)
                     for lo, hi in itertools.pairwise(bounds) if hi > lo)

    def _measure_splits(self) -> None:
        """The step's measured peak beside each split's prediction, then into the results."""
        peak = self.sim_device.step_peak_bytes / self.sim_device.capacity_bytes
        for entry in self._split_pending:
            entry["measured"] = {"peak_frac": round(peak, 4)}
            self.decisions.append(entry)
            self._trace_event("decision", **entry)
            logger.warning("%s (measured peak %.0f%%)", entry["reason"], 100 * peak)
        self._split_pending = []

    def _trace_steps(self, stats: list[StepStats]) -> None:
        for s in stats:
            self._trace_event("step", step=s.step, total_s=round(s.total_s, 6),
                              data_wait_s=round(s.data_wait_s, 6),
                              compute_s=round(s.compute_s, 6),
                              comm_wait_s=round(s.comm_wait_s, 6), memory_frac=s.memory_frac,
                              micro_batch=self.micro_batch, grad_accum=self.grad_accum)

    def _stats_due(self, step: int, local: list[Decision]) -> bool:
        """Whether the boundary after ``step`` steps reads the guard's StepStats: every
        ``report_every_steps`` steps (the guard keeps max(step_window, report_every_steps) of
        them, so none is lost), where the gate decided something, and where the run may stop or
        checkpoint: the last step, an agreement step (lockstep and stop flag), a checkpoint step,
        a pending cluster decision due now. A read does not feed the guard's waiting steps to
        its gate (:meth:`StepGuard.drain_stats`): the gate batches stay ``gate_batch_steps``."""
        if local or step >= self.total_steps:
            return True
        for every in self._stats_every:
            if step % every == 0:
                return True
        return any(d.step is not None and d.step <= step for d in self.pending)

    def _fill_memory(self, step: int) -> None:
        """Rehearsal (``faults["memory"]``): hold ballast so this rank's memory reading reaches
        ``frac`` of its budget at ``step``."""
        for spec in [m for m in self.memory_faults if int(m["step"]) == step]:
            if self.guard.probe is None or self.faults is None:
                continue
            # on the rank's device (a CUDA ballast tensor on GPU), counting reserved memory
            self.faults.fill_to(self.guard.probe, float(spec["frac"]), device=self.device)
            logger.warning("rank %d step %d: fault injected: memory filled to %.2f of the "
                           "budget", self.rank, step, float(spec["frac"]))

    def _micro_batches(self) -> Iterator[Any]:
        """Micro-batches across epochs (the loader moves to the next epoch by itself). After a
        rebuild (:meth:`_rebatch`) the old loader's iterator ends and the next pass reads
        ``self.loader`` anew, at the position the old one reached."""
        while True:
            delivered = False
            for batch in self.loader:
                delivered = True
                yield batch
            if not delivered:
                return

    def _boundary(self, step: int, local: list[Decision], stats: list[StepStats]) -> bool:
        """After ``step`` steps: local and cluster decisions, the stop agreement, checkpoints.
        Returns True when the run stops here."""
        cfg = self.config
        checkpoint_now = step % cfg.every_checkpoint == 0 and step < self.total_steps
        act = cfg.act
        for decision in local:
            self._record(step, decision, applied=act or decision.action is Action.SLOW_STEP)
            if not act:
                continue
            if decision.action is Action.CHECKPOINT_AND_STOP and self._local_stop is None:
                self._local_stop = decision
            elif decision.action is Action.SLOW_STEP and decision.cause is Cause.DATA:
                self._add_loader_workers(step, decision)
        due = [d for d in self.pending if d.step is not None and d.step <= step]
        self.pending = [d for d in self.pending if d not in due]
        control = self.control
        control.local_stop = self._local_stop is not None    # rides on a lockstep round too
        rounds_before = control.num_rounds
        if cfg.decision_source is not None:
            for decision in cfg.decision_source.poll(step, stats) or ():
                (self.pending.append(decision) if decision.step is not None
                 and decision.step > step else due.append(decision))
        stop = False
        for decision in due:
            self._record(step, decision, applied=act and self._concerns_me(decision))
            if not act:
                continue
            checkpoint_now |= self._apply_cluster(decision)
            stop |= decision.action is Action.CHECKPOINT_AND_STOP
        if stop:
            self.stop_reason = next(d.reason for d in due
                                    if d.action is Action.CHECKPOINT_AND_STOP)
        else:
            # a lockstep exchange at this boundary already carried the stop flag (the same
            # on every rank: it is a collective); else the loop's own round at a check step
            agreed = control.num_rounds != rounds_before
            if not agreed and step % cfg.every_stop_check == 0:
                control.agree()
                agreed = True
            if agreed and control.agreed_stop:
                stop = True
                self.stop_reason = (self._local_stop.reason if self._local_stop is not None
                                    else _OTHER_RANK_STOP)
        if stop:
            logger.warning("rank %d: checkpoint and stop at step %d: %s", self.rank, step,
                           self.stop_reason)
            if cfg.restart_after_stop and step < self.total_steps:
                self.restart_reason = self.stop_reason
            return True
        if checkpoint_now:
            self._checkpoint({"kind": "periodic"})
        return False

    def _add_loader_workers(self, step: int, decision: Decision) -> None:
        """Slow steps caused by data on this rank: rebuild its loader at the same position with
        the workers that keep up with the step (:func:`loader_workers_needed` from the last slow
        steps; at most ``max_workers_per_gpu``: the loader keeps prefetch inside the host
        budget), at most once per ``decision_cooldown_steps``. Rank-local: the batches and their
        order do not change, only who reads them."""
        from raytrain_guard.core.dataloader_sizing import loader_workers_needed

        guard = self.config.guard
        if self._loader_workers_at is not None and \
                step - self._loader_workers_at < guard.decision_cooldown_steps:
            return
        old = self.loader
        workers = old.plan.num_workers
        recent = self.guard.gate.window[-guard.num_slow_steps:]
        wait = statistics.median(s.data_wait_s for s in recent) if recent else 0.0
        rest = statistics.median(s.total_s - s.data_wait_s for s in recent) if recent else 0.0
        new_workers = min(guard.max_workers_per_gpu,
                          loader_workers_needed(workers, wait, rest, least=guard.min_workers_per_gpu))
        if new_workers <= workers:
            return
        self._loader_workers_at = step
        try:
            new = self._make_loader(old.dataset, self.micro_batch, num_workers=new_workers)
            new.load_state_dict(old.state_dict())
        except Exception:
            logger.warning("rank %d: loader with more workers failed", self.rank, exc_info=True)
            return
        old.close()
        self.loader = new
        if self.guard.loader_attached:
            self.guard.attach_loader(new)
        self.metrics.record_loader(new.plan.num_workers, new.plan.prefetch_factor)
        entry = {"action": "add_loader_workers", "step": step, "applied_at": step,
                 "scope": "rank", "cause": "data", "world_rank": self.rank, "decision_id": 0,
                 "applied": True, "params": {"num_workers": new_workers,
                                             "prefetch_factor": new.plan.prefetch_factor},
                 "reason": (f"rank {self.rank} step {step}: data wait made its steps slow "
                            f"({decision.reason}); DataLoader workers {workers} -> "
                            f"{new_workers}, prefetch_factor {new.plan.prefetch_factor} "
                            f"(host budget {new.plan.budget_bytes / 2**20:.0f} MiB)")}
        self.decisions.append(entry)
        self._trace_event("decision", **entry)
        logger.warning("%s", entry["reason"])

    def _concerns_me(self, decision: Decision) -> bool:
        """Whether this rank acts on ``decision``: a ``node:<id>`` decision only on the ranks of
        that node (the worker context's node id); rank and cluster decisions everywhere."""
        scope = decision.scope
        return not scope.startswith("node:") or scope[len("node:"):] == self.ctx.node_id

    def _apply_cluster(self, decision: Decision) -> bool:
        """Apply a decision from the decision source; True when it asks for a checkpoint."""
        from raytrain_guard.runtime.step_guard import release_cache

        action = decision.action
        if not self._concerns_me(decision):
            logger.debug("rank %d (node %s): %s is not for this node", self.rank,
                         self.ctx.node_id, decision)
            return False
        if action is Action.RELEASE_CACHE:
            now = self._clock()
            spacing = self.config.guard.release_cache_min_interval_s
            if self._last_cluster_release_s is None or \
                    now - self._last_cluster_release_s >= spacing:
                self._last_cluster_release_s = now
                release_cache()
            else:
                logger.info("rank %d: cluster release_cache skipped: the last one was %.1f s "
                            "ago (release_cache_min_interval_s %g)", self.rank,
                            now - self._last_cluster_release_s, spacing)
        elif action is Action.PACE:
            try:
                self.guard.set_pace(decision.params.get("delay_s", 0.0))
            except InputError as exc:
                logger.warning("rank %d: pace decision ignored: %s", self.rank, exc)
        elif action is Action.SET_PREFETCH:
            if "prefetch_factor" in decision.params:
                self._requested_prefetch = decision.params["prefetch_factor"]
                self.loader.request_prefetch_factor(decision.params["prefetch_factor"])
            if "device_prefetch_depth" in decision.params:
                self.loader.set_device_prefetch_depth(int(decision.params["device_prefetch_depth"]))
        elif action is Action.CHECKPOINT:
            return True
        elif action is Action.SHRINK_MICRO_BATCH:
            self._shrink(decision)
        return False

    def _shrink(self, decision: Decision) -> None:
        """Apply a SHRINK_MICRO_BATCH at this boundary, or refuse it with the reason (logged and
        kept in ``batch_changes``). Every rank decides alike (same layout, same dataset length)
        and applies it or none does: each rank builds its new loader, then one round of the
        control plane says whether every rank could; if one could not, every rank keeps its
        layout (a rank left on the old one would break exactly-once delivery under DDP and
        mismatch the collectives under FSDP)."""
        old = (self.micro_batch, self.grad_accum)
        entry = {"step": self.step, "decision_id": decision.decision_id,
                 "from_micro_batch": old[0], "from_grad_accum": old[1],
                 "micro_batch": decision.params.get("micro_batch"),
                 "grad_accum": decision.params.get("grad_accum")}
        samples_per_rank = -(-self.loader.num_samples // self.world_size)
        verdict = shrink_verdict(old[0], old[1], decision.params,
                                 samples_per_rank=samples_per_rank)
        if isinstance(verdict, str):
            logger.warning("rank %d step %d: shrink refused: %s", self.rank, self.step, verdict)
            self.batch_changes.append({**entry, "applied": False, "reason": verdict})
            return
        new, failure = None, None
        try:
            new = self._prepare_loader(verdict[0])
        except Exception as exc:
            failure = repr(exc)
            logger.warning("rank %d step %d: cannot re-batch: %s", self.rank, self.step,
                           failure, exc_info=True)
        failed_anywhere, _ = self.control.all_reduce_max(0 if failure is None else 1, 0)
        if failed_anywhere:
            if new is not None:
                new.close()
            reason = (f"this rank could not re-batch: {failure}" if failure else
                      "another rank could not re-batch")
            logger.warning("rank %d step %d: shrink dropped on every rank, keeping micro_batch "
                           "%d x grad_accum %d: %s", self.rank, self.step, old[0], old[1], reason)
            self.batch_changes.append({**entry, "applied": False, "reason": reason})
            return
        self._commit_loader(new, *verdict)
        logger.warning("rank %d step %d: micro_batch %d -> %d, grad_accum %d -> %d (global batch "
                       "%d unchanged, loader rebuilt at sample %d of epoch %d): %s", self.rank,
                       self.step, old[0], verdict[0], old[1], verdict[1],
                       old[0] * old[1] * self.world_size,
                       self.loader.state_dict()["samples_consumed"], self.loader.epoch,
                       decision.reason)
        self.batch_changes.append({**entry, "applied": True, "reason": decision.reason})

    def _rebatch(self, micro_batch: int, grad_accum: int) -> None:
        """Replace the loader by one of ``micro_batch`` at the same epoch position; from the
        next step on, ``grad_accum`` micro-batches make a step."""
        self._commit_loader(self._prepare_loader(micro_batch), micro_batch, grad_accum)

    def _prepare_loader(self, micro_batch: int) -> Any:
        """A loader of ``micro_batch`` at the current loader's position and settings."""
        old = self.loader
        new = self._make_loader(old.dataset, micro_batch)
        try:
            new.load_state_dict(old.state_dict())
            if new.device_prefetch_depth != old.device_prefetch_depth:
                new.set_device_prefetch_depth(old.device_prefetch_depth)
            if self._requested_prefetch is not None:
                new.request_prefetch_factor(self._requested_prefetch)
        except Exception:
            new.close()
            raise
        return new

    def _commit_loader(self, new: Any, micro_batch: int, grad_accum: int) -> None:
        old = self.loader
        old.close()                    # its live iterator ends; _micro_batches reads the new one
        self.loader = new
        guard = getattr(self, "guard", None)       # none yet while a resume lays out
        if guard is not None and guard.loader_attached:     # the same timer, the new loader
            guard.attach_loader(new)
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        steps_per_epoch = self._steps_per_epoch(new, grad_accum)
        if steps_per_epoch != self.steps_per_epoch:
            logger.warning("rank %d: %d steps per epoch with micro_batch %d x grad_accum %d "
                           "(was %d: the epoch's last partial micro-batch splits differently); "
                           "the run keeps its %d steps", self.rank, steps_per_epoch,
                           micro_batch, grad_accum, self.steps_per_epoch, self.total_steps)
        self.steps_per_epoch = steps_per_epoch

    def setup(self) -> dict[str, Any]:
        """The batch layout and memory this rank runs with now (what the coordinator's policy
        prices its actions with: :mod:`raytrain_guard.core.effects`). Read when the client
        reports, not per step; the CUDA counters are the allocator's, no synchronization."""
        import torch

        prefetch = self.loader.plan.prefetch_factor
        plan = self.loader.plan
        setup = {"micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
                 "prefetch_factor": prefetch if prefetch and prefetch > 0 else None,
                 "device": self.device.type, "num_workers": plan.num_workers,
                 "batch_bytes": self.loader.probe_batch_bytes}
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else \
                torch.cuda.current_device()
            setup.update(device_index=index,
                         allocated_bytes=torch.cuda.memory_allocated(index),
                         reserved_bytes=torch.cuda.memory_reserved(index),
                         device_total_bytes=torch.cuda.get_device_properties(index).total_memory)
        elif self.sim_device is not None:   # a simulated card: no cache, nothing to release
            used = self.sim_device.base_bytes
            setup.update(device="cpu", allocated_bytes=used, reserved_bytes=used,
                         device_total_bytes=self.sim_device.capacity_bytes)
        return setup

    def _record(self, step: int, decision: Decision, *, applied: bool = True) -> None:
        """Keep ``decision`` for the results; ``applied`` False: seen at ``step`` but meant for
        another node's ranks."""
        entry = decision.to_dict()
        entry.update(applied_at=step, world_rank=self.rank, applied=applied)
        self.decisions.append(entry)
        if applied:
            self.metrics.record_decision(decision)
        if self._trace is not None:
            self._trace_event("decision", **entry)

    def _log_ids(self, step: int, batch: Any) -> None:
        ids = batch.get(self.config.sample_id_key) if isinstance(batch, Mapping) else None
        if ids is None:
            return
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        self._audit.write(json.dumps({"step": step, "epoch": self.loader.epoch, "ids": ids,
                                      "resumed_from": self.resumed_from,
                                      "attempt": self.attempt}) + "\n")
        self._audit.flush()

    # -- checkpoints and results -----------------------------------------------------------------
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
        attribution = [dict(world_rank=a.world_rank, role=a.role.value, reason=a.reason)
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

    def _device(self) -> Any:
        import torch
        if self.ctx.source == "ray":
            from ray.train.torch import get_device
            return torch.device(get_device())
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


_OTHER_RANK_STOP = "another rank's gate asked to checkpoint and stop"
#: a batch this many times larger than the median batch so far is a spike in the data
_SPIKE_FACTOR = 1.25
_HANG_EXIT_CODE = 75     # EX_TEMPFAIL: the watchdog ended a hung process; Ray restarts the group


class RestartRequested(GuardError):
    """Raised on every rank after a guard stop with ``restart_after_stop``: the checkpoint is
    written, and Ray's FailureConfig restarts the group from it in fresh processes."""


def relayout(global_batch: int, world_size: int, micro_batch: int) -> tuple[int, int] | None:
    """``(micro_batch, grad_accum)`` that keep ``global_batch`` on ``world_size`` ranks: the
    largest micro-batch up to ``micro_batch`` (the one the plan fits) that divides a rank's
    share; None when the ranks cannot share it evenly (pure)."""
    if global_batch % world_size:
        return None
    per_rank = global_batch // world_size
    mb = max(d for d in range(1, min(micro_batch, per_rank) + 1) if per_rank % d == 0)
    return mb, per_rank // mb


def _clip_grad_norm(module: Any, max_norm: float) -> Any:
    """Clip the global gradient norm (every rank alike: DDP and ZeRO-1 hold the all-reduced
    gradients, FSDP2's DTensor gradients are reduced across their shards by torch)."""
    import torch
    params = [p for p in module.parameters() if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def _batch_elements(batch: Any) -> int:
    from raytrain_guard.runtime.batches import iter_tensors
    return sum(t.numel() for t in iter_tensors(batch))


# -- helpers -------------------------------------------------------------------------------------

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


def _control_plane(world_size: int) -> Any:
    """The process's shared control plane (every rank calls this at the same point: it may
    create the gloo side group); a one-rank plane for a world of one."""
    from raytrain_guard.runtime.control_plane import ControlPlane, shared_control_plane
    return shared_control_plane() if world_size > 1 else ControlPlane(1)


def shrink_verdict(micro_batch: int, grad_accum: int, params: Mapping[str, Any], *,
                   samples_per_rank: int) -> tuple[int, int] | str:
    """``(new micro_batch, new grad_accum)`` of a SHRINK_MICRO_BATCH, or why it is refused.

    Accepted only when both are positive integers, the new micro-batch is smaller and divides
    the old one, the global batch is kept (``new_mb x new_ga == micro_batch x grad_accum``) and
    an epoch of ``samples_per_rank`` still holds ``new_ga`` micro-batches. Pure: every rank
    computes the same verdict from the same figures.
    """
    mb, ga = params.get("micro_batch"), params.get("grad_accum")
    for name, value in (("micro_batch", mb), ("grad_accum", ga)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"params[{name!r}] must be a positive integer, got {value!r}"
    if mb >= micro_batch:
        return f"micro_batch {mb} is not smaller than the current {micro_batch}"
    if micro_batch % mb:
        return (f"micro_batch {mb} does not divide the current {micro_batch}, so its "
                f"micro-batches would not tile the old ones")
    if mb * ga != micro_batch * grad_accum:
        return (f"micro_batch {mb} x grad_accum {ga} = {mb * ga} samples per rank and step, not "
                f"the current {micro_batch} x {grad_accum} = {micro_batch * grad_accum}: the "
                f"global batch (and so the mathematics) would change")
    per_epoch = -(-samples_per_rank // mb)
    if ga > per_epoch:
        return (f"grad_accum {ga} exceeds the {per_epoch} micro-batches of {mb} in an epoch "
                f"of {samples_per_rank} samples per rank")
    return mb, ga


def _call_factory(name: str, factory: Callable[..., Any], *args: Any) -> Any:
    try:
        return factory(*args)
    except GuardError:
        raise
    except Exception as exc:
        raise InputError(name, f"raised {type(exc).__name__}: {exc}",
                         value=getattr(factory, "__name__", repr(factory)),
                         fix="fix the factory; it runs on every worker") from exc


def _check_loss(loss: Any, step: int) -> None:
    import torch
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise InputError("loss_fn", f"must return a scalar tensor (step {step})", value=shape,
                         fix="reduce the loss, e.g. .mean(), and return a tensor")


def _seed_everything(seed: int) -> None:
    import torch
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
        numpy.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass


def _fault_injector(faults: Mapping[str, Any], rank: int, factory: Callable[..., Any]) -> Any:
    """``faults = {"delay": [{"seconds", "phase", "ranks", "steps": [lo, hi)}],
    "ballast_bytes": {"<rank>": n}, "memory": [{"rank", "step", "frac"}]}`` -> a FaultInjector
    (None when empty). ``memory`` fills the rank's memory to ``frac`` of its budget at ``step``."""
    if not faults:
        return None
    injector = factory(world_rank=rank)
    for spec in faults.get("delay", ()):
        steps = spec.get("steps")
        injector.delay(float(spec["seconds"]), phase=spec.get("phase", "forward"),
                       ranks=spec.get("ranks"), steps=range(*steps) if steps else None)
    ballast = dict(faults.get("ballast_bytes", {})).get(str(rank))
    if ballast:
        injector.allocate_ballast(int(ballast))
    return injector
