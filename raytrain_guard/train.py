"""Guard a Ray Train script you already have by changing its imports.

:class:`TorchTrainer` is Ray's plus ``guard=`` (plans first and refuses a plan that does not
fit, starts the node monitors and the run's coordinator, returns Ray's ``Result`` with
``result.guard``); :func:`prepare_model`, :func:`prepare_data_loader` and
:func:`prepare_optimizer` keep Ray's signatures and add the planned wrapping, the sized loader
and step timing without marks; :func:`get_guard` is the worker's handle (``should_stop()``).
This module is the driver's Ray layer; the worker side is
:mod:`raytrain_guard.runtime.dropin.worker`. The diff to apply and what each piece does:
docs/drop_in.md.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ray.train
import ray.train.torch

from raytrain_guard.cluster.launcher import DEFAULT_NAMESPACE, guard_actors, worker_range
from raytrain_guard.cluster.planning import FirstBatch, check_plan, plan_model
from raytrain_guard.cluster.summary import GuardReport, build_report
from raytrain_guard.config import GuardConfig
from raytrain_guard.coordination.client import coordinator_name
from raytrain_guard.errors import InputError, check_int
from raytrain_guard.factories import load_object
from raytrain_guard.runtime.data.ray_batches import GuardedBatches
from raytrain_guard.runtime.dist.model import parse_strategy
from raytrain_guard.runtime.dropin.worker import (
    WorkerGuard,
    WorkerSettings,
    current_guard,
    install,
    uninstall,
)
from raytrain_guard.runtime.host_memory import host_memory

logger = logging.getLogger(__name__)

__all__ = ["GuardOptions", "GuardReport", "TorchTrainer", "get_guard", "iter_torch_batches",
           "prepare_data_loader", "prepare_model", "prepare_optimizer"]


# -- options -------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class GuardOptions:
    """``TorchTrainer(guard=...)``: the guard's config and what planning needs."""

    config: GuardConfig = field(default_factory=GuardConfig)
    """Every threshold (one config for the plan, the actors and every worker)."""
    model_factory: Any = None
    """``() -> nn.Module`` or ``"module:attr"``: traced on the fake device before launch to plan
    the run (with ``micro_batch`` and ``sample_factory`` or ``dataset_factory``). None: no
    tracing (``plan`` may still be checked)."""
    sample_factory: Any = None
    """``() -> one micro-batch`` for the trace."""
    dataset_factory: Any = None
    """``() -> Dataset``: its first ``micro_batch`` samples, collated, when no sample_factory."""
    micro_batch: int | None = None
    """The per-worker batch size (the DataLoader's ``batch_size``); needed to plan."""
    loss_fn: Any = None
    """``(model, batch) -> scalar`` for the trace; None: the model's outputs summed."""
    optimizer_factory: Any = "torch.optim:AdamW"
    """``(params) -> Optimizer``: which optimizer state the plan counts."""
    strategy: str = "ddp"
    """What the plan assumes: ``ddp``, ``zero1``, ``fsdp-grad-op``, ``fsdp-full``."""
    plan: Any = None
    """A planner ``Plan`` (e.g. ``raytrain-guard plan``'s) checked instead of tracing; False:
    no planning at all."""
    force: bool = False
    """Launch a plan that does not fit anyway (logged)."""
    device_memory_bytes: int | None = None
    """Memory per device the plan divides (required with ``use_gpu``)."""
    measure_bandwidth: bool = True
    """Measure the allreduce curve in ``prepare_model`` for the bucket cap."""
    namespace: str = DEFAULT_NAMESPACE
    """Ray namespace of the guard's named actors."""
    run_id: str | None = None
    """The guard's run id (actor names); default: a fresh one."""
    probe_factory: Any = None
    """``(node_id) -> (gpu_probe, host_probe)`` for the node monitors (scripted probes for a
    rehearsal); None: the real ones."""

    def __post_init__(self) -> None:
        if not isinstance(self.config, GuardConfig):
            raise InputError("guard.config", "must be a GuardConfig", value=type(self.config)
                             .__name__, fix="pass GuardConfig(...) or a dict of its fields")
        if self.model_factory is not None:
            check_int("guard.micro_batch", self.micro_batch, at_least=1,
                      fix="the plan traces one micro-batch: pass the DataLoader's batch_size, "
                          "e.g. micro_batch=32")
            if self.sample_factory is None and self.dataset_factory is None:
                raise InputError("guard.sample_factory", "missing: the plan traces one batch",
                                 value=None, fix="pass sample_factory=() -> batch, or "
                                                 "dataset_factory=() -> Dataset")
        parse_strategy(self.strategy, field_name="guard.strategy")

    @classmethod
    def coerce(cls, guard: Any) -> GuardOptions:
        """None, a GuardOptions, a GuardConfig, or a dict of fields of either (a key of both
        goes to the options; unknown keys raise ConfigError naming them)."""
        if guard is None:
            return cls()
        if isinstance(guard, GuardOptions):
            return guard
        if isinstance(guard, GuardConfig):
            return cls(config=guard)
        if not isinstance(guard, Mapping):
            raise InputError("guard", "must be GuardOptions, GuardConfig or a dict",
                             value=type(guard).__name__, fix="e.g. guard={'headroom_frac': 0.2}")
        own = {f.name for f in dataclasses.fields(cls)} - {"config"}
        options = {k: v for k, v in guard.items() if k in own}
        rest = {k: v for k, v in guard.items() if k not in own}
        config = guard.get("config")
        if isinstance(config, Mapping):
            config = GuardConfig.from_dict(config, source="guard['config']")
        if rest.keys() - {"config"}:
            base = (config or GuardConfig()).to_dict()
            config = GuardConfig.from_dict({**base, **{k: v for k, v in rest.items()
                                                       if k != "config"}}, source="guard")
        return cls(config=config or GuardConfig(), **options)


