"""Guard a Ray Train script you already have by changing its imports.

:class:`TorchTrainer` is Ray's plus ``guard=`` (plans first and refuses a plan that does not
fit, starts the node monitors and the run's coordinator, returns Ray's ``Result`` with
``result.guard``); :func:`prepare_model`, :func:`prepare_data_loader` and
:func:`prepare_optimizer` keep Ray's signatures and add the planned wrapping, the sized loader
and step timing without marks; :func:`get_guard` is the worker's handle (``should_stop()``).
This module is the driver's Ray layer; the worker side is
:mod:`raytrain_guard.runtime.worker_guard`. The diff to apply and what each piece does:
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

from raytrain_guard.cluster.launcher import (
    DEFAULT_NAMESPACE,
    RunSummary,
    check_plan,
    summarize,
    worker_range,
)
from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import InputError, check_int
from raytrain_guard.runtime.dropin_summary import combine_summaries
from raytrain_guard.runtime.worker_guard import (
    WorkerGuard,
    WorkerSettings,
    current_guard,
    install,
    uninstall,
)

logger = logging.getLogger(__name__)

__all__ = ["GuardOptions", "GuardReport", "TorchTrainer", "get_guard", "prepare_data_loader",
           "prepare_model", "prepare_optimizer"]


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
        from raytrain_guard.runtime.model import parse_strategy
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


@dataclass(frozen=True)
class GuardReport:
    """``result.guard``: what the guard saw and did in a run."""

    run: RunSummary
    """The launcher's summary: steps, throughput, step p50/p99, data wait, detections,
    decisions (from the coordinator's status and the ranks' summaries)."""
    attribution: tuple[Mapping[str, Any], ...] = ()
    """One entry per rank: its role (``straggler_compute``, ``straggler_data``, ``waiting``,
    ``normal``) and the reason with the figures."""
    loaders: tuple[Mapping[str, Any] | None, ...] = ()
    """Per rank: the DataLoader settings in force, what was lowered and why, the data wait."""
    attempts: int = 0
    """Worker groups started: each failure ended one, and a run that finished had one more
    (at least the coordinator's attempt number, which counts the groups that reached their
    first step)."""
    worker_failures: tuple[Mapping[str, Any], ...] = ()
    """Ray Train's controller's ``after_exception`` calls: the ranks and their errors."""
    num_reports: int = 0
    """``ray.train.report`` rounds the controller saw (``after_report``)."""
    ranks: tuple[Mapping[str, Any], ...] = ()
    """Each rank's own summary (window, decisions, loader, stop), as posted at its end."""

    def format(self) -> str:
        """What a person reads: the run summary (the attribution is among its detections),
        attempts, and each rank's DataLoader settings in force."""
        lines = [self.run.format(), (f"  attempts     {self.attempts} (worker failures "
                                    f"{len(self.worker_failures)}, reports {self.num_reports})")]
        for rank, loader in enumerate(self.loaders):
            if loader:
                lines.append(f"  loader {rank:<5} num_workers {loader['num_workers']} "
                             f"prefetch_factor {loader['prefetch_factor']} persistent_workers "
                             f"{loader['persistent_workers']}, data wait "
                             f"{loader.get('data_wait_frac') or 0:.1%}")
                lines += [f"    - lowered: {w}" for w in loader.get("lowered") or ()]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
        from raytrain_guard.cluster.actors import start_coordinator, start_monitors, stop_all

        options = self.guard_options
        self.plan_line = self._check_plan()
        if not ray.is_initialized():
            ray.init(namespace=options.namespace)
        start = time.perf_counter()
        handles = {}
        finished = False
        try:
            # keep the handles: a named, non-detached actor dies with its owner's last handle
            handles["monitors"] = start_monitors(options.namespace, self.run_id, options.config,
                                                 options.probe_factory)
            handles["coordinator"] = start_coordinator(options.namespace, self.run_id,
                                                       options.config,
                                                       run_name=self.settings.run_name)
            logger.info("run %s (%s): %d node monitor(s) and coordinator started in namespace "
                        "%r", self.run_id, self.settings.run_name, len(handles["monitors"]),
                        options.namespace)
            result = super().fit()
            finished = True
        finally:
            self.report = self._collect(handles.get("coordinator"), time.perf_counter() - start,
                                        finished=finished)
            try:
                stop_all(options.namespace, self.run_id)
            except Exception:  # teardown must not hide the run's own error
                logger.warning("stopping the guard's actors failed", exc_info=True)
        result.guard = self.report
        return result

    def request_stop(self, reason: str, timeout_s: float = 10.0) -> dict[str, Any]:
        """From the driver while ``fit()`` runs (another thread): every rank checkpoints and
        stops at the next agreement step (:meth:`WorkerGuard.should_stop`). Touches ``ray.get``."""
        from raytrain_guard.cluster.client import coordinator_name
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


