"""The capacity planner: exact bytes of the arithmetic, the micro-batch search, grad-accum,
bucket and DataLoader wiring, and the plan's dict."""

import dataclasses

import pytest

from raytrain_guard import Plan, plan
from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import PlanInputError
from raytrain_guard.planner.buckets import recommend_bucket_cap
from raytrain_guard.planner.dataloader_sizing import size_dataloader
from raytrain_guard.planner.memory_model import TrainingSetup, estimate
from raytrain_guard.planner.model_stats import ActivationProfile, ModelStats
from raytrain_guard.units import GiB, MiB

# A model whose memory is easy to add up by hand: 1 M fp32 parameters, SGD without momentum
# (no optimizer state, no temporaries), one rank (no DDP buckets), activations 1 MB per sample.
#   params 4 MB, gradients alive early in backward 4 MB, activations 1 MB x b
#   peak (backward) = 8 MB + 1 MB x b        (the optimizer phase is only 8 MB)
#   reserve = cuda_context 2 MB + fragmentation 10 % of the peak = 2.8 MB + 0.1 MB x b
#   total = 10.8 MB + 1.1 MB x b
# Card 40 MB, 15 % headroom: budget int(40e6 x 0.85) = 34 MB.
#   largest micro-batch: 1.1 MB x b <= 23.2 MB -> b <= 21.09 -> 21 (total 33.9 MB); 22 -> 35.0 MB
MODEL = ModelStats(num_params=1_000_000, num_trainable_params=1_000_000)
ACTS = ActivationProfile(bytes_per_sample=1_000_000.0, source="given")
CFG = GuardConfig(cuda_context_bytes=2_000_000, fragmentation_frac=0.1)
SGD = TrainingSetup(optimizer="sgd", micro_batch=4)
CARD = 40_000_000


def _plan(**kw) -> Plan:
    args = dict(model=MODEL, activations=ACTS, setup=SGD, device_memory_bytes=CARD,
                host_memory_bytes=None, cpus_per_node=None, config=CFG)
    args.update(kw)
    return plan(**args)


def test_exact_bytes_at_micro_batch_4():
    # b = 4: peak 8 + 4 = 12 MB; reserve 2 + 1.2 = 3.2 MB; total 15.2 MB.
    p = _plan()
    assert p.fits
    assert (p.budget_bytes, p.peak_bytes, p.total_bytes) == (34_000_000, 12_000_000, 15_200_000)
    b = p.estimate.breakdown
    assert (b["params"], b["grads"], b["optimizer"], b["activations"], b["comm"], b["reserve"]) \
        == (4_000_000, 4_000_000, 0, 4_000_000, 0, 3_200_000)
    assert p.estimate.peak_phase == "backward"
    # static = peak - activations = 8 MB = 7.6 MiB; 4 MB = 3.8 MiB; 3.2 MB = 3.1 MiB (3.05);
    # 15.2 MB = 14.5 MiB; 34 MB = 32.4 MiB; 40 MB = 38.1 MiB
    assert p.arithmetic == ("static 7.6 MiB + activations 3.8 MiB + reserve 3.1 MiB = 14.5 MiB "
                            "of a 32.4 MiB budget (85 % of 38.1 MiB)")


def test_largest_micro_batch_off_by_one():
    p = _plan()
    assert p.max_micro_batch == 21
    # b = 21: 10.8 + 23.1 = 33.9 MB fits; b = 22: 35.0 MB does not.
    at21 = _plan(setup=dataclasses.replace(SGD, micro_batch=21))
    at22 = _plan(setup=dataclasses.replace(SGD, micro_batch=22))
    assert at21.fits and at21.total_bytes == 33_900_000
    assert not at22.fits and at22.total_bytes == 35_000_000
    # 1 MB over = 976.6 KiB
    assert at22.arithmetic.endswith("over the 32.4 MiB budget (85 % of 38.1 MiB) by 976.6 KiB")