# -- the trainer -----------------------------------------------------------------------------------

class TorchTrainer(ray.train.torch.TorchTrainer):
    """Ray's TorchTrainer, guarded (see the module docstring). ``guard``: :class:`GuardOptions`,
    a :class:`GuardConfig`, a dict of fields, or None for the defaults."""

    def __init__(self, train_loop_per_worker: Callable[..., Any], *, guard: Any = None,
                 **kwargs: Any) -> None:
        self.guard_options = GuardOptions.coerce(guard)
        options = self.guard_options
        self.run_id = options.run_id or uuid.uuid4().hex[:8]
        run_config = kwargs.get("run_config") or ray.train.RunConfig()
        kwargs["run_config"] = dataclasses.replace(
            run_config, callbacks=[*(run_config.callbacks or []),
                                   GuardCallback(self.run_id, options.namespace)])
        self.settings = WorkerSettings(config=options.config, run_id=self.run_id,
                                       namespace=options.namespace,
                                       run_name=kwargs["run_config"].name,
                                       measure_bandwidth=options.measure_bandwidth)
        self.plan_line = ""
        self.report: GuardReport | None = None
        super().__init__(guarded_train_func(train_loop_per_worker, self.settings), **kwargs)

    def fit(self) -> Any:
        """Plan, start the guard's actors, train, tear down; ``result.guard`` is the
        :class:`GuardReport` (also ``self.report``, kept when training raises)."""
        options = self.guard_options
        self.plan_line = self._check_plan()
        if not ray.is_initialized():
            ray.init(namespace=options.namespace)
        start = time.perf_counter()
        with guard_actors(options.namespace, self.run_id, options.config,
                          run_name=self.settings.run_name,
                          probe_factory=options.probe_factory) as coordinator:
            finished = False
            try:
                result = super().fit()
                finished = True
            finally:
                self.report = self._collect(coordinator, time.perf_counter() - start,
                                            finished=finished)
        result.guard = self.report
        return result

    def request_stop(self, reason: str, timeout_s: float = 10.0) -> dict[str, Any]:
        """From the driver while ``fit()`` runs (another thread): every rank checkpoints and
        stops at the next agreement step (:meth:`WorkerGuard.should_stop`). Touches ``ray.get``."""
        handle = ray.get_actor(coordinator_name(self.run_id), namespace=self.guard_options
                               .namespace)
        return ray.get(handle.request_stop.remote(reason), timeout=timeout_s)

    def _check_plan(self) -> str:
        """The plan's one line; raises PlanDoesNotFit unless it fits or ``force``."""
        options = self.guard_options
        plan = options.plan
        if plan is False:
            return ""
        if plan is None:
            if options.model_factory is None:
                logger.info("run %s: no guard.model_factory, the run is not planned before "
                            "launch", self.run_id)
                return ""
            # an elastic (min, max) run is planned on min: each rank's sharded share is largest
            fewest, _ = worker_range(self.scaling_config.num_workers)
            plan = plan_options(options, num_workers=fewest,
                                use_gpu=bool(self.scaling_config.use_gpu))
        return check_plan(plan, force=options.force)

    def _collect(self, coordinator: Any, wall_s: float, *, finished: bool) -> GuardReport:
        """Status, rank summaries and controller events from the coordinator (one ``ray.get``
        with a timeout each), folded into a :class:`GuardReport`."""
        status: dict[str, Any] = {}
        summaries: dict[int, Any] = {}
        events: list[dict[str, Any]] = []
        if coordinator is not None:
            try:
                status, summaries, events = ray.get(
                    [coordinator.status.remote(), coordinator.summaries.remote(),
                     coordinator.train_events.remote()], timeout=10)
            except Exception as exc:  # noqa: BLE001 - the report is best effort
                logger.warning("run %s: the coordinator did not answer at the end (%r)",
                               self.run_id, exc)
        return build_report(self.run_id, status, summaries, events, wall_s, self.plan_line,
                            straggler_frac=self.guard_options.config.straggler_frac,
                            finished=finished)


