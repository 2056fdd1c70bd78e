"""Exact bytes of the memory model, worked out by hand (pure: no torch).

The model used throughout (``M``): 1000 parameters, all trainable, registered as tensors of
400, 300, 200 and 100 elements; the largest FSDP unit holds 400 parameters; no buffers.
Activations (``A``): a given profile of 5000 bytes per sample at micro-batch 2 -> 10000 bytes.
Reserve off (no CUDA context, no fragmentation) unless a test says otherwise.

Phases (see raytrain_guard.planner.memory_model):
  backward      = P + buffers + O + G_bw + A + comm_bw
  optimizer     = P + buffers + O + G + T + comm_opt
  rebuild       = P + buffers + O + 2 * buckets          (DDP/zero1 with more than one rank)
  late-backward = P + buffers + O + G + comm_late        (FSDP only; activations freed)
  forward       = P + buffers + O + A - traced grads + gathered          (FSDP only)
For a non-traced profile G_bw is the first unit's unsharded gradients (DDP/zero1: the largest
unit, 400 x grad bytes; FSDP: the largest trainable unit, also 400 for M).
FSDP comm, U = largest unit (400), R = largest trainable unit (unknown for M: U, capped at the
trainable count): fsdp-full comm_bw = 2 U (all-gather: computed + prefetched), comm_late =
U + 2 R (reduce-scatter buffers exist only late in backward, when the unit reducing has been
resharded: only the prefetched unit is gathered); fsdp-grad-op: all params unsharded, booked
under P, no all-gather in backward (comm_bw = 0); forward adds the all-gather output U (the
input shard is a slice of it); late in backward the unit reducing (R) was resharded: P - R
unsharded next to comm_late = 2 R. fsdp-full forward gathers 2 U: the all-gather output beside
the unit's unsharded copy.
"""

from __future__ import annotations

import pytest

from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import PlanInputError
from raytrain_guard.planner.memory_model import (
    GradSync,
    MemoryEstimate,
    OptimizerKind,
    Precision,
    Strategy,
    TrainingSetup,
    comm_bytes_per_step,
    default_fsdp_unit_params,
    estimate,
    zero1_rank_numel,
)
from raytrain_guard.planner.model_stats import ActivationProfile, ModelStats

M = ModelStats(num_params=1000, num_trainable_params=1000, largest_unit_params=400,
               param_numels=(400, 300, 200, 100))
A = ActivationProfile(bytes_per_sample=5000.0, source="given")
NO_RESERVE = GuardConfig(cuda_context_bytes=0, fragmentation_frac=0.0)


def run(setup: TrainingSetup, model: ModelStats = M, acts: ActivationProfile = A,
        config: GuardConfig = NO_RESERVE) -> MemoryEstimate:
    return estimate(model, acts, setup, config)


# precision x optimizer, DDP on one rank (no buckets), single-tensor optimizer (foreach=False):
# T (Adam/AdamW) = 2 copies of the largest parameter (400) in the state dtype; SGD: T = 0.
PRECISION_OPTIMIZER = [
    # precision, optimizer, backward, optimizer phase
    # fp32: P 4000, G 4000; G_bw 400*4 = 1600; A 10000
    ("fp32", "sgd", 4000 + 0 + 1600 + 10000, 4000 + 0 + 4000 + 0),                  # O 0
    ("fp32", "sgd-momentum", 4000 + 4000 + 1600 + 10000, 4000 + 4000 + 4000 + 0),   # O 4000
    ("fp32", "adam", 4000 + 8000 + 1600 + 10000, 4000 + 8000 + 4000 + 3200),        # O 8000, T 2*400*4
    ("fp32", "adamw", 4000 + 8000 + 1600 + 10000, 4000 + 8000 + 4000 + 3200),       # same as adam
    # amp-bf16: fp32 params, grads and state (the bf16 parts are in the activation profile)
    ("amp-bf16", "sgd", 15600, 8000),
    ("amp-bf16", "adamw", 23600, 19200),
    # bf16-master: P 2000, G 2000, O = 4 (master) + 4k; G_bw 400*2 = 800
    ("bf16-master", "sgd", 2000 + 4000 + 800 + 10000, 2000 + 4000 + 2000 + 0),       # O 4000
    ("bf16-master", "sgd-momentum", 2000 + 8000 + 800 + 10000, 2000 + 8000 + 2000),  # O 8000
    ("bf16-master", "adam", 2000 + 12000 + 800 + 10000, 2000 + 12000 + 2000 + 3200),  # 2+2+12
    # bf16: P 2000, G 2000, O 2k; T 2*400*2 = 1600
    ("bf16", "sgd", 2000 + 0 + 800 + 10000, 2000 + 0 + 2000),
    ("bf16", "sgd-momentum", 2000 + 2000 + 800 + 10000, 2000 + 2000 + 2000),
    ("bf16", "adamw", 2000 + 4000 + 800 + 10000, 2000 + 4000 + 2000 + 1600),
]


