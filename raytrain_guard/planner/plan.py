"""The capacity planner: will this training job fit, and with which settings? (pure)

``plan()`` takes numbers (a model's parameter facts, its activation profile, the training setup
and the machine) and returns a :class:`Plan`: a frozen value with the verdict, the arithmetic
behind it and every setting it derived:

- fits: static memory + activations + runtime reserve within ``(1 - headroom_frac)`` of the
  card (the 15 % headroom rule), shown as one line of arithmetic;
- the largest micro-batch that fits, and the gradient accumulation that reaches a requested
  global batch (``global = micro_batch x grad_accum x world_size``), saying when it cannot be met
  exactly;
- ``bucket_cap_mb`` for DDP (:mod:`raytrain_guard.planner.buckets`);
- DataLoader ``num_workers`` / ``prefetch_factor``
  (:mod:`raytrain_guard.planner.dataloader_sizing`);
- the host memory of a node: every GPU's checkpoint staging and prefetch within the host
  watermark (:mod:`raytrain_guard.planner.host_account`), a warning when over;
- under FSDP, the gradient sync of an accumulation window (``fsdp_grad_sync``): both modes are
  planned (memory, and bytes through the collectives per step) and, asked ``auto``, the one
  that fits the largest micro-batch is chosen, the one that communicates less on a tie.

The memory of one step comes from :func:`raytrain_guard.planner.memory_model.estimate`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import PlanInputError, check_int
from raytrain_guard.planner.buckets import BucketPlan, bucket_plan, in_flight_bytes
from raytrain_guard.planner.dataloader_sizing import DataLoaderPlan, size_dataloader
from raytrain_guard.planner.host_account import HostAccount, host_account
from raytrain_guard.planner.memory_model import (
    GradSync,
    MemoryEstimate,
    Strategy,
    TrainingSetup,
    comm_bytes_per_step,
    estimate,
)
from raytrain_guard.planner.micro_batch import (
    MAX_MICRO_BATCH_SEARCH,
    batching,
    host_micro_batch_cap,
    max_micro_batch,
)
from raytrain_guard.planner.model_stats import ActivationProfile, ModelStats
from raytrain_guard.units import format_bytes

#: ``plan(fsdp_grad_sync=...)``: let the planner choose the FSDP gradient sync (the rule:
#: the mode that fits the largest micro-batch, the less communication on a tie)
AUTO_GRAD_SYNC = "auto"
FSDP_STRATEGIES = (Strategy.FSDP_FULL, Strategy.FSDP_GRAD_OP)


@dataclass(frozen=True)
class Plan:
    """The planner's answer for one rank (every rank of a data-parallel job holds the same)."""

    fits: bool
    device_memory_bytes: int
    budget_bytes: int
    estimate: MemoryEstimate
    setup: TrainingSetup                  # as planned: micro_batch, grad_accum, bucket_cap_mb
    max_micro_batch: int | None           # None: no activation bytes, no limit derived; DDP:
                                          # leaves room for the buckets in flight
    global_batch: int                     # micro_batch x grad_accum x world_size
    requested_global_batch: int | None
    bucket: BucketPlan | None
    dataloader: DataLoaderPlan | None
    arithmetic: str
    activations_source: str
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    headroom_frac: float = 0.15
    comm_bytes_per_step: int = 0          # bytes one rank moves through FSDP's collectives
    grad_sync_options: tuple[dict[str, Any], ...] = ()  # FSDP: both modes, as planned
    host: HostAccount | None = None       # None: host memory unknown

    @property
    def checkpoint_staging_bytes(self) -> int | None:
        """Host bytes one rank stages while writing a checkpoint (None: not counted)."""
        return self.host.checkpoint_staging_bytes if self.host is not None else None

    @property
    def fsdp_grad_sync(self) -> str | None:
        """The FSDP gradient sync planned (``setup.fsdp_grad_sync``); None when not FSDP."""
        fsdp = self.setup.strategy in FSDP_STRATEGIES
        return self.setup.fsdp_grad_sync.value if fsdp else None

    # -- views --------------------------------------------------------------------------------
    @property
    def peak_bytes(self) -> int:
        """Tensor bytes at the peak of a steady-state step (no reserve)."""
        return self.estimate.peak_bytes

    @property
    def total_bytes(self) -> int:
        """Peak plus the runtime reserve: what must fit in ``budget_bytes``."""
        return self.estimate.total_bytes

    @property
    def micro_batch(self) -> int:
        return self.setup.micro_batch

    @property
    def grad_accum(self) -> int:
        return self.setup.grad_accum

    @property
    def bucket_cap_mb(self) -> float | None:
        return self.bucket.bucket_cap_mb if self.bucket is not None else None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the CLI's ``--json``)."""
        loader = self.dataloader
        return {
            "fits": self.fits,
            "device_memory_bytes": self.device_memory_bytes,
            "budget_bytes": self.budget_bytes,
            "headroom_frac": self.headroom_frac,
            "peak_bytes": self.peak_bytes,
            "total_bytes": self.total_bytes,
            "free_bytes": self.budget_bytes - self.total_bytes,
            "breakdown": dict(self.estimate.breakdown),
            "peak_phase": self.estimate.peak_phase,
            "phases": dict(self.estimate.phases),
            "strategy": self.setup.strategy.value,
            "precision": self.setup.precision.value,
            "optimizer": self.setup.optimizer.value,
            "world_size": self.setup.world_size,
            "micro_batch": self.micro_batch,
            "max_micro_batch": self.max_micro_batch,
            "grad_accum": self.grad_accum,
            "global_batch": self.global_batch,
            "requested_global_batch": self.requested_global_batch,
            "fsdp_grad_sync": self.fsdp_grad_sync,
            "comm_bytes_per_step": self.comm_bytes_per_step,
            "fsdp_grad_sync_options": [dict(o) for o in self.grad_sync_options],
            "bucket_cap_mb": self.bucket_cap_mb,
            "bucket": self.bucket.to_dict() if self.bucket is not None else None,
            "dataloader": loader.to_dict() if loader is not None else None,
            "checkpoint_staging_bytes": self.checkpoint_staging_bytes,
            "host": self.host.to_dict() if self.host is not None else None,
            "activations_source": self.activations_source,
            "arithmetic": self.arithmetic,
            "warnings": list(self.warnings),
            "notes": list(self.notes) + list(self.estimate.notes),
        }


