"""Per-GPU memory of one steady-state training step (pure: standard library only).

memory = params + gradients + optimizer states + activations + communication buffers + runtime
reserve. :func:`estimate` prices each moment of a step that can hold the peak (backward and the
optimizer step; DDP's bucket rebuild; FSDP's forward and late backward), keeps the largest and
adds the reserve. The phases, the bytes per parameter of each precision, what each strategy
shards, the reserve and gradient accumulation, with their sources: docs/memory_model.md.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import PlanInputError, check_int
from raytrain_guard.planner.model_stats import ActivationProfile, ModelStats
from raytrain_guard.units import MiB


class Strategy(str, enum.Enum):
    DDP = "ddp"                    # full replica of params, grads, optimizer state
    ZERO1 = "zero1"                # DDP + ZeroRedundancyOptimizer: optimizer state sharded
    FSDP_GRAD_OP = "fsdp-grad-op"  # FSDP SHARD_GRAD_OP (ZeRO-2): grads + optimizer sharded
    FSDP_FULL = "fsdp-full"        # FSDP FULL_SHARD (ZeRO-3): params + grads + optimizer sharded


class Precision(str, enum.Enum):
    FP32 = "fp32"
    AMP_BF16 = "amp-bf16"          # autocast: fp32 params/grads, bf16 activations
    BF16_MASTER = "bf16-master"    # bf16 params/grads, fp32 master weights with optimizer state
    BF16 = "bf16"                  # everything bf16


class OptimizerKind(str, enum.Enum):
    SGD = "sgd"
    SGD_MOMENTUM = "sgd-momentum"
    ADAM = "adam"
    ADAMW = "adamw"


class GradSync(str, enum.Enum):
    """When FSDP synchronizes (reduce-scatters) gradients within an accumulation window."""

    LAST_MICRO_BATCH = "last_micro_batch"    # no sync before the last: unsharded gradients
    EVERY_MICRO_BATCH = "every_micro_batch"  # reduce-scatter each: gradients stay sharded


#: ``TrainingSetup.fsdp_grad_sync`` when not given: the larger memory of the two (safe side)
DEFAULT_GRAD_SYNC = GradSync.LAST_MICRO_BATCH

#: A model known by its parameter count alone: its largest FSDP unit is assumed to hold this
#: share of the parameters. Per-block wrapping puts the largest unit in the root or a block:
#: Llama 3.1 8B's root holds 13 %, a block 2.7 %, so 1/8 covers the root and two blocks.
DEFAULT_FSDP_UNIT_FRAC = 1 / 8


def default_fsdp_unit_params(num_params: int) -> int:
    """The largest FSDP unit assumed from the parameter count alone (at least 1)."""
    return max(1, math.ceil(num_params * DEFAULT_FSDP_UNIT_FRAC))


#: bytes of one parameter / one gradient element
PARAM_BYTES = {Precision.FP32: 4, Precision.AMP_BF16: 4, Precision.BF16_MASTER: 2,
               Precision.BF16: 2}
#: bytes of one optimizer-state element (the dtype the optimizer runs in)
STATE_BYTES = {Precision.FP32: 4, Precision.AMP_BF16: 4, Precision.BF16_MASTER: 4,
               Precision.BF16: 2}
#: bytes of master weights per trainable parameter
MASTER_BYTES = {Precision.FP32: 0, Precision.AMP_BF16: 0, Precision.BF16_MASTER: 4,
                Precision.BF16: 0}
#: FSDP: bytes of one sharded parameter / gradient element (the sharded parameters are the
#: fp32 master weights under MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))
FSDP_SHARD_BYTES = {Precision.FP32: 4, Precision.AMP_BF16: 4, Precision.BF16_MASTER: 4,
                    Precision.BF16: 2}
#: FSDP: bytes of one reduce-scatter element (reduce_dtype: fp32 under bf16-master)
REDUCE_BYTES = {Precision.FP32: 4, Precision.AMP_BF16: 4, Precision.BF16_MASTER: 4,
                Precision.BF16: 2}
#: optimizer state tensors per parameter (momentum; exp_avg + exp_avg_sq)
STATE_COPIES = {OptimizerKind.SGD: 0, OptimizerKind.SGD_MOMENTUM: 1, OptimizerKind.ADAM: 2,
                OptimizerKind.ADAMW: 2}


def coerce_enum(enum_cls, value, field_name: str, *,
                error: type[PlanInputError] = PlanInputError):
    """``enum_cls(value)``, or ``error`` naming ``field_name`` and listing the choices."""
    try:
        return enum_cls(value)
    except ValueError:
        choices = ", ".join(m.value for m in enum_cls)
        raise error(field_name, "unknown value", value=value,
                    fix=f"choose one of: {choices}") from None


@dataclass(frozen=True, kw_only=True)
class TrainingSetup:
    """How the model is trained: everything besides the model that changes memory. Strings are
    accepted for the enums (``strategy="fsdp-full"``). ``foreach``: the optimizer's multi-tensor
    kernels (PyTorch's default on CUDA, larger temporaries); False is its CPU default."""

    strategy: Strategy = Strategy.DDP
    precision: Precision = Precision.FP32
    optimizer: OptimizerKind = OptimizerKind.ADAMW
    micro_batch: int = 1
    grad_accum: int = 1
    world_size: int = 1                     # data-parallel ranks in total
    bucket_cap_mb: float = 25.0             # DDP's default cap
    gradient_as_bucket_view: bool = False   # DDP's default
    foreach: bool = True                    # optimizer implementation (CUDA default)
    fsdp_grad_sync: GradSync = DEFAULT_GRAD_SYNC  # FSDP with grad_accum > 1 (docs/memory_model.md)

    def __post_init__(self) -> None:
        for name, kind in (("strategy", Strategy), ("fsdp_grad_sync", GradSync),
                           ("precision", Precision), ("optimizer", OptimizerKind)):
            object.__setattr__(self, name, coerce_enum(kind, getattr(self, name), name))
        for name in ("micro_batch", "grad_accum", "world_size"):
            check_int(name, getattr(self, name), at_least=1, error=PlanInputError,
                      fix=f"set {name} to 1 or more")
        if not isinstance(self.bucket_cap_mb, (int, float)) or self.bucket_cap_mb <= 0:
            raise PlanInputError("bucket_cap_mb", "must be a positive number of MiB",
                                 value=self.bucket_cap_mb, fix="DDP's default is 25")


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU bytes of one steady-state step: ``peak_bytes`` the tensor bytes at the peak
    moment (``peak_phase``), ``breakdown`` each category's bytes at that moment plus
    ``reserve``, ``total_bytes = peak_bytes + reserve``, ``phases`` every candidate moment's
    bytes (how close the runner-up is)."""

    peak_bytes: int
    total_bytes: int
    breakdown: Mapping[str, int]    # params buffers grads optimizer activations temp comm reserve
    peak_phase: str
    notes: tuple[str, ...] = field(default_factory=tuple)
    phases: Mapping[str, int] = field(default_factory=dict)


def per_rank_numel(numel: int, n: int) -> int:
    """Elements one rank holds when ``numel`` is split over ``n`` ranks (padded, like FSDP)."""
    return math.ceil(numel / n)


def zero1_rank_numel(model: ModelStats, world_size: int) -> int:
    """Trainable elements of the most loaded rank under ``ZeroRedundancyOptimizer``.

    It never splits a parameter: it sorts them largest first and gives each to the rank with
    the fewest elements so far. Without ``param_numels``, an even split.
    """
    if not model.param_numels or world_size == 1:
        return per_rank_numel(model.num_trainable_params, world_size)
    sizes = [0] * world_size
    for numel in sorted(model.param_numels, reverse=True):
        sizes[sizes.index(min(sizes))] += numel
    return max(sizes)


def optimizer_temp_bytes(model: ModelStats, setup: TrainingSetup) -> int:
    """Transient bytes inside ``optimizer.step()`` on one rank (before sharding is applied).

    Adam/AdamW foreach: ``torch._foreach_sqrt(exp_avg_sqs)`` makes one state-dtype copy of every
    parameter it updates. Single-tensor: ``exp_avg_sq.sqrt()`` and the division by the bias
    correction make two copies of the largest parameter. SGD (momentum or not, no weight decay,
    PyTorch's defaults) updates in place: no temporaries.
    """
    if STATE_COPIES[setup.optimizer] < 2:
        return 0
    state = STATE_BYTES[setup.precision]
    if setup.foreach:
        per_rank = model.num_trainable_params
        if setup.strategy is Strategy.ZERO1:
            per_rank = zero1_rank_numel(model, setup.world_size)
        elif setup.strategy is not Strategy.DDP:
            per_rank = per_rank_numel(per_rank, setup.world_size)
        return per_rank * state
    largest = max(model.param_numels) if model.param_numels else (
        model.largest_unit_params or model.num_trainable_params)
    largest = min(largest, model.num_trainable_params)
    if setup.strategy is Strategy.FSDP_FULL or setup.strategy is Strategy.FSDP_GRAD_OP:
        largest = per_rank_numel(largest, setup.world_size)
    return 2 * largest * state


def comm_bytes_per_step(model: ModelStats, setup: TrainingSetup) -> int:
    """Bytes one rank sends through its collectives in one optimizer step (FSDP; 0 otherwise).

    A ring all-gather or reduce-scatter of ``E`` elements moves ``(N - 1) / N x E`` elements
    per rank. Per micro-batch FSDP gathers every unit in forward, and fsdp-full again in
    backward (the root, not resharded after forward, only once); gradients are
    reduce-scattered (in the reduce dtype) once per step under ``last_micro_batch`` and after
    every micro-batch under ``every_micro_batch``. Worked: fsdp-full, fp32, 1000 parameters
    (root unknown), 2 ranks, accumulation 4: gathers 4 x 2 x 1000 x 4 B = 32000 B; reduce-scatters
    1 x 1000 x 4 B (last) or 4 x 1000 x 4 B (every); x 1/2 -> 18000 or 24000 B.
    """
    n = setup.world_size
    if setup.strategy not in (Strategy.FSDP_FULL, Strategy.FSDP_GRAD_OP) or n == 1:
        return 0
    p_b, reduce_b = PARAM_BYTES[setup.precision], REDUCE_BYTES[setup.precision]
    gathered = model.num_params
    if setup.strategy is Strategy.FSDP_FULL:
        root = model.root_unit_params or 0
        gathered = 2 * model.num_params - root
    syncs = setup.grad_accum if setup.fsdp_grad_sync is GradSync.EVERY_MICRO_BATCH else 1
    elements_bytes = setup.grad_accum * gathered * p_b \
        + syncs * model.num_trainable_params * reduce_b
    return int(elements_bytes * (n - 1) // n)


def _moment(params: int, buffers: int, grads: int, optimizer: int, activations: int = 0, *,
            temp: int = 0, comm: int = 0) -> dict[str, int]:
    """The bytes of one moment of a step, by category (the breakdown a plan shows)."""
    return {"params": params, "buffers": buffers, "grads": grads, "optimizer": optimizer,
            "activations": activations, "temp": temp, "comm": comm}


def estimate(model: ModelStats, activations: ActivationProfile, setup: TrainingSetup,
             config: GuardConfig = GuardConfig()) -> MemoryEstimate:
    """The per-GPU memory of one steady-state training step.

    Activations come from ``activations.at(setup.micro_batch)``; the profile must have been made
    at ``setup.precision`` (a traced profile is made at the precision it was traced in).
    """
    n = setup.world_size
    prec, strat = setup.precision, setup.strategy
    fsdp = strat in (Strategy.FSDP_FULL, Strategy.FSDP_GRAD_OP)
    p_b, s_b = PARAM_BYTES[prec], STATE_BYTES[prec]   # p_b: compute dtype (gathered, unsharded)
    opt_per_param = MASTER_BYTES[prec] + STATE_COPIES[setup.optimizer] * s_b
    shard_b, reduce_b = p_b, p_b
    if fsdp:  # FSDP2 under bf16-master: the fp32 sharded parameters are the master weights
        shard_b, reduce_b = FSDP_SHARD_BYTES[prec], REDUCE_BYTES[prec]
        opt_per_param = STATE_COPIES[setup.optimizer] * s_b
    frozen = model.num_params - model.num_trainable_params
    trainable = model.num_trainable_params
    unit = model.largest_unit_params or model.num_params
    notes: list[str] = []

    # -- persistent per-rank state ---------------------------------------------------------
    if fsdp:
        params = per_rank_numel(model.num_params, n) * shard_b
        grads = per_rank_numel(trainable, n) * shard_b
        optimizer = per_rank_numel(trainable, n) * opt_per_param
    else:
        params = model.num_params * p_b
        grads = trainable * p_b
        optimizer = (zero1_rank_numel(model, n) if strat is Strategy.ZERO1 else trainable) \
            * opt_per_param
    buffers = model.buffer_bytes
    if frozen:
        notes.append(f"{frozen} frozen parameters: parameter bytes only, no gradient or "
                     f"optimizer state")

    # -- communication buffers: FSDP's all-gather buffers (the unit computed and the one
    # prefetched) and, late in backward only, its reduce-scatter buffers (trainable units) --
    bucket = comm_bw = comm_opt = comm_late = unsharded_late = 0
    unsharded = 0     # fsdp-grad-op: parameters gathered from forward to the end of backward
    gather_fw = 0     # fsdp-grad-op: all-gather buffers of the unit gathered in forward
    root, block = model.root_unit_params, model.largest_block_unit_params
    units_known = root is not None and block is not None
    rs_unit = unit if model.largest_trainable_unit_params is None \
        else model.largest_trainable_unit_params
    rs_unit = min(rs_unit, trainable)
    if strat in (Strategy.DDP, Strategy.ZERO1):
        if n > 1:
            bucket = trainable * p_b
            if not setup.gradient_as_bucket_view:
                comm_bw = comm_opt = bucket
                notes.append("DDP buckets hold one full gradient copy "
                             "(gradient_as_bucket_view=False)")
        else:
            notes.append("world size 1: Ray's prepare_model does not wrap DDP, no buckets")
    elif strat is Strategy.FSDP_FULL:
        if units_known:
            comm_bw = (root + 2 * block) * p_b
            gathered = (f"the root unit ({root} params, gathered from forward to the end of "
                        f"backward) and 2 all-gather buffers of the largest other unit "
                        f"({block} params)")
        else:
            comm_bw = 2 * unit * p_b
            gathered = f"2 all-gather buffers of the largest unit ({unit} params)"
        # forward, as the largest unit is gathered: its all-gather output beside its unsharded
        # copy (and the root, gathered first and kept)
        gather_fw = (max(2 * root, root + 2 * block) if units_known else 2 * unit) * p_b
        # late: the unit reducing was resharded first; only the prefetched one is gathered
        prefetched = root + block if units_known else unit
        comm_late = prefetched * p_b + 2 * rs_unit * reduce_b
        notes.append(f"FSDP: {gathered} from the start of backward, {p_b} bytes a parameter; "
                     f"2 reduce-scatter buffers of the largest trainable unit ({rs_unit} "
                     f"params, {reduce_b} bytes each) only late in backward, next to one "
                     f"gathered unit (a unit is resharded before it reduce-scatters)")
    else:  # FSDP_GRAD_OP
        # backward gathers nothing; gathering unit k in forward, the units before it are
        # unsharded and k's all-gather output lies beside its copy (FSDP2 gathers in place)
        unsharded = model.num_params * p_b
        gather_fw = (max(2 * root - model.num_params, block, 0) if units_known else unit) * p_b
        comm_late = 2 * rs_unit * reduce_b
        unsharded_late = (model.num_params - rs_unit) * p_b
        notes.append(f"SHARD_GRAD_OP keeps unsharded parameters ({unsharded / MiB:.1f} MiB, under "
                     f"params) from forward to the end of backward; in forward the all-gather "
                     f"output of the unit being gathered ({gather_fw // p_b} params); 2 "
                     f"reduce-scatter buffers of the largest trainable unit ({rs_unit} params) "
                     f"only late in backward, after that unit was resharded")

    if fsdp:
        states = params + unsharded + grads + optimizer
        notes.append(f"model states (the ZeRO paper's Table 1): parameters "
                     f"{(params + unsharded) / 1e9:.3f} GB + gradients {grads / 1e9:.3f} GB + "
                     f"optimizer {optimizer / 1e9:.3f} GB = {states / 1e9:.3f} GB")

    # -- activations and gradients alive at the backward peak ------------------------------
    acts = activations.at(setup.micro_batch)
    traced_grads = min(activations.gradient_bytes, acts)
    acts_fw = acts - traced_grads     # no gradient exists in forward
    every = fsdp and setup.fsdp_grad_sync is GradSync.EVERY_MICRO_BATCH
    if fsdp and traced_grads:
        # a trace without FSDP holds every gradient unsharded at its peak; FSDP holds the unit
        # reducing unsharded and the others' as shards (or, under accumulation, counts the
        # accumulated gradients in grads_bw below: only the unit's unsharded ones stay here)
        current = min(traced_grads, rs_unit * p_b)
        held = current if setup.grad_accum > 1 else \
            current + per_rank_numel(traced_grads - current, n)
        acts = acts - traced_grads + held
        notes.append(f"FSDP: of the trace's {traced_grads / MiB:.1f} MiB of unsharded gradients "
                     f"at its peak, {held / MiB:.1f} MiB are alive (one unit unsharded, the "
                     f"rest as shards)")
    if setup.grad_accum > 1 and every:
        # the accumulated shards, plus what a profile without gradients leaves out: the first
        # unit's unsharded gradients before they are reduce-scattered
        first = 0 if (activations.source == "traced" or activations.includes_gradients) \
            else rs_unit * p_b
        grads_bw = grads + first
        notes.append(f"grad_accum={setup.grad_accum}, every_micro_batch: the accumulated "
                     f"gradients stay sharded ({grads / MiB:.1f} MiB) through every backward")
    elif setup.grad_accum > 1:
        grads_bw = trainable * reduce_b if fsdp else grads
        notes.append(f"grad_accum={setup.grad_accum}" + (
            ", last_micro_batch: unsharded gradients" if fsdp else ": gradients") +
            " of earlier micro-steps live through every backward")
    elif activations.source == "traced" or activations.includes_gradients:
        grads_bw = 0  # the profile already holds the gradients alive at its peak
    else:  # the first unit's unsharded gradients, conservatively
        grads_bw = (rs_unit if fsdp else min(unit, trainable)) * p_b
    temp = optimizer_temp_bytes(model, setup)

    # each moment that can hold the peak, by category; a phase's bytes are its parts' sum
    parts = {
        "backward": _moment(params + unsharded, buffers, grads_bw, optimizer, acts,
                            comm=comm_bw),
        "optimizer": _moment(params, buffers, grads, optimizer, temp=temp, comm=comm_opt),
    }
    if fsdp:
        # the end of backward: activations freed, every sharded gradient written, the
        # reduce-scatter buffers in flight; under grad_accum the unsharded gradients of earlier
        # micro-steps are still alive
        grads_late = max(grads, grads_bw if setup.grad_accum > 1 else 0)
        parts["late-backward"] = _moment(params + unsharded_late, buffers, grads_late,
                                         optimizer, comm=comm_late)
        # forward, as a unit is gathered, with the forward's activations (no gradient of this
        # micro-batch yet; those of earlier ones under accumulation). A frozen backbone that is
        # a fine-tune's root peaks here, gathered twice over.
        grads_fw = 0 if setup.grad_accum == 1 else grads if every else grads_bw
        parts["forward"] = _moment(params + unsharded, buffers, grads_fw, optimizer, acts_fw,
                                   comm=gather_fw)
    if strat in (Strategy.DDP, Strategy.ZERO1) and n > 1:
        parts["rebuild"] = _moment(params, buffers, 0, optimizer, comm=2 * bucket)
    phases = {k: sum(v.values()) for k, v in parts.items()}
    phase = max(phases, key=lambda k: phases[k])
    peak = phases[phase]
    reserve = config.cuda_context_bytes + int(round(config.fragmentation_frac * peak))
    if fsdp and phase in ("backward", "forward") and setup.grad_accum == 1:
        # the previous step's gradient shards, freed by zero_grad(set_to_none=True), leave
        # holes (one per unit, smaller than the activations that follow) that stay reserved
        reserve += grads
        notes.append(f"reserve holds the previous step's gradient shards "
                     f"({grads / MiB:.1f} MiB): freed before forward, their blocks are smaller "
                     f"than the activations and stay reserved")
    breakdown = {**parts[phase], "reserve": reserve}
    notes.append(f"peak in {phase}: " + ", ".join(
        f"{k} {v / MiB:.1f} MiB" for k, v in phases.items()))
    return MemoryEstimate(peak_bytes=peak, total_bytes=peak + reserve, breakdown=breakdown,
                          peak_phase=phase, notes=tuple(notes), phases=phases)