def test_headroom_changes_the_budget():
    # 30 % headroom: budget int(40e6 x 0.7) = 28 MB -> 1.1 MB x b <= 17.2 MB -> b = 15.
    p = _plan(config=CFG.replace(headroom_frac=0.3))
    assert (p.budget_bytes, p.max_micro_batch) == (28_000_000, 15)
    assert "(70 % of 38.1 MiB)" in p.arithmetic


@pytest.mark.parametrize("strategy, precision, optimizer, world", [
    ("ddp", "fp32", "adamw", 8), ("zero1", "amp-bf16", "adam", 4),
    ("fsdp-grad-op", "bf16-master", "adamw", 16), ("fsdp-full", "bf16", "sgd-momentum", 64)])
def test_search_matches_a_linear_scan(strategy, precision, optimizer, world):
    # The galloping search must find exactly the last micro-batch a linear scan finds.
    model = ModelStats(num_params=50_000_000, num_trainable_params=40_000_000,
                       largest_unit_params=5_000_000)
    acts = ActivationProfile(bytes_per_sample=37_000_000.0, fixed_bytes=3_000_000,
                             source="analytic")
    setup = TrainingSetup(strategy=strategy, precision=precision, optimizer=optimizer,
                          world_size=world)
    card = 16 * GiB
    p = plan(model=model, activations=acts, setup=setup, device_memory_bytes=card,
             host_memory_bytes=None, cpus_per_node=None)
    budget = int(card * 0.85)
    if strategy in ("ddp", "zero1"):
        # DDP keeps 2 buckets in flight free: 40 M fp32 grads = 160 MB / 8 = 20 MB = 19.07 MiB,
        # rounded up to 19.125 MiB; 2 x 19.125 MiB = 38.25 MiB off the budget
        cap = recommend_bucket_cap(grad_bytes=160_000_000, config=GuardConfig()).bucket_cap_mb
        assert cap == 19.125
        budget -= int(2 * cap * MiB)
    b = 1
    while estimate(model, acts, dataclasses.replace(p.setup, micro_batch=b)).total_bytes \
            <= budget:
        b += 1
    assert p.max_micro_batch == b - 1 > 1
    # the plan's figures are the memory model's, at the planned setup
    est = estimate(model, acts, p.setup)
    assert (p.peak_bytes, p.total_bytes, p.estimate.peak_phase) == (
        est.peak_bytes, est.total_bytes, est.peak_phase)


def test_monotone_in_the_card():
    # More memory never means a smaller largest micro-batch.
    found = [_plan(device_memory_bytes=m).max_micro_batch
             for m in range(14_000_000, 80_000_000, 3_000_000)]
    assert found == sorted(found) and found[0] >= 1 and found[-1] > found[0]


def test_does_not_fit_even_at_one():
    # b = 1: total 11.9 MB; budget int(13e6 x 0.85) = 11.05 MB.
    p = _plan(device_memory_bytes=13_000_000)
    assert (p.fits, p.max_micro_batch) == (False, 0)
    assert any("even micro-batch 1 does not fit" in w and "fsdp-full" in w for w in p.warnings)


@pytest.mark.parametrize("micro, auto, global_batch, expect_micro, expect_accum, warns", [
    # 64 per rank; largest 21: ceil(64 / 21) = 4 divides 64 -> 16 x 4 (16 >= 21 / 2)
    (1, True, 64, 16, 4, None),
    # 100 per rank: ceil(100 / 21) = 5 divides 100 -> 20 x 5
    (1, True, 100, 20, 5, None),
    # 97 is prime: its largest divisor <= 21 is 1 (< 21 / 2), so 21 x ceil(97 / 21) = 21 x 5
    (1, True, 97, 21, 5, "97 cannot be met exactly: 21 x 5 x 1 ranks = 105; exact: "
                         "micro-batch 1 x grad_accum 97 x 1 = 97"),
    # micro-batch fixed at 8: ceil(100 / 8) = 13 -> 104; exact would be 20 x 5
    (8, False, 100, 8, 13, "100 cannot be met exactly: 8 x 13 x 1 ranks = 104; exact: "
                           "micro-batch 20 x grad_accum 5 x 1 = 100"),
    # smaller than one micro-batch: 8 > 5 -> accumulation 1, 8 samples
    (8, False, 5, 8, 1, "5 cannot be met exactly: 8 x 1 x 1 ranks = 8"),
    # fixed micro-batch dividing it: 96 / 8 = 12
    (8, False, 96, 8, 12, None),
    # no global batch, auto: the largest that fits, accumulation from the setup
    (1, True, None, 21, 1, None),
])
def test_grad_accum(micro, auto, global_batch, expect_micro, expect_accum, warns):
    p = _plan(setup=dataclasses.replace(SGD, micro_batch=micro), global_batch=global_batch,
              auto_micro_batch=auto)
    assert (p.micro_batch, p.grad_accum) == (expect_micro, expect_accum)
    assert p.global_batch == expect_micro * expect_accum * 1
    exact = [w for w in p.warnings if "cannot be met exactly" in w]
    if warns is None:
        assert exact == []
    else:
        assert len(exact) == 1 and warns in exact[0]