@pytest.mark.parametrize("precision,optimizer,backward,opt_phase", PRECISION_OPTIMIZER)
def test_precision_and_optimizer_bytes(precision, optimizer, backward, opt_phase):
    est = run(TrainingSetup(precision=precision, optimizer=optimizer, micro_batch=2,
                            foreach=False))
    assert dict(est.phases) == {"backward": backward, "optimizer": opt_phase}
    assert est.peak_bytes == max(backward, opt_phase)


# strategy x precision on 4 ranks, AdamW, foreach (CUDA default: T = one state-dtype copy of
# the parameters this rank updates; DDP all 1000, sharded strategies ceil(1000/4) = 250).
STRATEGIES = [
    # fp32: P 4000, G 4000, O 8000, buckets 4000
    ("ddp", "fp32", {"backward": 4000 + 8000 + 1600 + 10000 + 4000,        # + buckets
                     "optimizer": 4000 + 8000 + 4000 + 4000 + 4000,        # T 4000, buckets
                     "rebuild": 4000 + 8000 + 2 * 4000}),
    # zero1: ZeroRedundancyOptimizer gives whole parameters, largest first, to the least loaded
    # rank: 400 | 300 | 200 | 100 -> the most loaded rank holds 400. O 400*8 = 3200, T 400*4
    ("zero1", "fp32", {"backward": 4000 + 3200 + 1600 + 10000 + 4000,
                       "optimizer": 4000 + 3200 + 4000 + 1600 + 4000,
                       "rebuild": 4000 + 3200 + 8000}),
    # fsdp, fp32: P 250*4 = 1000, G 1000, O 250*8 = 2000, T 250*4 = 1000, G_bw 400*4 = 1600
    # grad-op: P + 4000 unsharded, no all-gather in backward; forward: AG output 400*4 (ties
    # with backward's first unit's gradients); late: (1000 - 400)*4 = 2400 unsharded + 2 RS
    # 2*400*4 = 3200
    ("fsdp-grad-op", "fp32", {"backward": 5000 + 2000 + 1600 + 10000,
                              "optimizer": 1000 + 2000 + 1000 + 1000,
                              "late-backward": 3400 + 2000 + 1000 + 3200,
                              "forward": 5000 + 2000 + 10000 + 1600}),
    # full: comm_bw = 2 AG 2*400*4 = 3200; comm_late = 1 AG (the prefetched unit: the unit
    # reducing is resharded first) 400*4 + 2 RS 2*400*4 = 1600 + 3200
    ("fsdp-full", "fp32", {"backward": 1000 + 2000 + 1600 + 10000 + 3200,
                           "optimizer": 1000 + 2000 + 1000 + 1000,
                           "late-backward": 1000 + 2000 + 1000 + 1600 + 3200,
                           "forward": 1000 + 2000 + 10000 + 3200}),     # 2 U: output + copy
    # bf16-master: P 2000, G 2000, O 12000, buckets 2000, G_bw 800, T (fp32 state) 1000*4
    ("ddp", "bf16-master", {"backward": 2000 + 12000 + 800 + 10000 + 2000,
                            "optimizer": 2000 + 12000 + 2000 + 4000 + 2000,
                            "rebuild": 2000 + 12000 + 4000}),
    # zero1: most loaded rank 400 params: O 400*12 = 4800, T 400*4 = 1600
    ("zero1", "bf16-master", {"backward": 2000 + 4800 + 800 + 10000 + 2000,
                              "optimizer": 2000 + 4800 + 2000 + 1600 + 2000,
                              "rebuild": 2000 + 4800 + 4000}),
    # fsdp, bf16-master = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the fp32
    # shard is the master, P 250*4 = 1000, G 250*4 = 1000, O 250*8 = 2000, T 250*4 = 1000;
    # gathered params and unsharded grads bf16: G_bw 400*2 = 800; reduce-scatter fp32
    # grad-op: P + 2000 bf16 unsharded; forward AG 400*2 = 800; late (1000 - 400)*2 = 1200
    # unsharded + 2 fp32 RS 2*400*4 = 3200
    ("fsdp-grad-op", "bf16-master", {"backward": 3000 + 2000 + 800 + 10000,
                                     "optimizer": 1000 + 2000 + 1000 + 1000,
                                     "late-backward": 2200 + 2000 + 1000 + 3200,
                                     "forward": 3000 + 2000 + 10000 + 800}),
    # full: comm_bw = 2*400*2 = 1600; comm_late = 1 AG 400*2 + 2 RS 2*400*4 = 800 + 3200
    ("fsdp-full", "bf16-master", {"backward": 1000 + 2000 + 800 + 10000 + 1600,
                                  "optimizer": 1000 + 2000 + 1000 + 1000,
                                  "late-backward": 1000 + 2000 + 1000 + 800 + 3200,
                                  "forward": 1000 + 2000 + 10000 + 1600}),
]


