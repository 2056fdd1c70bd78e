"""What an action will do, priced before, and what it did, measured after (pure).

Every candidate memory action of the coordinator's policy is priced with the planner's own
memory model (:func:`raytrain_guard.planner.memory_model.estimate`) on the run's plan
(:class:`RunPlan`) as an :class:`Effect`: the memory fraction predicted after it (a delta on the
current reading, so a constant error of the model cancels) and the throughput it costs. After
it applies, :func:`measure` and :func:`judge` say whether it did at least
``effect_min_share`` of its prediction (hit, miss, or not judged when it had none). Why deltas,
and a worked shrink under FSDP: docs/memory_model.md ("Pricing an action").
"""

from __future__ import annotations

import dataclasses
import enum
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.columns import StepColumns
from raytrain_guard.core.decisions import Action
from raytrain_guard.planner.memory_model import (
    PARAM_BYTES,
    GradSync,
    Strategy,
    TrainingSetup,
    estimate,
)
from raytrain_guard.planner.model_stats import ActivationProfile, ModelStats

SHRINK_COST_FRAC = 0.10
"""Throughput lost by halving the micro-batch: assumed 10 %, the order of the per-micro-step
overhead (launches, Python, smaller kernels); the coordinator measures the real figure."""

RELEASE_COST_FRAC = 0.0
"""A cache release costs one device synchronization once, no lasting throughput."""


@dataclass(frozen=True)
class RunPlan:
    """The memory model's inputs for this run as planned: the model, its activation profile,
    the training setup (strategy, precision, optimizer, micro-batch, accumulation, world size)
    and the card. The launcher has them (its ``plan()`` call); the coordinator gets them as
    :meth:`to_dict`."""

    model: ModelStats
    activations: ActivationProfile
    setup: TrainingSetup
    device_memory_bytes: int
    grad_sync: GradSync = GradSync.LAST_MICRO_BATCH

    def to_dict(self) -> dict[str, Any]:
        s = self.setup
        return {"model": dataclasses.asdict(self.model),
                "activations": dataclasses.asdict(self.activations),
                "setup": {**dataclasses.asdict(s), "strategy": s.strategy.value,
                          "precision": s.precision.value, "optimizer": s.optimizer.value},
                "device_memory_bytes": self.device_memory_bytes,
                "grad_sync": GradSync(self.grad_sync).value}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunPlan:
        """Rebuild; raises ValueError/KeyError/TypeError (or PlanInputError) when malformed."""
        m = dict(d["model"])
        m["param_numels"] = tuple(m.get("param_numels", ()))
        a = dict(d["activations"])
        a["notes"] = tuple(a.get("notes", ()))
        total = int(d["device_memory_bytes"])
        if total <= 0:
            raise ValueError(f"device_memory_bytes must be > 0, got {total}")
        return cls(ModelStats(**m), ActivationProfile(**a), TrainingSetup(**d["setup"]), total,
                   GradSync(d.get("grad_sync", GradSync.LAST_MICRO_BATCH.value)))


@dataclass(frozen=True)
class Effect:
    """One candidate action, priced. ``memory_frac_after`` is the resource's predicted fraction
    after it (device memory, or the node's host memory for a prefetch change); ``delta_frac``
    its predicted change (negative: frees); ``cost_frac`` the throughput it costs (0.1: 10 %
    slower); ``basis`` the arithmetic."""

    action: Action
    params: Mapping[str, Any]
    memory_frac_before: float
    memory_frac_after: float
    cost_frac: float
    basis: str
    resource: str = "device_memory"       # or "host_memory"

    @property
    def delta_frac(self) -> float:
        return self.memory_frac_after - self.memory_frac_before

    def helps(self, target_frac: float) -> bool:
        """Predicted to bring the resource to or under ``target_frac``."""
        return self.memory_frac_after <= target_frac

    def to_dict(self) -> dict[str, Any]:
        return {"resource": self.resource,
                "memory_frac_before": round(self.memory_frac_before, 4),
                "memory_frac_after": round(self.memory_frac_after, 4),
                "delta_frac": round(self.delta_frac, 4), "cost_frac": round(self.cost_frac, 4),
                "basis": self.basis}


# -- the memory model, per layout ------------------------------------------------------------