def build_report(run_id: str, status: Mapping[str, Any], summaries: Mapping[int, Any],
                 events: list[Mapping[str, Any]], wall_s: float, plan_line: str = "", *,
                 straggler_frac: float, finished: bool = True) -> GuardReport:
    """The :class:`GuardReport` of a run from what the coordinator gathered (``finished``:
    the run ended without an error)."""
    ranks = [summaries[r] for r in sorted(summaries)]
    combined = combine_summaries(ranks, straggler_frac=straggler_frac) if ranks else {}
    loaders = combined.get("loader") or []
    results = {"step": combined.get("steps", 0), "world_size": len(ranks) or 1,
               "loader": [lo for lo in loaders if lo],
               "decisions": combined.get("decisions") or [],
               "attribution": combined.get("attribution") or [],
               "stopped_early": combined.get("stopped_early", False),
               "stop_reason": combined.get("stop_reason")}
    batch = sum(lo["batch_size"] for lo in loaders if lo)
    run = summarize(run_id, results, status, wall_s, plan_line, batch)
    failures = tuple(e for e in events if e.get("kind") == "exception")
    return GuardReport(run=run, attribution=tuple(results["attribution"]),
                       loaders=tuple(loaders),
                       attempts=max(int(status.get("attempt") or 0),
                                    len(failures) + (1 if finished else 0)),
                       worker_failures=failures,
                       num_reports=sum(1 for e in events if e.get("kind") == "report"),
                       ranks=tuple(ranks))


def plan_options(options: GuardOptions, *, num_workers: int, use_gpu: bool) -> Any:
    """The capacity plan of ``options``' model (traced on the fake device) for ``num_workers``
    ranks: :func:`raytrain_guard.cluster.launcher.plan_run`'s arithmetic."""
    import os

    from raytrain_guard.cluster.launcher import _first_batch_factory, _optimizer_kind
    from raytrain_guard.core.memory_model import TrainingSetup
    from raytrain_guard.core.planner import plan
    from raytrain_guard.factories import load_object
    from raytrain_guard.host_memory import host_memory
    from raytrain_guard.runtime.model import parse_strategy
    from raytrain_guard.trace import trace_model

    config = options.config
    sample = options.sample_factory or _first_batch_factory(
        load_object(options.dataset_factory, field_name="guard.dataset_factory"),
        options.micro_batch)
    optimizer = _optimizer_kind(load_object(options.optimizer_factory,
                                            field_name="guard.optimizer_factory"))
    traced = trace_model(options.model_factory, sample, loss=options.loss_fn,
                         optimizer=optimizer)
    host = host_memory()[0]
    device_bytes = options.device_memory_bytes
    if device_bytes is None:
        if use_gpu:
            raise InputError("guard.device_memory_bytes", "unknown for a GPU run", value=None,
                             fix="pass device_memory_bytes (e.g. units.parse_bytes('80GiB'))")
        device_bytes = config.cpu_memory_budget_bytes or host // max(1, num_workers)
    setup = TrainingSetup(strategy=parse_strategy(options.strategy), optimizer=optimizer,
                          micro_batch=options.micro_batch, grad_accum=1, world_size=num_workers,
                          foreach=bool(use_gpu))
    return plan(model=traced.model_stats, activations=traced.activations, setup=setup,
                device_memory_bytes=int(device_bytes), host_memory_bytes=host,
                cpus_per_node=os.cpu_count(), gpus_per_node=max(1, num_workers), config=config)


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
                from raytrain_guard.cluster.client import coordinator_name
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