@pytest.mark.parametrize("strategy,precision,phases", STRATEGIES)
def test_strategy_bytes_on_four_ranks(strategy, precision, phases):
    est = run(TrainingSetup(strategy=strategy, precision=precision, optimizer="adamw",
                            micro_batch=2, world_size=4))
    assert dict(est.phases) == phases
    # grad-op: forward ties with backward (the first maximum in phase order wins)
    assert est.peak_phase == max(phases, key=phases.get) == "backward"
    parts = {k: v for k, v in est.breakdown.items() if k != "reserve"}
    assert sum(parts.values()) == est.peak_bytes  # breakdown = categories at the peak moment


def test_ddp_world_size_one_has_no_buckets():
    est = run(TrainingSetup(micro_batch=2))  # fp32 adamw foreach: T = 4000
    assert dict(est.phases) == {"backward": 4000 + 8000 + 1600 + 10000,
                                "optimizer": 4000 + 8000 + 4000 + 4000}
    assert est.breakdown["comm"] == 0


def test_gradient_as_bucket_view_drops_the_bucket_copy():
    est = run(TrainingSetup(micro_batch=2, world_size=4, gradient_as_bucket_view=True))
    # no extra copy; the rebuild still holds old and new buckets briefly: 4000 + 8000 + 2*4000
    assert dict(est.phases) == {"backward": 23600, "optimizer": 20000, "rebuild": 20000}


def test_rebuild_is_the_peak_when_activations_are_tiny():
    tiny = ActivationProfile(bytes_per_sample=1.0, source="given")
    est = run(TrainingSetup(optimizer="sgd", micro_batch=1, world_size=2), acts=tiny)
    # sgd: O 0, T 0. backward 4000 + 1600 + 1 + 4000 = 9601; optimizer 4000 + 4000 + 4000;
    # rebuild 4000 + 2*4000 = 12000 (ties with optimizer; the first maximum in order wins)
    assert dict(est.phases) == {"backward": 9601, "optimizer": 12000, "rebuild": 12000}
    assert est.peak_bytes == 12000


def test_grad_accum_keeps_all_gradients_through_backward():
    est = run(TrainingSetup(micro_batch=2, grad_accum=4))
    assert est.phases["backward"] == 4000 + 8000 + 4000 + 10000  # G_bw = all of G
    fsdp = run(TrainingSetup(strategy="fsdp-full", micro_batch=2, grad_accum=4, world_size=4))
    # no_sync under FSDP keeps unsharded gradients: 1000*4 on top of P 1000 + O 2000 + A 10000
    # + 2 AG 3200; late in backward they are still there (max(G 1000, 4000)) + 1 AG + 2 RS
    assert fsdp.phases["backward"] == 1000 + 2000 + 4000 + 10000 + 3200
    assert fsdp.phases["late-backward"] == 1000 + 2000 + 4000 + 1600 + 3200