def test_global_batch_not_a_multiple_of_the_world():
    p = _plan(setup=dataclasses.replace(SGD, world_size=3, micro_batch=2), global_batch=100)
    # ceil(100 / (2 x 3)) = 17 -> 102
    assert (p.grad_accum, p.global_batch) == (17, 102)
    assert any("not a multiple of the world size 3" in w for w in p.warnings)


def test_grad_accum_from_setup_without_global():
    p = _plan(setup=TrainingSetup(optimizer="sgd", micro_batch=2, grad_accum=3, world_size=4))
    assert (p.grad_accum, p.global_batch, p.requested_global_batch) == (3, 24, None)


def test_unknown_activations_are_said():
    p = _plan(activations=ActivationProfile(0.0, source="unknown"))
    assert p.max_micro_batch is None and p.fits
    assert any("activations unknown" in w for w in p.warnings)
    assert p.estimate.breakdown["activations"] == 0


def test_ddp_bucket_recommendation_is_wired():
    # 2 ranks DDP: buckets exist. The plan's cap is recommend_bucket_cap on the fp32 gradient
    # bytes (4 MB) bounded by the memory the plan leaves free.
    setup = dataclasses.replace(SGD, world_size=2)
    p = _plan(setup=setup, device_memory_bytes=4 * GiB)
    slack = p.budget_bytes - p.total_bytes
    expected = recommend_bucket_cap(grad_bytes=4_000_000, config=CFG, memory_slack_bytes=slack)
    assert p.bucket_cap_mb == expected.bucket_cap_mb == 1.0   # 4 MB / 8 < 1 MiB -> 1 MiB
    assert p.setup.bucket_cap_mb == 1.0
    assert p.to_dict()["bucket"]["inputs"]["grad_bytes"] == 4_000_000


def test_curve_reaches_the_plan():
    curve = [(1 * MiB, 0.001), (16 * MiB, 0.004), (64 * MiB, 0.014)]
    model = ModelStats(num_params=100_000_000, num_trainable_params=20_000_000)
    p = plan(model=model, activations=ACTS, setup=TrainingSetup(world_size=8),
             device_memory_bytes=80 * GiB, host_memory_bytes=None, cpus_per_node=None,
             bandwidth_curve=curve)
    # 80 MB of fp32 gradients / 8 = 10 MB < 16 MiB efficient -> 16 MiB
    assert p.bucket_cap_mb == 16.0


def test_fsdp_has_no_bucket_cap():
    p = _plan(setup=TrainingSetup(strategy="fsdp-full", world_size=4))
    assert p.bucket is None and p.to_dict()["bucket_cap_mb"] is None


def test_dataloader_is_sized_from_sample_bytes():
    # micro-batch 4 x 250 kB per sample = 1 MB per batch, pinned
    p = _plan(host_memory_bytes=64 * GiB, cpus_per_node=32, gpus_per_node=4, sample_bytes=250e3)
    expected = size_dataloader(batch_bytes=1_000_000, host_memory_bytes=64 * GiB,
                               gpus_per_node=4, cpus_per_node=32, pin_memory=True, config=CFG)
    assert p.dataloader == expected
    assert p.dataloader.num_workers == 7