def plan_options(options: GuardOptions, *, num_workers: int, use_gpu: bool) -> Any:
    """The capacity plan of ``options``' model (traced on the fake device) for ``num_workers``
    ranks (:func:`~raytrain_guard.cluster.planning.plan_model`)."""
    sample = options.sample_factory or FirstBatch(
        load_object(options.dataset_factory, field_name="guard.dataset_factory"),
        options.micro_batch)
    return plan_model(
        model_factory=options.model_factory, sample_factory=sample, loss_fn=options.loss_fn,
        optimizer_factory=load_object(options.optimizer_factory,
                                      field_name="guard.optimizer_factory"),
        strategy=parse_strategy(options.strategy), micro_batch=options.micro_batch,
        num_workers=num_workers, use_gpu=use_gpu,
        device_memory_bytes=options.device_memory_bytes, config=options.config,
        device_field="guard.device_memory_bytes")[0]


class GuardCallback(ray.train.UserCallback):
    """On Ray Train's controller: every report round and every worker failure go to the run's
    coordinator (fire-and-forget; attempts and restarts for the coordinator and the report)."""

    def __init__(self, run_id: str, namespace: str) -> None:
        self.run_id, self.namespace = run_id, namespace
        self._handle: Any = None

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]],
                     checkpoint: Any) -> None:
        self._send({"kind": "report", "num_workers": len(metrics),
                    "checkpoint": checkpoint is not None, "time": time.time()})

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        self._send({"kind": "exception", "ranks": sorted(worker_exceptions),
                    "errors": {str(r): repr(e)[:500] for r, e in worker_exceptions.items()},
                    "time": time.time()})

    def _send(self, event: dict[str, Any]) -> None:
        if not ray.is_initialized():       # never start Ray from here (the controller has it)
            return
        try:
            if self._handle is None:
                self._handle = ray.get_actor(coordinator_name(self.run_id),
                                             namespace=self.namespace)
            self._handle.record_train_event.remote(event)
        except Exception as exc:  # noqa: BLE001 - the controller must never fail for us
            self._handle = None
            logger.debug("run %s: controller event not delivered: %r", self.run_id, exc)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handle": None}