def test_frozen_parameters_cost_parameter_bytes_only():
    frozen = ModelStats(num_params=1000, num_trainable_params=250, largest_unit_params=400,
                        param_numels=(250,))
    est = run(TrainingSetup(micro_batch=2), model=frozen)
    # P 4000, G 250*4 = 1000, O 250*8 = 2000, G_bw min(400, 250)*4 = 1000, T 250*4 = 1000
    assert dict(est.phases) == {"backward": 4000 + 2000 + 1000 + 10000,
                                "optimizer": 4000 + 2000 + 1000 + 1000}


def test_traced_profile_already_holds_backward_gradients():
    traced = ActivationProfile(bytes_per_sample=5000.0, fixed_bytes=700, source="traced")
    est = run(TrainingSetup(micro_batch=2), acts=traced)
    assert est.phases["backward"] == 4000 + 8000 + 0 + (700 + 10000)


def test_uneven_sharding_pads_like_fsdp():
    odd = ModelStats(num_params=1001, num_trainable_params=1001, largest_unit_params=401)
    est = run(TrainingSetup(strategy="fsdp-full", micro_batch=2, world_size=4), model=odd)
    # ceil(1001/4) = 251: P 1004, O 2008; G_bw 401*4 = 1604; 2 AG 2*401*4 = 3208
    assert est.phases["backward"] == 1004 + 2008 + 1604 + 10000 + 3208


# FSDP's reduce-scatter buffers hold gradients only: sized by the largest *trainable* unit.
# ModelStats(1000 params, 500 trainable, largest unit 600 (e.g. a frozen backbone)), fsdp-full
# on 2 ranks, AdamW foreach, fp32, tiny given activations (1 byte): P 500*4 = 2000,
# G 250*4 = 1000, O 250*8 = 2000, T 250*4 = 1000, 2 AG 2*600*4 = 4800 in backward, 1 AG
# 600*4 = 2400 late (the prefetched unit), G_bw R*4.
FROZEN_UNITS = [
    # largest trainable unit R, backward, late-backward
    (100, 2000 + 2000 + 400 + 1 + 4800, 2000 + 2000 + 1000 + 2400 + 2 * 100 * 4),   # known
    (250, 2000 + 2000 + 1000 + 1 + 4800, 2000 + 2000 + 1000 + 2400 + 2 * 250 * 4),
    # unknown: R = min(U 600, trainable 500) = 500, the safe side
    (None, 2000 + 2000 + 2000 + 1 + 4800, 2000 + 2000 + 1000 + 2400 + 2 * 500 * 4),
]


@pytest.mark.parametrize("largest_trainable,backward,late", FROZEN_UNITS)
def test_reduce_scatter_buffers_follow_the_largest_trainable_unit(largest_trainable, backward,
                                                                  late):
    model = ModelStats(num_params=1000, num_trainable_params=500, largest_unit_params=600,
                       largest_trainable_unit_params=largest_trainable)
    tiny = ActivationProfile(bytes_per_sample=1.0, source="given")
    est = run(TrainingSetup(strategy="fsdp-full", micro_batch=1, world_size=2), model=model,
              acts=tiny)
    # forward: 2 x 600 x 4 = 4800 gathered next to the 1-byte activations
    assert dict(est.phases) == {"backward": backward, "optimizer": 2000 + 2000 + 1000 + 1000,
                                "late-backward": late, "forward": 2000 + 2000 + 1 + 4800}
    # with one all-gather buffer late, a small reduce-scatter (R 100, 250) leaves the peak in
    # backward; the unknown R (500) keeps it late, where activations are freed
    assert est.peak_phase == ("late-backward" if largest_trainable is None else "backward")
    assert (est.breakdown["activations"] == 0) == (largest_trainable is None)