def test_list_backed_warning_reaches_the_plan():
    p = _plan(host_memory_bytes=64 * GiB, cpus_per_node=8, batch_bytes=1000,
              list_backed_dataset=True)
    assert any("Python lists" in w for w in p.warnings)


def test_batch_over_the_host_budget_is_bad_input():
    with pytest.raises(PlanInputError, match="batch_bytes"):
        _plan(host_memory_bytes=1 * GiB, cpus_per_node=8, batch_bytes=1 * GiB)


@pytest.mark.parametrize("kw, field", [
    ({"device_memory_bytes": 0}, "device_memory_bytes"),
    ({"gpus_per_node": 0}, "gpus_per_node"),
    ({"global_batch": -4}, "global_batch"),
    ({"batch_bytes": 0}, "batch_bytes"),
])
def test_bad_inputs(kw, field):
    with pytest.raises(PlanInputError) as err:
        _plan(**kw)
    assert err.value.field == field


def test_to_dict_keys():
    import json

    d = _plan(host_memory_bytes=64 * GiB, cpus_per_node=8, batch_bytes=1000).to_dict()
    for key in ("fits", "device_memory_bytes", "budget_bytes", "peak_bytes", "total_bytes",
                "breakdown", "peak_phase", "max_micro_batch", "grad_accum", "bucket_cap_mb",
                "dataloader", "warnings", "arithmetic", "micro_batch", "global_batch"):
        assert key in d, key
    assert set(d["breakdown"]) >= {"params", "grads", "optimizer", "activations", "comm",
                                   "reserve"}
    assert set(d["dataloader"]) >= {"num_workers", "prefetch_factor", "host_bytes"}
    assert d["total_bytes"] == d["peak_bytes"] + d["breakdown"]["reserve"]
    json.dumps(d)


def test_auto_micro_batch_respects_the_host_budget():
    # 1 MB per sample, pinned -> 2 MB; 16 cores // 1 GPU - 1 = 15 -> 8 workers; host budget
    # 0.05 x 4 GiB = 214748364 B; 214748364 // (8 x 2 MB) = 13 samples per micro-batch, below
    # the device limit of 21.
    p = _plan(auto_micro_batch=True, sample_bytes=1e6, host_memory_bytes=4 * GiB,
              cpus_per_node=16)
    assert (p.max_micro_batch, p.micro_batch) == (21, 13)
    assert p.dataloader.num_workers == 8 and p.dataloader.host_bytes <= p.dataloader.budget_bytes
    assert any("host prefetch budget" in n for n in p.notes)
    # a global batch of 8 x 1: the cap does not bind, no note
    q = _plan(auto_micro_batch=True, sample_bytes=1e6, host_memory_bytes=4 * GiB,
              cpus_per_node=16, global_batch=8)
    assert q.micro_batch == 8 and not any("host prefetch budget" in n for n in q.notes)


@pytest.mark.parametrize("strategy, world, adds_ranks", [
    ("ddp", 1, False), ("ddp", 4, False),         # a DDP replica is as large on any rank count
    ("zero1", 4, True), ("fsdp-grad-op", 4, True),
])
def test_does_not_fit_advice_adds_ranks_only_where_they_shard(strategy, world, adds_ranks):
    from raytrain_guard.planner.memory_model import TrainingSetup
    from raytrain_guard.planner.plan import _fixes_for
    fixes = _fixes_for(TrainingSetup(strategy=strategy, world_size=world))
    assert ("add ranks" in fixes) is adds_ranks, fixes
    assert "fsdp-full" in fixes