def plan(*, model: ModelStats, activations: ActivationProfile, setup: TrainingSetup,
         device_memory_bytes: int, host_memory_bytes: int | None, cpus_per_node: int | None,
         gpus_per_node: int = 1, global_batch: int | None = None, batch_bytes: int | None = None,
         list_backed_dataset: bool = False,
         bandwidth_curve: Sequence[tuple[int, float]] | None = None,
         config: GuardConfig = GuardConfig(), auto_micro_batch: bool = False,
         sample_bytes: float | None = None, pin_memory: bool = True,
         fsdp_grad_sync: GradSync | str = AUTO_GRAD_SYNC) -> Plan:
    """Plan one data-parallel training job (see the module docstring).

    ``setup.micro_batch`` is the micro-batch the verdict is for, unless ``auto_micro_batch``:
    then the planner picks the largest that fits (an exact divisor of the per-rank batch when
    ``global_batch`` is given and one is at least half as large). ``batch_bytes`` is one loader
    batch at the planned micro-batch; ``sample_bytes`` (one sample) is scaled to it instead.

    ``fsdp_grad_sync`` (FSDP only): ``"every_micro_batch"``, ``"last_micro_batch"`` or
    ``"auto"`` (default: the mode that fits the largest micro-batch, on a tie the one with fewer
    bytes through the collectives per step). Both modes are planned and kept in
    :attr:`Plan.grad_sync_options`; ``setup.fsdp_grad_sync`` is replaced by the mode planned.
    """
    kwargs = dict(model=model, activations=activations, device_memory_bytes=device_memory_bytes,
                  host_memory_bytes=host_memory_bytes, cpus_per_node=cpus_per_node,
                  gpus_per_node=gpus_per_node, global_batch=global_batch,
                  batch_bytes=batch_bytes, list_backed_dataset=list_backed_dataset,
                  bandwidth_curve=bandwidth_curve, config=config,
                  auto_micro_batch=auto_micro_batch, sample_bytes=sample_bytes,
                  pin_memory=pin_memory)
    wanted = _grad_sync_wanted(fsdp_grad_sync)
    if setup.strategy not in FSDP_STRATEGIES:
        return _plan_one(setup=setup, **kwargs)
    plans = {mode: _plan_one(setup=dataclasses.replace(setup, fsdp_grad_sync=mode), **kwargs)
             for mode in (GradSync.LAST_MICRO_BATCH, GradSync.EVERY_MICRO_BATCH)}

    def rank(mode: GradSync) -> tuple:
        p = plans[mode]
        largest = MAX_MICRO_BATCH_SEARCH if p.max_micro_batch is None else p.max_micro_batch
        return (p.fits, largest, -p.comm_bytes_per_step)

    chosen = max(plans, key=rank) if wanted == AUTO_GRAD_SYNC else wanted
    options = tuple(_grad_sync_option(p, mode is chosen) for mode, p in plans.items())
    other = next(mode for mode in plans if mode is not chosen)
    why = _grad_sync_reason(plans[chosen], plans[other], wanted == AUTO_GRAD_SYNC)
    picked = plans[chosen]
    return dataclasses.replace(picked, grad_sync_options=options, notes=picked.notes + (why,))


