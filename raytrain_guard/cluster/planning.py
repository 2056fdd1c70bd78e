"""The plan of a run before it launches: its model traced on the fake device, planned for the
nodes its workers will run on (:func:`plan_model`, the launcher's and the drop-in's one path),
and refused when it does not fit (:func:`check_plan`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.effects import RunPlan
from raytrain_guard.errors import GuardError, InputError
from raytrain_guard.planner.memory_model import Strategy, TrainingSetup
from raytrain_guard.planner.placement import NodeResources, PlanMachine, place_workers
from raytrain_guard.planner.plan import Plan, plan
from raytrain_guard.planner.trace import trace_model
from raytrain_guard.runtime.host_memory import host_memory
from raytrain_guard.runtime.loop.config import LoopConfig
from raytrain_guard.units import format_bytes

logger = logging.getLogger(__name__)


class PlanDoesNotFit(GuardError):
    """The capacity plan says the run does not fit (the CLI exits 1). Carries the plan."""

    def __init__(self, message: str, plan: Any = None) -> None:
        super().__init__(message)
        self.plan = plan

    def __reduce__(self):
        return (PlanDoesNotFit, (str(self), None))


def plan_model(*, model_factory: Any, sample_factory: Callable[[], Any], loss_fn: Any,
               optimizer_factory: Callable[[Any], Any], strategy: Strategy | str,
               micro_batch: int, num_workers: int, use_gpu: bool,
               device_memory_bytes: int | None, config: GuardConfig, grad_accum: int = 1,
               precision: str = "fp32", fsdp_grad_sync: str = "auto",
               device_field: str = "device_memory_bytes") -> tuple[Plan, RunPlan]:
    """The capacity plan of a model traced on the fake device at ``micro_batch``, and the
    ``RunPlan`` the coordinator prices its actions with. On CPU the "device" memory is the
    node's RAM per rank (``config.cpu_memory_budget_bytes`` when set); a GPU run must give
    ``device_memory_bytes`` (else an InputError naming ``device_field``)."""
    optimizer = optimizer_kind(optimizer_factory)
    traced = trace_model(model_factory, sample_factory, loss=loss_fn, optimizer=optimizer,
                         precision=precision)
    machine = plan_machine(num_workers=num_workers, use_gpu=use_gpu)
    if device_memory_bytes is None:
        if use_gpu:
            raise InputError(device_field, "unknown for a GPU run", value=None,
                             fix="pass device_memory_bytes (e.g. units.parse_bytes('80GiB'))")
        device_memory_bytes = config.cpu_memory_budget_bytes or machine.memory_per_worker_bytes
    setup = TrainingSetup(strategy=strategy, optimizer=optimizer, micro_batch=micro_batch,
                          grad_accum=grad_accum, world_size=num_workers, precision=precision,
                          foreach=bool(use_gpu))
    result = plan(model=traced.model_stats, activations=traced.activations, setup=setup,
                  device_memory_bytes=int(device_memory_bytes),
                  host_memory_bytes=machine.host_memory_bytes,
                  cpus_per_node=machine.cpus_per_node, gpus_per_node=machine.gpus_per_node,
                  config=config, fsdp_grad_sync=fsdp_grad_sync)
    result = dataclasses.replace(result, warnings=result.warnings + machine.warnings,
                                 notes=result.notes + (machine.reason,))
    return result, RunPlan(traced.model_stats, traced.activations, result.setup,
                           int(device_memory_bytes), grad_sync=result.setup.fsdp_grad_sync)


def traced_plan(train_loop_config: Mapping[str, Any], *, num_workers: int,
                device_memory_bytes: int | None = None, use_gpu: bool = False,
                config: GuardConfig | None = None, sample_factory: Any = None
                ) -> tuple[Plan, RunPlan]:
    """:func:`plan_model` of a train-loop config, traced on ``sample_factory`` (``() -> batch``;
    default: the first samples of its dataset collated together)."""
    loop = LoopConfig.from_dict({k: v for k, v in train_loop_config.items()
                                 if k != "decision_source"})
    return plan_model(
        model_factory=loop.model_factory,
        sample_factory=sample_factory or FirstBatch(loop.dataset_factory, loop.micro_batch),
        loss_fn=loop.loss_fn, optimizer_factory=loop.optimizer_factory, strategy=loop.strategy,
        micro_batch=loop.micro_batch, grad_accum=loop.grad_accum, precision=loop.precision,
        fsdp_grad_sync=loop.fsdp_grad_sync,
        num_workers=num_workers, use_gpu=use_gpu, device_memory_bytes=device_memory_bytes,
        config=config or GuardConfig())


def cluster_nodes() -> list[NodeResources] | None:
    """The alive nodes' resources; None when Ray is not initialized."""
    import ray
    if not ray.is_initialized():
        return None
    return [NodeResources.from_ray(n) for n in ray.nodes() if n.get("Alive")]


def plan_machine(*, num_workers: int, use_gpu: bool) -> PlanMachine:
    """The machine a run's plan is for: the nodes the workers will run on when Ray is
    initialized, packed as Ray's placement does; else the driver's machine with every worker."""
    nodes = cluster_nodes()
    if nodes:
        return place_workers(nodes, num_workers=num_workers, use_gpu=use_gpu)
    here = NodeResources("driver", num_cpus=float(os.cpu_count() or 1),
                         num_gpus=float(num_workers), memory_bytes=host_memory()[0])
    return place_workers([here], num_workers=num_workers, use_gpu=False, cpus_per_worker=0)


class FirstBatch:
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


def optimizer_kind(optimizer_factory: Callable[[Any], Any]) -> str:
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
    """One line for the summary; raises :class:`PlanDoesNotFit` unless it fits or ``force``,
    with the plan's arithmetic and what would make it fit: the planner's advice and
    ``force=True``, or ``fixes`` in the caller's user's words, which replace both."""
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
