"""The launcher: plan, start the guard's actors, train with the shared loop, tear down, summarize.

::

    summary = launch({"model_factory": "examples.toy:make_model", ...}, num_workers=2)
    print(summary.format())

:func:`launch` plans first (:func:`plan_run`) and refuses a plan that does not fit with
:class:`PlanDoesNotFit` unless ``force=True``; starts one node monitor per node and the run's
coordinator (:mod:`raytrain_guard.cluster.actors`); runs a ``TorchTrainer`` with the shared
train loop and a :class:`~raytrain_guard.cluster.client.ClusterDecisionSource`, so every rank
applies the coordinator's decisions in lockstep (a ``progress`` callback sees its status
meanwhile); tears the actors down, also when training fails; and returns a :class:`RunSummary`.
What runs where: docs/cluster.md.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from raytrain_guard.cluster.client import ClusterDecisionSource
from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action
from raytrain_guard.errors import GuardError, InputError, check_int
from raytrain_guard.units import format_bytes

logger = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "raytrain_guard"

#: actions that report what was seen rather than change the run: the summary lists them under
#: detections (a rank's slow steps, a straggler node to drain); the rest are decisions applied
EVENT_ACTIONS = frozenset({Action.SLOW_STEP.value, Action.FLAG_STRAGGLER.value})


class PlanDoesNotFit(GuardError):
    """The capacity plan says the run does not fit (the CLI exits 1). Carries the plan."""

    def __init__(self, message: str, plan: Any = None) -> None:
        super().__init__(message)
        self.plan = plan

    def __reduce__(self):
        return (PlanDoesNotFit, (str(self), None))


@dataclass(frozen=True)
class RunSummary:
    """What a guarded run did, from the workers' results and the coordinator's last status."""

    run_id: str
    steps: int
    total_steps: int
    world_size: int
    global_batch: int
    wall_s: float
    samples_per_s: float | None
    step_p50_s: float | None
    step_p99_s: float | None
    data_wait_frac: float | None
    stopped_early: bool = False
    stop_reason: str | None = None
    detections: tuple[str, ...] = ()
    decisions: tuple[Mapping[str, Any], ...] = ()
    plan: str = ""
    coordinator: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        """The summary a person reads at the end of a run."""
        def s(x: float | None, unit: str = " s", spec: str = ".3f") -> str:
            return "-" if x is None else f"{x:{spec}}{unit}"
        lines = [
            f"run {self.run_id}: {self.steps}/{self.total_steps} steps on {self.world_size} "
            f"ranks (global batch {self.global_batch}) in {self.wall_s:.1f} s"
            + (f"; stopped early: {self.stop_reason}" if self.stopped_early else ""),
            f"  throughput   {s(self.samples_per_s, ' samples/s', '.1f')}",
            f"  step time    p50 {s(self.step_p50_s)}   p99 {s(self.step_p99_s)}",
            (f"  data wait    {'-' if self.data_wait_frac is None else f'{self.data_wait_frac:.1%}'}"
             " of the step time"),
        ]
        if self.plan:
            lines.append(f"  plan         {self.plan}")
        lines.append(f"  detections   {len(self.detections)}")
        lines += [f"    - {d}" for d in self.detections]
        lines.append(f"  decisions    {len(self.decisions)}")
        lines += [f"    - {decision_line(d)}" for d in self.decisions]
        return "\n".join(lines)


def _is_local(d: Mapping[str, Any]) -> bool:
    """A decision of one rank's own gate (scope ``rank``; its id counts per rank), not one of
    the coordinator (scope ``cluster`` or ``node:<id>``, one id for every rank)."""
    return d.get("scope") == "rank" or not d.get("decision_id")


def decision_line(d: Mapping[str, Any]) -> str:
    """One merged decision (:func:`merge_applied`) as the summary shows it (pure)."""
    ranks = d.get("ranks") or []
    if _is_local(d):
        where = f" on rank {ranks[0]} (its own gate)" if len(ranks) == 1 else \
            (f" on ranks {ranks} (their own gates)" if ranks else "")
        return f"{d.get('action')} at step {d.get('applied_at')}{where}: {d.get('reason')}"
    return (f"#{d.get('decision_id')} {d.get('action')} at step {d.get('applied_at')}"
            + (f" on ranks {ranks}" if ranks else "") + f": {d.get('reason')}")


# -- planning ----------------------------------------------------------------------------------

def plan_run(train_loop_config: Mapping[str, Any], *, num_workers: int,
             device_memory_bytes: int | None = None, use_gpu: bool = False,
             config: GuardConfig | None = None, sample_factory: Any = None) -> Any:
    """The capacity plan of a train-loop config (the planner's :class:`Plan`).

    The model is traced on the fake device at the config's micro-batch, from ``sample_factory``
    (``() -> batch``) or, by default, the first samples of the dataset collated together. The
    machine is the nodes the workers will run on (:func:`plan_machine`: Ray's node resources
    when Ray is initialized, workers packed as Ray places them, the tightest node planned for;
    else the driver's machine). On CPU the "device" memory is that node's RAM per rank (the
    guard's CPU budget, ``GuardConfig.cpu_memory_budget_bytes`` when set). The FSDP gradient
    sync is the config's ``fsdp_grad_sync`` (default ``auto``: the planner's choice, in
    ``Plan.fsdp_grad_sync``).
    """
    return traced_plan(train_loop_config, num_workers=num_workers,
                       device_memory_bytes=device_memory_bytes, use_gpu=use_gpu,
                       config=config, sample_factory=sample_factory)[0]


def traced_plan(train_loop_config: Mapping[str, Any], *, num_workers: int,
                device_memory_bytes: int | None = None, use_gpu: bool = False,
                config: GuardConfig | None = None, sample_factory: Any = None
                ) -> tuple[Any, Any]:
    """:func:`plan_run`'s plan and the :class:`~raytrain_guard.core.effects.RunPlan` the
    coordinator prices its actions with (the same model, activations, setup and card)."""
    import dataclasses

    from raytrain_guard.core.effects import RunPlan
    from raytrain_guard.core.memory_model import TrainingSetup
    from raytrain_guard.core.planner import plan
    from raytrain_guard.runtime.train_loop import LoopConfig
    from raytrain_guard.trace import trace_model

    config = config or GuardConfig()
    loop = LoopConfig.from_dict({k: v for k, v in train_loop_config.items()
                                 if k != "decision_source"})
    micro = loop.micro_batch
    if sample_factory is None:
        sample_factory = _first_batch_factory(loop.dataset_factory, micro)
    optimizer = _optimizer_kind(loop.optimizer_factory)
    precision = getattr(loop, "precision", "fp32")     # the run's, so plan and run agree
    traced = trace_model(loop.model_factory, sample_factory, loss=loop.loss_fn,
                         optimizer=optimizer, precision=precision)
    machine = plan_machine(num_workers=num_workers, use_gpu=use_gpu)
    if device_memory_bytes is None:
        if use_gpu:
            raise InputError("device_memory_bytes", "unknown for a GPU run", value=None,
                             fix="pass device_memory_bytes (e.g. units.parse_bytes('80GiB'))")
        device_memory_bytes = config.cpu_memory_budget_bytes or machine.memory_per_worker_bytes
    setup = TrainingSetup(strategy=loop.strategy, optimizer=optimizer, micro_batch=micro,
                          grad_accum=loop.grad_accum, world_size=num_workers,
                          precision=precision, foreach=bool(use_gpu))
    sync = getattr(loop, "fsdp_grad_sync", None) or \
        train_loop_config.get("fsdp_grad_sync") or "auto"
    result = plan(model=traced.model_stats, activations=traced.activations, setup=setup,
                  device_memory_bytes=int(device_memory_bytes),
                  host_memory_bytes=machine.host_memory_bytes,
                  cpus_per_node=machine.cpus_per_node, gpus_per_node=machine.gpus_per_node,
                  config=config, fsdp_grad_sync=sync)
    result = dataclasses.replace(result, warnings=result.warnings + machine.warnings,
                                 notes=result.notes + (machine.reason,))
    return result, RunPlan(traced.model_stats, traced.activations, result.setup,
                           int(device_memory_bytes), grad_sync=result.setup.fsdp_grad_sync)


def cluster_nodes() -> list[Any] | None:
    """The alive nodes' resources (``ray.nodes()``: CPU, GPU, memory) as
    :class:`~raytrain_guard.core.placement.NodeResources`; None when Ray is not initialized.
    The one function of the plan that calls into Ray."""
    from raytrain_guard.core.placement import NodeResources

    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    return [NodeResources.from_ray(n) for n in ray.nodes() if n.get("Alive")]


def plan_machine(*, num_workers: int, use_gpu: bool) -> Any:
    """The machine a run's plan is for (:func:`~raytrain_guard.core.placement.place_workers`):
    the nodes the workers will run on when Ray is initialized, packed as Ray's placement does;
    else the driver's machine with every worker on it (its RAM as the run may use it, its
    CPUs)."""
    import os

    from raytrain_guard.core.placement import NodeResources, place_workers
    from raytrain_guard.host_memory import host_memory

    nodes = cluster_nodes()
    if nodes:
        return place_workers(nodes, num_workers=num_workers, use_gpu=use_gpu)
    # the driver's machine: every worker there, as Ray on one machine would place them
    here = NodeResources("driver", num_cpus=float(os.cpu_count() or 1),
                         num_gpus=float(num_workers), memory_bytes=host_memory()[0])
    return place_workers([here], num_workers=num_workers, use_gpu=False, cpus_per_worker=0)


class _FirstBatch:
    """A picklable sample factory: the first ``micro_batch`` samples of the dataset, collated."""

    def __init__(self, dataset_factory: Callable[[], Any], micro_batch: int) -> None:
        self.dataset_factory, self.micro_batch = dataset_factory, micro_batch

    def __call__(self) -> Any:
        from torch.utils.data import default_collate
        ds = self.dataset_factory()
        n = min(self.micro_batch, len(ds))
        if n == 0:
            raise InputError("dataset_factory", "returned an empty dataset", value=0,
                             fix="return a dataset with at least one sample")
        return default_collate([ds[i] for i in range(n)])


def _first_batch_factory(dataset_factory: Callable[[], Any], micro_batch: int) -> _FirstBatch:
    return _FirstBatch(dataset_factory, micro_batch)


def _optimizer_kind(optimizer_factory: Callable[[Any], Any]) -> str:
    """The planner's optimizer kind of the user's optimizer (built on one dummy parameter)."""
    import torch
    try:
        opt = optimizer_factory([torch.nn.Parameter(torch.zeros(1))])
    except Exception:  # noqa: BLE001 - the train loop reports factory errors properly
        return "adamw"
    name = type(opt).__name__.lower()
    if name == "sgd":
        return "sgd-momentum" if opt.defaults.get("momentum", 0) else "sgd"
    return "adam" if name == "adam" else "adamw"


def check_plan(plan: Any, *, force: bool, fixes: Sequence[str] | None = None) -> str:
    """One line for the summary; raises :class:`PlanDoesNotFit` unless it fits or ``force``.

    The message is the plan's arithmetic and what would make it fit. By default that is the
    planner's advice, which speaks of the planner's options (``--strategy``, ``--precision``,
    ``--workers`` of ``raytrain-guard plan``), and ``force=True``. A caller whose user has other
    options passes ``fixes``, in that user's words (``("pass --workers 20 or fewer",)``): they
    replace the planner's advice and the ``force`` hint.
    """
    line = (f"{'fits' if plan.fits else 'DOES NOT FIT'}: micro_batch {plan.micro_batch} x "
            f"grad_accum {plan.grad_accum} x {plan.setup.world_size} ranks; "
            f"{format_bytes(plan.total_bytes)} of {format_bytes(plan.budget_bytes)} budget")
    if plan.fits:
        return line
    message = ("the capacity plan does not fit:\n" + plan.arithmetic
               + "".join(f"\n  - {a}" for a in (plan.warnings if fixes is None else fixes))
               + ("\npass force=True to launch anyway" if fixes is None else ""))
    if not force:
        raise PlanDoesNotFit(message, plan)
    logger.warning("%s\nlaunching anyway (force=True)", message)
    return line + " (forced)"


# -- the run -----------------------------------------------------------------------------------

def launch(train_loop_config: Mapping[str, Any], *, num_workers: int = 2,
           use_gpu: bool = False, config: GuardConfig | None = None, plan: Any = None,
           force: bool = False, device_memory_bytes: int | None = None,
           run_id: str | None = None, namespace: str = DEFAULT_NAMESPACE,
           storage_path: str | None = None, max_failures: int = 0,
           resources_per_worker: Mapping[str, float] | None = None,
           placement_strategy: str = "PACK", probe_factory: Any = None,
           progress: Callable[[Mapping[str, Any]], None] | None = None,
           progress_interval_s: float = 2.0,
           decision_source: Callable[[str, str, Mapping[str, Any]], Any] | None = None,
           fixes: Sequence[str] | None = None,
           collective_timeout_s: float | None = None) -> RunSummary:
    """Plan, start the guard's actors, train, tear down, summarize (see the module docstring).

    ``plan``: a planner :class:`Plan` to use instead of tracing the model (``False``: skip
    planning). ``config`` and the train loop's ``guard`` entry (a :class:`GuardConfig` or a
    dict of its fields, which wins over ``config``) make one effective config
    (:func:`effective_config`): the plan, the monitors, the coordinator and every worker use
    that one, so thresholds and K agree everywhere. Ray is initialized (locally, in ``namespace``)
    unless the caller already did. ``decision_source(run_id, namespace, guard) -> source``
    replaces the default :class:`ClusterDecisionSource` (e.g. a subclass that logs timings).
    ``fixes``: what the caller's user can change when the plan does not fit (:func:`check_plan`).
    ``collective_timeout_s``: the process group's timeout (Ray Train's default: 1800 s).
    ``storage_path`` and the loop's folders (:func:`absolute_paths`) are made absolute here:
    a worker would resolve a relative one in its own working directory (Ray's session folder).
    """
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from raytrain_guard.cluster.actors import start_coordinator, start_monitors, stop_all
    from raytrain_guard.runtime.train_loop import train_loop_per_worker

    train_loop_config = absolute_paths(train_loop_config)
    storage_path = os.path.abspath(storage_path) if storage_path else storage_path
    fewest, most = worker_range(num_workers)
    if fewest != most:
        train_loop_config = elastic_loop_config(train_loop_config, fewest, most, max_failures)
    config = effective_config(config, train_loop_config.get("guard"))
    run_plan = None           # what the coordinator prices its actions with, when we plan here
    if plan is None:
        # on the fewest workers, in the layout the loop takes there: each rank's share of
        # sharded state, and its accumulation, is largest there
        plan, run_plan = traced_plan(layout_on(train_loop_config, fewest), num_workers=fewest,
                                     use_gpu=use_gpu, device_memory_bytes=device_memory_bytes,
                                     config=config)
    plan_line = check_plan(plan, force=force, fixes=fixes) if plan is not False else ""
    train_loop_config = with_planned_grad_sync(train_loop_config, plan)
    if plan_line:
        logger.info("plan: %s", plan_line)

    run_id = run_id or uuid.uuid4().hex[:8]
    if not ray.is_initialized():
        ray.init(namespace=namespace, include_dashboard=False, log_to_driver=False)
    loop_config = dict(train_loop_config)
    loop_config["guard"] = config
    loop_config["decision_source"] = (decision_source or ClusterDecisionSource)(
        run_id, namespace, config)
    start = time.perf_counter()
    status: dict[str, Any] = {}
    watcher = None
    try:
        # keep the handles: a named, non-detached actor dies with its owner's last handle
        monitors = start_monitors(namespace, run_id, config, probe_factory)
        coordinator = start_coordinator(namespace, run_id, config,
                                         run_name=f"raytrain_guard_{run_id}")
        if run_plan is not None:
            coordinator.set_plan.remote(run_plan.to_dict())
        logger.info("run %s: %d node monitor(s) and coordinator started in namespace %r",
                    run_id, len(monitors), namespace)
        watcher = _ProgressWatcher(coordinator, progress, progress_interval_s)
        watcher.start()
        trainer = TorchTrainer(
            train_loop_per_worker, train_loop_config=loop_config,
            torch_config=TorchConfig(timeout_s=int(collective_timeout_s))
            if collective_timeout_s else None,
            scaling_config=ScalingConfig(num_workers=num_workers if fewest == most
                                         else (fewest, most), use_gpu=use_gpu,
                                         resources_per_worker=dict(resources_per_worker)
                                         if resources_per_worker else None,
                                         placement_strategy=placement_strategy),
            run_config=RunConfig(name=f"raytrain_guard_{run_id}", storage_path=storage_path,
                                 failure_config=FailureConfig(max_failures=max_failures)))
        result = trainer.fit()
        watcher.stop()
        status = watcher.read_now() or {}
        if not status:
            status = dict(watcher.latest or {}, coordinator_lost=True)
            logger.warning("run %s: the coordinator did not answer at the end; the summary "
                           "uses its last status", run_id)
    finally:
        if watcher is not None:
            watcher.stop()
        try:
            stop_all(namespace, run_id)
        except Exception:  # teardown must not hide the run's own error (logged)
            logger.warning("stopping the guard's actors failed", exc_info=True)
    global_batch = loop_config.get("global_batch") or (
        int(loop_config.get("micro_batch", 32)) * int(loop_config.get("grad_accum", 1)) * most)
    return summarize(run_id, _results_of(result), status, time.perf_counter() - start,
                     plan_line, global_batch)


#: the train loop's folders: what its ranks write (trace, audit) and the faults' markers
LOOP_PATH_KEYS = ("trace_dir", "audit_dir")


def absolute_paths(train_loop_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """``train_loop_config`` with its folders (:data:`LOOP_PATH_KEYS`, ``faults["marker_dir"]``)
    absolute, from the driver's working directory (pure; the config itself is not changed)."""
    config = dict(train_loop_config)
    for key in LOOP_PATH_KEYS:
        if config.get(key):
            config[key] = os.path.abspath(config[key])
    faults = config.get("faults")
    if isinstance(faults, Mapping) and faults.get("marker_dir"):
        config["faults"] = {**faults, "marker_dir": os.path.abspath(faults["marker_dir"])}
    return config


def worker_range(num_workers: Any) -> tuple[int, int]:
    """``num_workers`` as Ray Train takes it (an integer, or ``(min, max)`` for an elastic
    run) -> ``(min, max)``; a bad value raises InputError naming it (pure)."""
    fix = "e.g. 2, or (2, 4)"
    if not isinstance(num_workers, (tuple, list)):
        count = check_int("num_workers", num_workers, at_least=1, fix=fix)
        return count, count
    if len(num_workers) != 2:
        raise InputError("num_workers", "must be an integer or a (min, max) pair",
                         value=num_workers, fix=fix)
    fewest, most = (check_int(f"num_workers[{i}]", v, at_least=1, fix=fix)
                    for i, v in enumerate(num_workers))
    if fewest > most:
        raise InputError("num_workers", "min must be <= max", value=num_workers, fix=fix)
    return fewest, most


def elastic_loop_config(train_loop_config: Mapping[str, Any], fewest: int, most: int,
                        max_failures: int) -> dict[str, Any]:
    """The loop's config for an elastic run of ``fewest``..``most`` workers: a ``global_batch``
    (the config's, else micro_batch x grad_accum x ``most``) that every size shares evenly, so
    the run trains the same steps at any size; refused when some size cannot share it, or when
    ``max_failures`` is 0 (Ray Train counts a lost worker as a failure) (pure)."""
    if max_failures == 0:
        raise InputError("max_failures", "an elastic run restarts at a new size through Ray "
                         "Train's failure handling, and 0 allows no restart", value=max_failures,
                         fix="pass max_failures >= 1 (one per worker loss to survive), or -1 "
                             "for no limit")
    global_batch = train_loop_config.get("global_batch") or (
        int(train_loop_config.get("micro_batch", 32))
        * int(train_loop_config.get("grad_accum", 1)) * most)
    uneven = [n for n in range(fewest, most + 1) if global_batch % n]
    if uneven:
        raise InputError("global_batch", f"{global_batch} samples per step cannot be shared "
                         f"evenly by {', '.join(map(str, uneven))} workers", value=global_batch,
                         fix=f"pass train_loop_config['global_batch'] as a multiple of every "
                             f"size from {fewest} to {most}")
    return {**train_loop_config, "global_batch": global_batch}


def layout_on(train_loop_config: Mapping[str, Any], workers: int) -> Mapping[str, Any]:
    """The loop's config with the micro-batch and accumulation the loop lays a
    ``global_batch`` out in on ``workers`` ranks (:func:`relayout`); unchanged without one, or
    when it cannot be shared (the loop refuses that itself) (pure)."""
    from raytrain_guard.runtime.loop.layout import relayout

    global_batch = train_loop_config.get("global_batch")
    if not global_batch:
        return train_loop_config
    layout = relayout(int(global_batch), workers, int(train_loop_config.get("micro_batch", 32)))
    if layout is None:
        return train_loop_config
    return {**train_loop_config, "micro_batch": layout[0], "grad_accum": layout[1]}


def with_planned_grad_sync(train_loop_config: Mapping[str, Any], plan: Any) -> Mapping[str, Any]:
    """The loop's config with the FSDP gradient sync the plan chose, where the config leaves it
    to the planner (``fsdp_grad_sync`` missing or ``"auto"``); unchanged otherwise (pure)."""
    chosen = getattr(plan, "fsdp_grad_sync", None) if plan not in (None, False) else None
    if chosen and train_loop_config.get("fsdp_grad_sync", "auto") == "auto":
        return {**train_loop_config, "fsdp_grad_sync": chosen}
    return train_loop_config


def effective_config(config: GuardConfig | None, guard: Any) -> GuardConfig:
    """The one config of a run: ``config`` (default :class:`GuardConfig`) with the train loop's
    ``guard`` over it. ``guard`` may be None, a :class:`GuardConfig` (used as it is) or a dict
    of fields (each replaces ``config``'s; unknown keys and bad values raise ConfigError)."""
    base = config or GuardConfig()
    if guard is None:
        return base
    if isinstance(guard, GuardConfig):
        return guard
    if not isinstance(guard, Mapping):
        raise InputError("train_loop_config['guard']", "must be a GuardConfig or a dict of its "
                         "fields", value=type(guard).__name__,
                         fix="e.g. {'memory_watermark_frac': 0.85}")
    return GuardConfig.from_dict({**base.to_dict(), **guard},
                                 source="train_loop_config['guard']")


def _results_of(result: Any) -> dict[str, Any]:
    """The train loop's results dict, from the metrics of the final checkpoint."""
    metrics = getattr(result, "metrics", None) or {}
    raw = metrics.get("results")
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            logger.warning("unreadable results in the final report")
    return dict(raw or {})


def summarize(run_id: str, results: Mapping[str, Any], status: Mapping[str, Any],
              wall_s: float, plan_line: str = "", global_batch: int = 0) -> RunSummary:
    """The :class:`RunSummary` of a finished run (pure)."""
    steps = int(results.get("step", 0))
    world = int(results.get("world_size", 1))
    loaders = results.get("loader") or []
    loop_wall = float(results.get("wall_s") or wall_s)
    fracs = [lo["data_wait_frac"] for lo in loaders
             if isinstance(lo, Mapping) and lo.get("data_wait_frac") is not None]
    merged = merge_applied(results.get("decisions"))
    events = [m for m in merged if m.get("action") in EVENT_ACTIONS]
    detections = [a["reason"] for a in results.get("attribution") or []
                  if a.get("role") not in (None, "normal")]
    detections += [event_line(e) for e in events]
    flagged = {(e.get("params") or {}).get("node_id") for e in events}
    detections += [f"straggler node {n}" for n in status.get("straggler_nodes") or []
                   if n not in flagged]
    detections += list(status.get("notes") or [])
    detections += [f"hang in attempt {h.get('attempt')}: {h.get('reason')}"
                   for h in status.get("hangs") or []]
    if status.get("coordinator_lost"):
        detections.append("coordinator unreachable at the end of the run (training went on "
                          "under the local gate); step times are from its last status")
    return RunSummary(
        run_id=run_id, steps=steps, total_steps=int(results.get("total_steps", steps)),
        world_size=world, global_batch=global_batch, wall_s=round(wall_s, 3),
        samples_per_s=round(steps * global_batch / loop_wall, 2)
        if steps and global_batch and loop_wall > 0 else None,
        step_p50_s=status.get("step_p50_s"), step_p99_s=status.get("step_p99_s"),
        data_wait_frac=round(sum(fracs) / len(fracs), 4) if fracs else None,
        stopped_early=bool(results.get("stopped_early")), stop_reason=results.get("stop_reason"),
        detections=tuple(detections),
        decisions=tuple(m for m in merged if m.get("action") not in EVENT_ACTIONS),
        plan=plan_line, coordinator=dict(status))


def merge_applied(decisions: Any) -> list[dict[str, Any]]:
    """Per-rank decision records (the train loop's) -> one entry per decision (pure).

    Coordinator decisions (scope ``cluster`` or ``node:<id>``) are merged by id across ranks,
    with the steps they were applied at (one step when lockstep worked) and the ranks that
    applied them (a node's decision seen by other nodes' ranks, ``applied`` False, is not theirs).
    A rank's own gate decisions (scope ``rank``; their ids count per rank, so rank 0's #1 is not
    rank 1's #1) stay one entry per rank.
    """
    merged: dict[Any, dict[str, Any]] = {}
    for d in decisions or []:
        if not isinstance(d, Mapping):
            continue
        did = d.get("decision_id") or 0
        key = (("local", d.get("world_rank"), did, d.get("applied_at"), d.get("action"))
               if _is_local(d) else did)
        entry = merged.setdefault(key, {"decision_id": did, "action": d.get("action"),
                                        "reason": d.get("reason"), "scope": d.get("scope"),
                                        "params": dict(d.get("params") or {}),
                                        "applied_at": d.get("applied_at"), "ranks": [],
                                        "steps": []})
        if d.get("applied") is False:
            continue
        entry["ranks"].append(d.get("world_rank"))
        if d.get("applied_at") not in entry["steps"]:
            entry["steps"].append(d.get("applied_at"))
    return list(merged.values())


def event_line(e: Mapping[str, Any]) -> str:
    """A merged event (``slow_step``, ``flag_straggler``) as a detection line (pure)."""
    if e.get("action") == Action.SLOW_STEP.value:
        return str(e.get("reason"))        # "rank 1 steps 31-33: 3 slow steps in a row (...)"
    return f"{e.get('action')} at step {e.get('applied_at')}: {e.get('reason')}"


class _ProgressWatcher:
    """Reads the coordinator's status every ``interval_s`` on a thread (kept in ``latest``, for
    the summary should the coordinator die) and hands it to ``progress`` when given.

    :meth:`read_now` is the one method that touches ``ray.get`` (with a timeout).
    """

    def __init__(self, coordinator: Any, progress: Callable[[Mapping[str, Any]], None] | None,
                 interval_s: float) -> None:
        self.coordinator = coordinator
        self.progress = progress
        self.interval_s = interval_s
        self.latest: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="raytrain_guard-progress",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def read_now(self, timeout_s: float = 5.0) -> dict[str, Any] | None:
        import ray
        try:
            self.latest = dict(ray.get(self.coordinator.status.remote(), timeout=timeout_s))
        except Exception as exc:  # noqa: BLE001 - progress is best effort
            logger.debug("coordinator status unavailable: %r", exc)
            return None
        return self.latest

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            status = self.read_now()
            if status is not None and self.progress is not None:
                try:
                    self.progress(status)
                except Exception:  # a progress callback must not stop the run (logged)
                    logger.debug("progress callback failed", exc_info=True)


def progress_line(status: Mapping[str, Any], total_steps: int | None = None,
                  started: float | None = None, clock: Callable[[], float] = time.monotonic
                  ) -> str:
    """A one-line live view of a coordinator status (pure, given the clock).

    ``rank mem``: the highest of the ranks' own memory figures (device memory; on CPU the
    process against its RAM budget). ``node GPU mem``: the fullest GPU the node monitors read,
    when they read any. ``active decisions``: those still to apply or in force (the coordinator's
    ``active_decisions``), so the count goes down as well as up; the summary lists every one.
    """
    step = status.get("latest_step")
    ranks = status.get("ranks") or {}
    mem = [r.get("memory_frac") for r in ranks.values()
           if isinstance(r, Mapping) and r.get("memory_frac") is not None]
    nodes = status.get("nodes") or {}
    gpu = [g.get("memory_frac") for n in nodes.values() if isinstance(n, Mapping)
           for g in n.get("gpus") or () if isinstance(g, Mapping)
           and g.get("memory_frac") is not None]
    p50, p99 = status.get("step_p50_s"), status.get("step_p99_s")
    parts = [f"step {'-' if step is None else step}"
             + (f"/{total_steps}" if total_steps else ""),
             f"{len(ranks)} ranks",
             f"step p50 {p50:.3f} s p99 {p99:.3f} s" if p50 is not None and p99 is not None
             else "step time -",
             # a rank's own figure: its device memory, or on CPU its process of its RAM budget
             f"rank mem {max(mem):.0%}" if mem else "rank mem -"]
    if gpu:
        parts.append(f"node GPU mem {max(gpu):.0%}")       # the node monitors' NVML reading
    parts.append(f"active decisions {len(status.get('active_decisions') or [])}")
    if started is not None:
        parts.append(f"{clock() - started:.0f} s")
    return " | ".join(parts)


class ProgressPrinter:
    """A ``progress`` callback for :func:`launch` that writes :func:`progress_line` to ``out``:
    on a terminal one line redrawn in place (cut to the terminal's width, so a narrow one does
    not wrap it into copies); in a log, a line each time the step moves on (the same step is
    not written again while the run ends)."""

    def __init__(self, out: TextIO, total_steps: int | None = None,
                 started: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.out, self.total_steps, self.started, self.clock = out, total_steps, started, clock
        self.tty = out.isatty()
        self._last_step: Any = ...

    def __call__(self, status: Mapping[str, Any]) -> None:
        line = progress_line(status, self.total_steps, self.started, self.clock)
        if self.tty:
            width = shutil.get_terminal_size((100, 24)).columns - 1
            self.out.write("\r" + line[:width] + "\x1b[K")
        else:
            step = status.get("latest_step")
            if step == self._last_step:
                return
            self._last_step = step
            self.out.write(line + "\n")
        self.out.flush()