def test_fsdp_backward_peak_has_no_reduce_scatter_buffer():
    # M, fsdp-full, 2 ranks, fp32, traced profile (G_bw 0: its gradients are in the profile):
    # P 500*4 = 2000, O 500*8 = 4000, A 10000, 2 AG 2*400*4 = 3200 -> 19200; the reduce-scatter
    # buffers (2*400*4 = 3200) only count late in backward, next to 1 AG (400*4):
    # 2000 + 4000 + G 2000 + 1600 + 3200 = 12800
    traced = ActivationProfile(bytes_per_sample=5000.0, source="traced")
    est = run(TrainingSetup(strategy="fsdp-full", micro_batch=2, world_size=2), acts=traced)
    assert est.phases["backward"] == 2000 + 4000 + 10000 + 3200
    assert est.phases["late-backward"] == 2000 + 4000 + 2000 + 1600 + 3200
    assert est.peak_phase == "backward"
    assert est.breakdown["comm"] == 3200


@pytest.mark.parametrize("kwargs,field", [
    ({"num_params": 10, "num_trainable_params": 11}, "num_trainable_params"),
    ({"num_params": 10, "num_trainable_params": 5, "largest_trainable_unit_params": 6},
     "largest_trainable_unit_params"),
    ({"num_params": 10, "num_trainable_params": 5, "largest_trainable_unit_params": -1},
     "largest_trainable_unit_params"),
])
def test_bad_model_stats_are_plan_input_errors(kwargs, field):
    with pytest.raises(PlanInputError) as err:
        ModelStats(**kwargs)
    assert err.value.field == field
    assert err.value.fix


def test_buffers_count_in_every_phase():
    buf = ModelStats(num_params=1000, num_trainable_params=1000, largest_unit_params=400,
                     param_numels=(400, 300, 200, 100), buffer_bytes=777)
    est = run(TrainingSetup(micro_batch=2), model=buf)
    assert dict(est.phases) == {"backward": 23600 + 777, "optimizer": 20000 + 777}


def test_runtime_reserve_is_context_plus_fragmentation():
    cfg = GuardConfig(cuda_context_bytes=1000, fragmentation_frac=0.05)
    est = run(TrainingSetup(micro_batch=2), config=cfg)
    # peak 23600; reserve 1000 + 0.05 * 23600 = 2180
    assert est.peak_bytes == 23600
    assert est.breakdown["reserve"] == 2180
    assert est.total_bytes == 25780


def test_activations_scale_with_micro_batch():
    one = run(TrainingSetup(micro_batch=1)).phases["backward"]
    eight = run(TrainingSetup(micro_batch=8)).phases["backward"]
    assert eight - one == 7 * 5000


def test_strings_and_enums_are_the_same_setup():
    assert TrainingSetup(strategy="zero1", precision="bf16", optimizer="sgd") == TrainingSetup(
        strategy=Strategy.ZERO1, precision=Precision.BF16, optimizer=OptimizerKind.SGD)


@pytest.mark.parametrize("kwargs,field", [
    ({"micro_batch": 0}, "micro_batch"),
    ({"grad_accum": -1}, "grad_accum"),
    ({"world_size": 1.5}, "world_size"),
    ({"micro_batch": True}, "micro_batch"),
    ({"strategy": "zero2"}, "strategy"),
    ({"precision": "fp16"}, "precision"),
    ({"optimizer": "lion"}, "optimizer"),
    ({"bucket_cap_mb": 0}, "bucket_cap_mb"),
])
def test_bad_setup_names_the_field_and_the_fix(kwargs, field):
    with pytest.raises(PlanInputError) as err:
        TrainingSetup(**kwargs)
    assert err.value.field == field
    assert err.value.fix
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("numels,world_size,expected", [
    ((300, 300, 200, 200), 2, 500),        # 300 | 300, then 200 | 200: even
    ((600, 100, 100, 100, 100), 2, 600),   # 600 | 100+100+100+100: one big parameter wins
    ((400, 300, 200, 100), 4, 400),
    ((400, 300, 200, 100), 1, 1000),
    ((), 4, 250),                          # unknown layout: ceil(1000 / 4)
])
def test_zero1_most_loaded_rank(numels, world_size, expected):
    model = ModelStats(num_params=1000, num_trainable_params=1000, param_numels=numels)
    assert zero1_rank_numel(model, world_size) == expected