def _grad_sync_wanted(value: GradSync | str) -> GradSync | str:
    if value == AUTO_GRAD_SYNC:
        return AUTO_GRAD_SYNC
    try:
        return GradSync(value)
    except ValueError:
        choices = ", ".join([m.value for m in GradSync] + [AUTO_GRAD_SYNC])
        raise PlanInputError("fsdp_grad_sync", "unknown value", value=value,
                             fix=f"choose one of: {choices}") from None


def _grad_sync_option(p: Plan, chosen: bool) -> dict[str, Any]:
    return {"fsdp_grad_sync": p.setup.fsdp_grad_sync.value, "chosen": chosen, "fits": p.fits,
            "max_micro_batch": p.max_micro_batch, "micro_batch": p.micro_batch,
            "grad_accum": p.grad_accum, "total_bytes": p.total_bytes,
            "peak_phase": p.estimate.peak_phase,
            "grads_bytes": p.estimate.breakdown.get("grads", 0),
            "comm_bytes_per_step": p.comm_bytes_per_step}


def _grad_sync_reason(chosen: Plan, other: Plan, auto: bool) -> str:
    def brief(p: Plan) -> str:
        largest = "no limit" if p.max_micro_batch is None else p.max_micro_batch
        return (f"{p.setup.fsdp_grad_sync.value}: largest micro-batch {largest}, "
                f"{format_bytes(p.total_bytes)} at {p.micro_batch} x {p.grad_accum}, "
                f"{format_bytes(p.comm_bytes_per_step)} through the collectives per step")
    how = "chosen (auto: the larger micro-batch, then the less communication)" if auto \
        else "as asked"
    return f"FSDP gradient sync {chosen.setup.fsdp_grad_sync.value} {how}; {brief(chosen)}; " \
           f"{brief(other)}"