def guarded_train_func(fn: Callable[..., Any], settings: WorkerSettings) -> Callable[..., Any]:
    """``fn`` with a fresh :class:`WorkerGuard` installed around it in each worker, and the
    same number of parameters (Ray passes ``train_loop_config`` only to a one-parameter loop)."""
    takes_config = len(inspect.signature(fn).parameters) > 0

    if takes_config:
        def train_func(config: Any) -> Any:
            return _run_guarded(fn, settings, (config,))
    else:
        def train_func() -> Any:
            return _run_guarded(fn, settings, ())
    train_func.__name__ = train_func.__qualname__ = getattr(fn, "__name__", "train_func")
    return train_func


def _run_guarded(fn: Callable[..., Any], settings: WorkerSettings, args: tuple) -> Any:
    guard = install(settings)
    try:
        return fn(*args)
    finally:
        guard.close()
        uninstall(guard)


# -- the worker-side API ---------------------------------------------------------------------------

def get_guard() -> WorkerGuard:
    """This worker's guard (``should_stop()``, ``should_checkpoint()``, ``decisions()``,
    ``request_stop(reason)``, ``summary()``)."""
    return current_guard()


def prepare_model(model: Any, move_to_device: Any = True, parallel_strategy: str | None = "ddp",
                  parallel_strategy_kwargs: Mapping[str, Any] | None = None) -> Any:
    """``ray.train.torch.prepare_model`` with the guard: DDP gets the planned ``bucket_cap_mb``
    (from the gradients and the measured allreduce curve; a ``bucket_cap_mb`` in
    ``parallel_strategy_kwargs`` is kept) and the communication timer; ``zero1``,
    ``fsdp-grad-op`` and ``fsdp-full`` are wrapped as the planner sizes them; forward and
    backward are timed from hooks. Every rank calls it at the same point (it may measure the
    allreduce curve, a few collectives)."""
    return current_guard().prepare_model(model, move_to_device, parallel_strategy,
                                         parallel_strategy_kwargs)


def prepare_data_loader(data_loader: Any, add_dist_sampler: bool = True,
                        move_to_device: bool = True, auto_transfer: bool = True) -> Any:
    """``ray.train.torch.prepare_data_loader`` with the guard: a guarded loader (sharded by a
    distributed sampler whose ``set_epoch`` works as Ray's, batches on the device, the data
    wait timed) that keeps ``prefetch_factor``, ``persistent_workers`` and
    ``multiprocessing_context``. Settings over the host budget are lowered with a warning;
    ``num_workers=0`` (torch's default) is sized by the guard. A loader it cannot rebuild (an
    IterableDataset, a custom sampler or batch sampler) goes to Ray's, with a warning."""
    return current_guard().prepare_data_loader(data_loader, add_dist_sampler, move_to_device,
                                               auto_transfer)


def prepare_optimizer(optimizer: Any) -> Any:
    """Returns ``optimizer``, hooked: its ``step()`` ends the guard's step (the loop marks
    nothing). Wrap the one optimizer the loop steps once per training step."""
    return current_guard().prepare_optimizer(optimizer)


def iter_torch_batches(shard: Any, **kwargs: Any) -> GuardedBatches:
    """``shard.iter_torch_batches(**kwargs)`` for a Ray Data shard
    (``ray.train.get_dataset_shard("train")``), guarded: ``prefetch_batches`` held to the host
    budget (``host_prefetch_frac`` of host RAM per GPU; yours kept when it fits, else lowered
    with a warning), raised between epochs that waited for data, each batch's wait timed as the
    step's data phase. Iterate it once per epoch, as the shard
    (:class:`~raytrain_guard.runtime.data.ray_batches.GuardedBatches`)."""
    guard = current_guard().build()
    batches = GuardedBatches(shard, config=guard.config, host_memory_bytes=host_memory()[0],
                             gpus_per_node=max(1, guard.ctx.local_world_size),
                             world_rank=guard.rank, **kwargs)
    guard.attach_loader(batches)
    if guard.loader is batches:           # the first is the training data: it opens the steps
        guard.step_guard.attach_loader(batches)
    return batches