def test_fsdp_root_unit_stays_gathered_through_backward():
    # root 300 (embedding + head), blocks of at most 200: the root is gathered from forward to
    # the end of backward, and the two all-gather buffers are those of a block
    model = ModelStats(num_params=1000, num_trainable_params=1000, largest_unit_params=300,
                       root_unit_params=300, largest_block_unit_params=200)
    est = run(TrainingSetup(strategy="fsdp-full", precision="bf16-master", micro_batch=2,
                            world_size=4), model=model)
    # comm_bw = (300 + 2*200) * 2 = 1400; G_bw = largest trainable unit 300 * 2 = 600
    # backward = P 1000 + O 2000 + 600 + A 10000 + 1400
    assert est.phases["backward"] == 1000 + 2000 + 600 + 10000 + 1400
    # late: the root and one block gathered (300 + 200) * 2 = 1000 (the block reducing was
    # resharded first) + 2 fp32 reduce-scatter buffers of the largest trainable unit 2*300*4
    assert est.phases["late-backward"] == 1000 + 2000 + 1000 + 1000 + 2400
    assert any("root unit (300 params" in n for n in est.notes)


# -- FSDP gradient sync under accumulation ---------------------------------------------------

@pytest.mark.parametrize("strategy,last_bw,every_bw", [
    # M on 4 ranks, fp32, accumulation 4: P 1000, O 2000, A 10000, G (shards) 250*4 = 1000.
    # last: the unsharded gradients of all 1000 params (4000) through backward; every: the
    # shards (1000) + the first unit's unsharded gradients, given profile (400*4 = 1600).
    # full: 2 AG 3200; grad-op: P + 4000 unsharded, no all-gather in backward.
    ("fsdp-full", 1000 + 2000 + 4000 + 10000 + 3200, 1000 + 2000 + 2600 + 10000 + 3200),
    ("fsdp-grad-op", 5000 + 2000 + 4000 + 10000, 5000 + 2000 + 2600 + 10000),
])
def test_fsdp_grad_sync_modes_under_accumulation(strategy, last_bw, every_bw):
    def setup(sync):
        return TrainingSetup(strategy=strategy, micro_batch=2, grad_accum=4, world_size=4,
                             fsdp_grad_sync=sync)
    last, every = run(setup("last_micro_batch")), run(setup(GradSync.EVERY_MICRO_BATCH))
    assert last.phases["backward"] == last_bw
    assert every.phases["backward"] == every_bw
    assert every.peak_bytes < last.peak_bytes
    # the default is last_micro_batch, the loop's behaviour before the mode was a choice
    assert run(TrainingSetup(strategy=strategy, micro_batch=2, grad_accum=4,
                             world_size=4)).phases == last.phases
    # accumulation 1: the modes are the same step
    one = [run(TrainingSetup(strategy=strategy, micro_batch=2, world_size=4, fsdp_grad_sync=s))
           for s in GradSync]
    assert one[0].phases == one[1].phases


def test_last_micro_batch_accumulates_in_the_reduce_dtype():
    # bf16-master: FSDP2 upcasts the accumulated unsharded gradients to reduce_dtype fp32
    # (FSDPParam.to_accumulated_grad_if_needed): 1000 * 4, not 1000 * 2
    est = run(TrainingSetup(strategy="fsdp-full", precision="bf16-master", micro_batch=2,
                            grad_accum=2, world_size=4))
    assert est.breakdown["grads"] == 4000