# -- FSDP gradient sync under accumulation ---------------------------------------------------
# MODEL with its largest FSDP unit 100 k parameters, fsdp-full on 4 ranks, SGD, fp32, the CFG
# reserve, the 40 MB card (budget 34 MB). Shards: P 250 k x 4 = 1 MB, G 1 MB, O 0;
# 2 all-gather buffers 2 x 100 k x 4 = 0.8 MB; the first unit's unsharded gradients 0.4 MB.
#   accumulation 1 (both modes): peak 1 + 0.4 + 0.8 + b = 2.2 + b MB, reserve 2 + 0.1 peak +
#     the previous step's shards 1 -> total 5.42 + 1.1 b <= 34: b <= 25
#   last_micro_batch, accumulation > 1: unsharded gradients 4 MB through backward: peak
#     1 + 4 + 0.8 + b = 5.8 + b, total 8.38 + 1.1 b <= 34: b <= 23
#   every_micro_batch: the shards 1 MB + 0.4: peak 3.2 + b, total 5.52 + 1.1 b: b <= 25
# Global batch 384 = 96 per rank: every -> 24 x 4 (largest divisor <= 25); last -> 16 x 6
# (first 24 x 4 at accumulation 1, then <= 23 with the unsharded gradients: 16).
FSDP_MODEL = dataclasses.replace(MODEL, largest_unit_params=100_000)
FSDP_SGD = TrainingSetup(strategy="fsdp-full", optimizer="sgd", world_size=4)


def test_auto_grad_sync_picks_the_mode_with_the_larger_micro_batch():
    p = _plan(model=FSDP_MODEL, setup=FSDP_SGD, global_batch=384, auto_micro_batch=True)
    assert p.fsdp_grad_sync == "every_micro_batch"
    assert (p.micro_batch, p.grad_accum, p.max_micro_batch) == (24, 4, 25)
    by_mode = {o["fsdp_grad_sync"]: o for o in p.grad_sync_options}
    assert (by_mode["last_micro_batch"]["micro_batch"], by_mode["last_micro_batch"]["grad_accum"],
            by_mode["last_micro_batch"]["max_micro_batch"]) == (16, 6, 23)
    assert by_mode["every_micro_batch"]["chosen"] and not by_mode["last_micro_batch"]["chosen"]
    # bytes through the collectives per step, x (4 - 1) / 4: gathers 2 x 1 M x 4 B per
    # micro-batch; reduce-scatters 1 M x 4 B once (last) or per micro-batch (every)
    every, last = by_mode["every_micro_batch"], by_mode["last_micro_batch"]
    assert every["comm_bytes_per_step"] == (4 * 8_000_000 + 4 * 4_000_000) * 3 // 4
    assert last["comm_bytes_per_step"] == (6 * 8_000_000 + 4_000_000) * 3 // 4
    d = p.to_dict()
    assert d["fsdp_grad_sync"] == "every_micro_batch" and len(d["fsdp_grad_sync_options"]) == 2
    assert d["comm_bytes_per_step"] == by_mode["every_micro_batch"]["comm_bytes_per_step"]


def test_grad_sync_tie_goes_to_less_communication():
    # no activation bytes: neither mode limits the micro-batch; at 4 x 4 last_micro_batch
    # reduce-scatters once instead of 4 times
    flat = ActivationProfile(bytes_per_sample=0.0, source="given")
    p = _plan(model=FSDP_MODEL, activations=flat,
              setup=dataclasses.replace(FSDP_SGD, micro_batch=4, grad_accum=4))
    assert p.fsdp_grad_sync == "last_micro_batch"
    comm = {o["fsdp_grad_sync"]: o["comm_bytes_per_step"] for o in p.grad_sync_options}
    assert comm["last_micro_batch"] < comm["every_micro_batch"]


def test_grad_sync_as_asked_and_refused_when_unknown():
    p = _plan(model=FSDP_MODEL, setup=FSDP_SGD, global_batch=384, auto_micro_batch=True,
              fsdp_grad_sync="last_micro_batch")
    assert p.fsdp_grad_sync == "last_micro_batch" and p.setup.fsdp_grad_sync.value == \
        "last_micro_batch"
    assert (p.micro_batch, p.grad_accum) == (16, 6)
    with pytest.raises(PlanInputError, match="fsdp_grad_sync.*every_micro_batch"):
        _plan(model=FSDP_MODEL, setup=FSDP_SGD, fsdp_grad_sync="sometimes")
    ddp = _plan()
    assert ddp.fsdp_grad_sync is None and ddp.grad_sync_options == ()
    assert ddp.to_dict()["fsdp_grad_sync"] is None