def reserved_peak_bytes(plan: RunPlan, micro_batch: int, grad_accum: int,
                        config: GuardConfig = GuardConfig()) -> int:
    """What the allocator reserves at the step's peak for this layout: the model's
    ``total_bytes`` (tensor peak plus its runtime reserve) less ``cuda_context_bytes``, which
    lies outside the allocator (and cancels in every difference this module takes).

    Under FSDP with every-micro-batch sync and accumulation, the accumulated gradients stay
    sharded: the model at accumulation 1 plus the sharded gradients alive through backward
    (and the fragmentation share of that growth). Everything else is :func:`estimate` on the
    plan's setup at this layout."""
    setup = dataclasses.replace(plan.setup, micro_batch=micro_batch, grad_accum=grad_accum)
    fsdp = setup.strategy in (Strategy.FSDP_FULL, Strategy.FSDP_GRAD_OP)
    if fsdp and grad_accum > 1 and GradSync(plan.grad_sync) is GradSync.EVERY_MICRO_BATCH:
        est = estimate(plan.model, plan.activations,
                       dataclasses.replace(setup, grad_accum=1), config)
        sharded_grads = math.ceil(plan.model.num_trainable_params / setup.world_size) \
            * PARAM_BYTES[setup.precision]
        phases = dict(est.phases)
        phases["backward"] += sharded_grads
        grown = max(phases.values()) - est.peak_bytes
        total = est.total_bytes + grown + round(config.fragmentation_frac * grown)
    else:
        total = estimate(plan.model, plan.activations, setup, config).total_bytes
    return total - config.cuda_context_bytes


# -- candidate actions -------------------------------------------------------------------------

def shrink_effect(plan: RunPlan, micro_batch: int, grad_accum: int, memory_frac: float,
                  config: GuardConfig = GuardConfig()) -> Effect | str:
    """Halve the micro-batch, double accumulation (the global batch is unchanged), priced by
    the memory model; or a note saying why it cannot be done (an odd micro-batch). Under FSDP
    with last-micro-batch sync the first micro-batch's unsharded gradients live through the
    second backward, so a shrink can raise the peak (worked in docs/memory_model.md)."""
    if micro_batch % 2:
        return (f"cannot shrink the micro-batch {micro_batch}: it is odd, so halving it would "
                f"change the global batch")
    new_mb, new_ga = micro_batch // 2, grad_accum * 2
    before = reserved_peak_bytes(plan, micro_batch, grad_accum, config)
    after = reserved_peak_bytes(plan, new_mb, new_ga, config)
    delta = (after - before) / plan.device_memory_bytes
    mode = f", {GradSync(plan.grad_sync).value.replace('_', '-')} gradient sync" \
        if plan.setup.strategy in (Strategy.FSDP_FULL, Strategy.FSDP_GRAD_OP) else ""
    basis = (f"memory model ({plan.setup.strategy.value}{mode}): reserved peak "
             f"{_mib(before)} at micro-batch {micro_batch} x accumulation {grad_accum} -> "
             f"{_mib(after)} at {new_mb} x {new_ga} ({_mib(after - before, sign=True)}, "
             f"{delta:+.1%} of {_mib(plan.device_memory_bytes)})")
    return Effect(Action.SHRINK_MICRO_BATCH, {"micro_batch": new_mb, "grad_accum": new_ga},
                  memory_frac, memory_frac + delta, SHRINK_COST_FRAC, basis)


def release_effect(memory_frac: float, allocated_bytes: int, reserved_bytes: int,
                   device_total_bytes: int, plan: RunPlan | None = None,
                   micro_batch: int | None = None, grad_accum: int | None = None,
                   config: GuardConfig = GuardConfig()) -> Effect:
    """Release the allocator's cached blocks: frees reserved minus allocated, less what the
    next step re-reserves for its peak when the plan says so (the reading is taken at the end
    of a step; the peak comes back within the next one)."""
    keeps = allocated_bytes
    why = f"reserved {_mib(reserved_bytes)} - allocated {_mib(allocated_bytes)}"
    if plan is not None and micro_batch is not None and grad_accum is not None:
        peak = reserved_peak_bytes(plan, micro_batch, grad_accum, config)
        if peak > keeps:
            keeps = peak
            why += f", less the {_mib(peak - allocated_bytes)} the next step's peak " \
                   f"({_mib(peak)}, memory model) re-reserves"
    freed = max(0, reserved_bytes - keeps)
    delta = freed / device_total_bytes
    return Effect(Action.RELEASE_CACHE, {}, memory_frac, memory_frac - delta,
                  RELEASE_COST_FRAC, f"cache release frees {_mib(freed)} ({why}; "
                  f"{delta:.1%} of {_mib(device_total_bytes)})")


def prefetch_effect(host_used_frac: float, host_total_bytes: int, current: int, new: int,
                    ranks: Sequence[tuple[int, int]], data_wait_frac: float) -> Effect:
    """Lower the node's prefetch factor from ``current`` to ``new``: each rank's loader holds
    ``num_workers x prefetch_factor`` batches in flight (``ranks``: (num_workers, batch_bytes)
    per rank on the node, pinned copies in the batch bytes), so the node frees
    ``(current - new) x num_workers x batch_bytes`` per rank. Its cost: the share of the step
    the ranks already wait for data (``data_wait_frac``), which a shallower queue may grow."""
    freed = sum((current - new) * workers * batch for workers, batch in ranks)
    delta = freed / host_total_bytes
    terms = " + ".join(f"({current} - {new}) x {w} x {_mib(b)}" for w, b in ranks)
    return Effect(Action.SET_PREFETCH, {"prefetch_factor": new}, host_used_frac,
                  host_used_frac - delta, max(0.0, data_wait_frac),
                  f"prefetch {current}->{new} frees {terms} = {_mib(freed)} "
                  f"({delta:.1%} of host memory)", resource="host_memory")