def _plan_one(*, model: ModelStats, activations: ActivationProfile, setup: TrainingSetup,
              device_memory_bytes: int, host_memory_bytes: int | None,
              cpus_per_node: int | None, gpus_per_node: int, global_batch: int | None,
              batch_bytes: int | None, list_backed_dataset: bool, bandwidth_curve,
              config: GuardConfig, auto_micro_batch: bool, sample_bytes: float | None,
              pin_memory: bool) -> Plan:
    """:func:`plan` for one concrete setup (one FSDP gradient sync)."""
    _check_inputs(device_memory_bytes, gpus_per_node, global_batch, batch_bytes, sample_bytes)
    warnings: list[str] = []
    notes: list[str] = []
    budget = int(device_memory_bytes * config.budget_frac)
    unknown_acts = activations.source == "unknown"
    if unknown_acts:
        warnings.append("activations unknown (parameter count only): planned with "
                        f"{format_bytes(activations.at(1))} per sample; give the model shape, "
                        "--model/--sample, or --activation-bytes-per-sample")

    # micro-batch and accumulation: grad_accum > 1 keeps gradients alive, so search again
    # whenever the accumulation changes (it only grows: at most a few passes)
    host_cap = None
    if auto_micro_batch and sample_bytes is not None and batch_bytes is None and \
            host_memory_bytes is not None and cpus_per_node is not None:
        host_cap = host_micro_batch_cap(sample_bytes, host_memory_bytes, cpus_per_node,
                                         gpus_per_node, pin_memory, config)
    # room for DDP buckets in flight at the unbounded recommendation, kept free by the search
    in_flight = in_flight_bytes(model, setup, config, bandwidth_curve)
    if in_flight:
        notes.append(f"micro-batch search keeps {format_bytes(in_flight)} free for "
                     f"{config.num_buckets_in_flight} DDP buckets in flight")
    current = setup
    for _ in range(4):
        max_micro = max_micro_batch(model, activations, current, budget - in_flight, config)
        choose_from = max_micro
        if host_cap is not None and (max_micro is None or host_cap < max_micro):
            choose_from = host_cap
        micro, accum, why = batching(current, choose_from, global_batch, auto_micro_batch)
        chosen = dataclasses.replace(current, micro_batch=micro, grad_accum=accum)
        if chosen == current:
            break
        current = chosen
    warnings.extend(why)
    if choose_from != max_micro and \
            batching(current, max_micro, global_batch, auto_micro_batch)[:2] != (micro, accum):
        notes.append(f"micro-batch chosen within {choose_from}: at {format_bytes(sample_bytes)} "
                     f"per sample, larger batches would not leave every DataLoader worker "
                     f"one batch in the host prefetch budget")
    if max_micro == 0:
        warnings.append("even micro-batch 1 does not fit: " + _fixes_for(current))
    elif max_micro is None:
        notes.append("micro-batch not limited by memory in this plan (no activation bytes)")

    est = estimate(model, activations, current, config)
    slack = budget - est.total_bytes
    bucket = bucket_plan(model, current, config, bandwidth_curve, slack, warnings, notes)
    if bucket is not None:   # estimate() does not read bucket_cap_mb: `est` stays valid
        current = dataclasses.replace(current, bucket_cap_mb=bucket.bucket_cap_mb)
    fits = est.total_bytes <= budget

    loader = None
    if sample_bytes is not None and batch_bytes is None:
        batch_bytes = max(1, int(math.ceil(sample_bytes * current.micro_batch)))
    if batch_bytes is None or host_memory_bytes is None or cpus_per_node is None:
        missing = [name for name, v in (("batch bytes", batch_bytes), ("host memory",
                   host_memory_bytes), ("CPUs per node", cpus_per_node)) if v is None]
        notes.append(f"DataLoader not sized: {', '.join(missing)} unknown (give --sample, "
                     f"--dataset or --batch-bytes)")
        if list_backed_dataset:
            warnings.append("the dataset keeps its samples in Python lists (copy-on-read "
                            "growth in forked workers); store them in numpy arrays or tensors")
    else:
        loader = size_dataloader(batch_bytes=batch_bytes, host_memory_bytes=host_memory_bytes,
                                 gpus_per_node=gpus_per_node, cpus_per_node=cpus_per_node,
                                 pin_memory=pin_memory, config=config,
                                 list_backed_dataset=list_backed_dataset)
        warnings.extend(loader.warnings)
    host = None
    if host_memory_bytes is not None:
        host = host_account(model=model, setup=current, host_memory_bytes=host_memory_bytes,
                            gpus_per_node=gpus_per_node, config=config,
                            loader_host_bytes=loader.host_bytes if loader is not None else None)
        notes.append(host.arithmetic)
        if not host.fits:
            warnings.append(
                f"host memory: checkpoint staging and prefetch of {gpus_per_node} GPUs "
                f"({format_bytes(host.node_bytes)}) exceed {format_bytes(host.limit_bytes)} "
                f"({config.host_memory_watermark_frac:.0%} of host RAM): a checkpoint would "
                f"push the node towards Ray's memory monitor (95 %); shard over more ranks "
                f"(a rank writes 1/N of the model state), fewer GPUs per node or more host RAM")

    return Plan(
        fits=fits, device_memory_bytes=device_memory_bytes, budget_bytes=budget, estimate=est,
        setup=current, max_micro_batch=max_micro,
        global_batch=current.micro_batch * current.grad_accum * current.world_size,
        requested_global_batch=global_batch, bucket=bucket, dataloader=loader,
        arithmetic=arithmetic(est, budget, device_memory_bytes, config),
        activations_source=activations.source, warnings=tuple(warnings), notes=tuple(notes),
        headroom_frac=config.headroom_frac,
        comm_bytes_per_step=comm_bytes_per_step(model, current), host=host)


