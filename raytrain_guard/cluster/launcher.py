"""The launcher: plan, start the guard's actors, train with the shared loop, tear down, summarize.

::

    summary = launch({"model_factory": "examples.toy:make_model", ...}, num_workers=2)
    print(summary.format())

What runs where: docs/cluster.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from raytrain_guard.cluster.actors import start_coordinator, start_monitors, stop_all
from raytrain_guard.cluster.planning import check_plan, traced_plan
from raytrain_guard.cluster.progress import ProgressWatcher
from raytrain_guard.cluster.summary import RunSummary, results_of, summarize
from raytrain_guard.config import GuardConfig
from raytrain_guard.coordination.client import ClusterDecisionSource
from raytrain_guard.errors import InputError, check_int
from raytrain_guard.runtime.loop.layout import relayout
from raytrain_guard.runtime.loop.train_loop import train_loop_per_worker

logger = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "raytrain_guard"


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
    """Plan the run (a plan that does not fit raises :class:`PlanDoesNotFit` unless
    ``force``), start one node monitor per node and the run's coordinator, train with a
    ``TorchTrainer`` whose ranks apply the coordinator's decisions in lockstep, tear the actors
    down (also when training fails) and return the :class:`RunSummary`.

    ``plan``: a planner ``Plan`` to use instead of tracing the model (``False``: skip
    planning). ``config`` and the train loop's ``guard`` entry (which wins) make the one
    config of the run (:func:`effective_config`), used everywhere. Ray is initialized locally
    unless the caller did. ``decision_source(run_id, namespace, guard)`` replaces the default
    :class:`ClusterDecisionSource`. ``fixes``: what the caller's user can change when the plan
    does not fit. ``collective_timeout_s``: the process group's timeout (Ray Train's default:
    1800 s). Relative paths are made absolute here, from the driver's working directory.
    """
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
    with guard_actors(namespace, run_id, config, run_name=f"raytrain_guard_{run_id}",
                      probe_factory=probe_factory) as coordinator:
        if run_plan is not None:
            coordinator.set_plan.remote(run_plan.to_dict())
        watcher = ProgressWatcher(coordinator, progress, progress_interval_s)
        watcher.start()
        try:
            result = TorchTrainer(
                train_loop_per_worker, train_loop_config=loop_config,
                torch_config=TorchConfig(timeout_s=int(collective_timeout_s))
                if collective_timeout_s else None,
                scaling_config=ScalingConfig(num_workers=num_workers if fewest == most
                                             else (fewest, most), use_gpu=use_gpu,
                                             resources_per_worker=dict(resources_per_worker)
                                             if resources_per_worker else None,
                                             placement_strategy=placement_strategy),
                run_config=RunConfig(name=f"raytrain_guard_{run_id}", storage_path=storage_path,
                                     failure_config=FailureConfig(max_failures=max_failures))
            ).fit()
        finally:
            watcher.stop()
        status = watcher.read_now() or {}
        if not status:
            status = dict(watcher.latest or {}, coordinator_lost=True)
            logger.warning("run %s: the coordinator did not answer at the end; the summary "
                           "uses its last status", run_id)
    return summarize(run_id, results_of(result), status, time.perf_counter() - start,
                     plan_line, _global_batch(loop_config, most))


@contextlib.contextmanager
def guard_actors(namespace: str, run_id: str, config: GuardConfig, *, run_name: str,
                 probe_factory: Any = None) -> Iterator[Any]:
    """The run's node monitors and coordinator, started (yields the coordinator's handle) and
    stopped when the block ends; a failed teardown is logged, never raised."""
    try:
        # keep the handles: a named, non-detached actor dies with its owner's last handle
        monitors = start_monitors(namespace, run_id, config, probe_factory)
        coordinator = start_coordinator(namespace, run_id, config, run_name=run_name)
        logger.info("run %s (%s): %d node monitor(s) and coordinator started in namespace %r",
                    run_id, run_name, len(monitors), namespace)
        yield coordinator
    finally:
        try:
            stop_all(namespace, run_id)
        except Exception:  # teardown must not hide the run's own error
            logger.warning("stopping the guard's actors failed", exc_info=True)


#: the train loop's folders its ranks write to
LOOP_PATH_KEYS = ("trace_dir", "audit_dir")


def absolute_paths(train_loop_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """``train_loop_config`` with its folders absolute, from the driver's working directory."""
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
    run) -> ``(min, max)``; InputError for a bad value."""
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
    that every size shares evenly, so the run trains the same steps at any size; refused when
    some size cannot share it, or when ``max_failures`` is 0 (a lost worker is a failure)."""
    if max_failures == 0:
        raise InputError("max_failures", "an elastic run restarts at a new size through Ray "
                         "Train's failure handling, and 0 allows no restart", value=max_failures,
                         fix="pass max_failures >= 1 (one per worker loss to survive), or -1 "
                             "for no limit")
    global_batch = _global_batch(train_loop_config, most)
    uneven = [n for n in range(fewest, most + 1) if global_batch % n]
    if uneven:
        raise InputError("global_batch", f"{global_batch} samples per step cannot be shared "
                         f"evenly by {', '.join(map(str, uneven))} workers", value=global_batch,
                         fix=f"pass train_loop_config['global_batch'] as a multiple of every "
                             f"size from {fewest} to {most}")
    return {**train_loop_config, "global_batch": global_batch}


def _global_batch(train_loop_config: Mapping[str, Any], workers: int) -> int:
    """The loop's ``global_batch``, else micro_batch x grad_accum x ``workers``."""
    return train_loop_config.get("global_batch") or (
        int(train_loop_config.get("micro_batch", 32))
        * int(train_loop_config.get("grad_accum", 1)) * workers)


def layout_on(train_loop_config: Mapping[str, Any], workers: int) -> Mapping[str, Any]:
    """The loop's config with the micro-batch and accumulation the loop lays a
    ``global_batch`` out in on ``workers`` ranks; unchanged without one or when it cannot be
    shared (the loop refuses that itself)."""
    global_batch = train_loop_config.get("global_batch")
    if not global_batch:
        return train_loop_config
    layout = relayout(int(global_batch), workers, int(train_loop_config.get("micro_batch", 32)))
    if layout is None:
        return train_loop_config
    return {**train_loop_config, "micro_batch": layout[0], "grad_accum": layout[1]}


def with_planned_grad_sync(train_loop_config: Mapping[str, Any], plan: Any) -> Mapping[str, Any]:
    """The loop's config with the FSDP gradient sync the plan chose, where the config leaves it
    to the planner (``"auto"``)."""
    chosen = getattr(plan, "fsdp_grad_sync", None) if plan not in (None, False) else None
    if chosen and train_loop_config.get("fsdp_grad_sync", "auto") == "auto":
        return {**train_loop_config, "fsdp_grad_sync": chosen}
    return train_loop_config


def effective_config(config: GuardConfig | None, guard: Any) -> GuardConfig:
    """The one config of a run: ``config`` with the train loop's ``guard`` over it (None, a
    GuardConfig used as it is, or a dict of fields, each replacing ``config``'s)."""
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