def choose(candidates: Sequence[Effect], target_frac: float) -> Effect | None:
    """The cheapest candidate predicted to bring the resource to or under ``target_frac``
    (ties: the one that frees most); None when none is."""
    return min((e for e in candidates if e.helps(target_frac)),
               key=lambda e: (e.cost_frac, e.memory_frac_after), default=None)


# -- measurement -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Measured:
    """Medians of a resource and of the step over the steps before an action and after it.
    ``memory_frac`` is the worst rank's median (None: no reading); ``data_wait_s`` and
    ``step_s`` the medians over every rank."""

    memory_frac_before: float | None
    memory_frac_after: float | None
    step_s_before: float
    step_s_after: float
    data_wait_s_before: float
    data_wait_s_after: float
    num_steps_before: int
    num_steps_after: int

    @property
    def delta_frac(self) -> float | None:
        before, after = self.memory_frac_before, self.memory_frac_after
        return None if before is None or after is None else after - before

    @property
    def cost_frac(self) -> float:
        """Throughput lost: step time after over before, minus 1 (negative: faster)."""
        return self.step_s_after / self.step_s_before - 1.0 if self.step_s_before > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 6)

        return {"memory_frac_before": r(self.memory_frac_before),
                "memory_frac_after": r(self.memory_frac_after),
                "delta_frac": r(self.delta_frac), "step_s_before": r(self.step_s_before),
                "step_s_after": r(self.step_s_after), "cost_frac": r(self.cost_frac),
                "data_wait_s_before": r(self.data_wait_s_before),
                "data_wait_s_after": r(self.data_wait_s_after),
                "num_steps_before": self.num_steps_before,
                "num_steps_after": self.num_steps_after}


def measure(before: Mapping[int, StepColumns], after: Mapping[int, StepColumns],
            host_frac: tuple[float | None, float | None] = (None, None)) -> Measured | None:
    """Before/after medians from each rank's steps (``before``: up to the apply step,
    ``after``: from it on). Memory is the worst rank's median reading, or ``host_frac``
    (before, after) for a host action. None when either side has no step."""
    if not any(len(c) for c in before.values()) or not any(len(c) for c in after.values()):
        return None

    def worst(windows: Mapping[int, StepColumns]) -> float | None:
        meds = [statistics.median(m for _, m in x) for x in
                (c.memory_readings() for c in windows.values()) if x]
        return max(meds) if meds else None

    def median(windows: Mapping[int, StepColumns], column: str) -> float:
        return statistics.median(v for c in windows.values() for v in getattr(c, column))

    mem_b, mem_a = (worst(before), worst(after)) if host_frac == (None, None) else host_frac
    return Measured(mem_b, mem_a, median(before, "total"), median(after, "total"),
                    median(before, "data"), median(after, "data"),
                    sum(len(c) for c in before.values()), sum(len(c) for c in after.values()))


class Verdict(str, enum.Enum):
    """What a measured action is judged against its prediction."""

    HIT = "hit"                  # the memory fell by at least effect_min_share of the prediction
    MISS = "miss"                # it fell by less
    NOT_JUDGED = "not_judged"    # nothing to hold it to: no prediction, no predicted fall, or
                                 # no memory reading on either side


def judge(predicted: Effect | Mapping[str, Any] | None, measured: Measured | None,
          min_share: float) -> Verdict:
    """Hit when the measured memory change is at least ``min_share`` of the predicted one
    (both as a fall of the fraction), miss when it is below; not judged when the action had no
    prediction, was not predicted to free anything, or has no memory measurement. Example:
    predicted -0.08, measured -0.01, share 0.5 -> 0.01 < 0.04: miss; measured -0.05: hit."""
    if predicted is None or measured is None or measured.delta_frac is None:
        return Verdict.NOT_JUDGED
    want = -(predicted.delta_frac if isinstance(predicted, Effect)
             else float(predicted["delta_frac"]))
    if want <= 0:
        return Verdict.NOT_JUDGED
    return Verdict.MISS if -measured.delta_frac < min_share * want else Verdict.HIT


def _mib(n: float, sign: bool = False) -> str:
    v = n / 2**20
    return f"{v:+.0f} MiB" if sign else f"{v:.0f} MiB"