def arithmetic(est: MemoryEstimate, budget: int, device_memory_bytes: int,
               config: GuardConfig) -> str:
    """One line: ``static 41.2 GiB + activations 22.0 GiB + reserve 1.5 GiB = 64.7 GiB of a
    68.0 GiB budget (85 % of 80.0 GiB)``; static is every tensor at the peak but activations."""
    acts = est.breakdown.get("activations", 0)
    reserve = est.breakdown.get("reserve", est.total_bytes - est.peak_bytes)
    static = est.peak_bytes - acts
    of = (f"{format_bytes(budget)} budget ({config.budget_frac * 100:.4g} % of "
          f"{format_bytes(device_memory_bytes)})")
    head = (f"static {format_bytes(static)} + activations {format_bytes(acts)} + reserve "
            f"{format_bytes(reserve)} = {format_bytes(est.total_bytes)}")
    if est.total_bytes <= budget:
        return f"{head} of a {of}"
    return f"{head}, over the {of} by {format_bytes(est.total_bytes - budget)}"


# -- parts ---------------------------------------------------------------------------------

def _check_inputs(device_memory_bytes, gpus_per_node, global_batch, batch_bytes,
                  sample_bytes) -> None:
    for name, value, fix in (
            ("device_memory_bytes", device_memory_bytes, "give the card's memory, e.g. 80GiB"),
            ("gpus_per_node", gpus_per_node, "give the GPUs per node, e.g. 8"),
            ("global_batch", global_batch, "give the global batch in samples, or leave it out"),
            ("batch_bytes", batch_bytes, "give one batch's bytes, or leave it out")):
        if value is None and name in ("global_batch", "batch_bytes"):
            continue
        check_int(name, value, at_least=1, error=PlanInputError, fix=fix)
    if sample_bytes is not None and not sample_bytes > 0:
        raise PlanInputError("sample_bytes", "must be positive", value=sample_bytes,
                             fix="give one sample's bytes, or leave it out")


def _fixes_for(setup: TrainingSetup) -> str:
    """What could make a setup fit, leaving out what it already does."""
    fixes = []
    if setup.strategy is not Strategy.FSDP_FULL:
        fixes.append("shard the model (--strategy fsdp-full)")
    if setup.precision.value in ("fp32", "amp-bf16"):
        fixes.append("keep parameters in bf16 (--precision bf16-master)")
    if setup.strategy is not Strategy.DDP:   # a DDP replica is the same size on any rank count
        fixes.append("add ranks to shard over (--workers)")
    fixes += ["recompute activations", "use a card with more memory"]
    return ", ".join(fixes[:-1]) + " or " + fixes[-1]