def test_grad_op_books_unsharded_parameters_as_params():
    # ZeRO paper, Table 1, P_os+g: 7.5 B parameters, 64 ranks, mixed precision (2 bytes a
    # gathered parameter): 2 * 7.5e9 = 15 GB unsharded, the rest divided by 64.
    n = 7_500_000_000
    unit = default_fsdp_unit_params(n)                   # 937_500_000
    model = ModelStats(num_params=n, num_trainable_params=n, largest_unit_params=unit)
    est = run(TrainingSetup(strategy="fsdp-grad-op", precision="bf16", optimizer="adamw",
                            micro_batch=1, world_size=64), model=model,
              acts=ActivationProfile(bytes_per_sample=4e9, source="given"))
    shard = -(-n // 64)                                  # 117_187_500
    # backward (the first unit's unsharded gradients, 937.5 M x 2 B) ties with forward (the
    # all-gather output of the 1/8 unit, 937.5 M x 2 B): the first in phase order is shown
    assert est.peak_phase == "backward"
    assert est.phases["forward"] == est.phases["backward"]
    assert est.breakdown["params"] == 2 * n + 2 * shard  # unsharded bf16 + bf16 shards
    assert est.breakdown["optimizer"] == 4 * shard       # bf16 exp_avg + exp_avg_sq
    # comm holds only the collectives' buffers (none in backward: nothing is gathered again)
    assert est.breakdown["comm"] == 0 and est.breakdown["grads"] == unit * 2
    # late in backward the unit reducing is resharded: (n - unit) x 2 unsharded
    assert est.phases["late-backward"] == (n - unit) * 2 + 2 * shard + 4 * shard + 2 * shard \
        + 2 * unit * 2


def test_comm_bytes_per_step():
    # fsdp-full, fp32, 1000 params (no root known), 2 ranks, accumulation 4: gathers
    # 4 x 2 x 1000 x 4 = 32000 B; reduce-scatters 1 x 4000 (last) or 4 x 4000 (every); x 1/2
    def comm(strategy, sync, accum=4, world=2):
        return comm_bytes_per_step(M, TrainingSetup(strategy=strategy, grad_accum=accum,
                                                    world_size=world, fsdp_grad_sync=sync))
    assert comm("fsdp-full", "last_micro_batch") == (32000 + 4000) // 2
    assert comm("fsdp-full", "every_micro_batch") == (32000 + 16000) // 2
    # grad-op gathers once per micro-batch: 4 x 1000 x 4 = 16000
    assert comm("fsdp-grad-op", "every_micro_batch") == (16000 + 16000) // 2
    assert comm("ddp", "every_micro_batch") == 0 and comm("fsdp-full", "last_micro_batch",
                                                           world=1) == 0


def test_default_fsdp_unit_is_an_eighth():
    assert default_fsdp_unit_params(8000) == 1000 and default_fsdp_unit_params(3) == 1


def test_bad_grad_sync_names_the_field():
    with pytest.raises(PlanInputError, match="fsdp_grad_sync"):
        TrainingSetup(fsdp_grad_sync="sometimes")


@pytest.mark.parametrize("accum,sync,backward", [
    # a trace without FSDP: at its peak all 1000 x 4 = 4000 B of gradients, unsharded, inside
    # the profile (fixed 4000 + 5000 x 2 = 14000). fsdp-full on 4 ranks, fp32: FSDP holds the
    # unit reducing unsharded (R 400 x 4 = 1600) and the rest as shards ceil(2400 / 4) = 600:
    # activations 14000 - 4000 + 2200 = 12200; backward = P 1000 + O 2000 + 12200 + 2 AG 3200
    (1, "last_micro_batch", 1000 + 2000 + 12200 + 3200),
    # accumulation: the unit's 1600 stay in the activations, the accumulated gradients are
    # grads_bw: all shards 1000 (every) or all unsharded 4000 (last)
    (2, "every_micro_batch", 1000 + 2000 + 1000 + 11600 + 3200),
    (2, "last_micro_batch", 1000 + 2000 + 4000 + 11600 + 3200),
])
def test_fsdp_holds_a_traced_profiles_gradients_as_fsdp_does(accum, sync, backward):
    traced = ActivationProfile(bytes_per_sample=5000.0, fixed_bytes=4000, source="traced",
                               includes_gradients=True, gradient_bytes=4000)
    est = run(TrainingSetup(strategy="fsdp-full", micro_batch=2, world_size=4,
                            grad_accum=accum, fsdp_grad_sync=sync), acts=traced)
    assert est.phases["backward"] == backward
    # grad-op's forward holds no gradient of the micro-batch: activations 14000 - 4000
    op = run(TrainingSetup(strategy="fsdp-grad-op", micro_batch=2, world_size=4), acts=traced)
    assert op.phases["forward"] == 5000 + 2000 + 10000 + 400 * 4
