"""Issue 11: memory actions priced with the planner's memory model before they are decided.

The model: 2 B trainable parameters (fp32, AdamW), FSDP units of 100 M parameters, 8 ranks,
an activation profile of 6 GiB per sample ("given": the model adds the first unit's gradients
at accumulation 1), an 80 GiB card. Each prediction is held to ``planner.memory_model.estimate``
on the same setup (the planner's model, not a second one; its reserve rules included).

Shrinking micro-batch 2 x accumulation 1 to 1 x 2 frees one sample of activations (6 GiB), and:

* FSDP, last-micro-batch sync (no_sync until the last micro-batch): the first micro-batch's
  unsharded gradients (2e9 x 4 B = 7.45 GiB) live through the second backward: the backward
  peak grows by 7.45 - 0.37 (the first unit's, counted at accumulation 1) - 6 = +1.08 GiB.
  The shrink RAISES the peak: refused.
* FSDP, every-micro-batch sync: accumulated gradients stay sharded (0.93 GiB): the peak falls by
  about 5 GiB: chosen.
* DDP: the peak is the optimizer step (all gradients, optimizer state, buckets: 48 GB), which
  no micro-batch moves: predicted to free nothing.
"""

from __future__ import annotations

import dataclasses

import pytest

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Cause
from raytrain_guard.core.effects import (
    GradSync,
    Measured,
    RunPlan,
    Verdict,
    judge,
    prefetch_effect,
    release_effect,
    reserved_peak_bytes,
    shrink_effect,
)
from raytrain_guard.core.node_samples import HostSample, NodeSample, RunSetup
from raytrain_guard.core.policy import decide
from raytrain_guard.core.steps import StepStats
from raytrain_guard.core.view import ClusterView, PolicyState, RankView
from raytrain_guard.planner.memory_model import TrainingSetup, estimate
from raytrain_guard.planner.model_stats import ActivationProfile, ModelStats
from raytrain_guard.units import GiB, MiB

CFG = GuardConfig()
CARD = 80 * GiB
MODEL = ModelStats(num_params=2_000_000_000, num_trainable_params=2_000_000_000,
                   largest_unit_params=100_000_000)
ACTS = ActivationProfile(bytes_per_sample=6 * GiB, source="given")


def plan(strategy, grad_sync=GradSync.LAST_MICRO_BATCH, mb=2, ga=1):
    setup = TrainingSetup(strategy=strategy, micro_batch=mb, grad_accum=ga, world_size=8)
    return RunPlan(MODEL, ACTS, setup, CARD, grad_sync)


def total(strategy, mb, ga):
    """The planner's own figure: estimate(...).total_bytes."""
    setup = TrainingSetup(strategy=strategy, micro_batch=mb, grad_accum=ga, world_size=8)
    return estimate(MODEL, ACTS, setup, CFG).total_bytes


# -- predictions pinned to the memory model ------------------------------------------------------

@pytest.mark.parametrize("strategy", ["ddp", "fsdp-full", "fsdp-grad-op"])
def test_shrink_prediction_is_the_memory_models_change(strategy):
    # last-micro-batch sync is what estimate() models for accumulation: the same delta
    e = shrink_effect(plan(strategy), 2, 1, 0.91)
    want = (total(strategy, 1, 2) - total(strategy, 2, 1)) / CARD
    assert e.delta_frac == pytest.approx(want, abs=1e-12)
    assert e.memory_frac_after == pytest.approx(0.91 + want)
    assert dict(e.params) == {"micro_batch": 1, "grad_accum": 2}


def _phases(strategy, mb, ga):
    setup = TrainingSetup(strategy=strategy, micro_batch=mb, grad_accum=ga, world_size=8)
    return estimate(MODEL, ACTS, setup, CFG).phases


def test_shrink_raises_the_peak_under_fsdp_last_micro_batch_sync():
    # the backward peak: + 2e9 x 4 B (unsharded gradients) - 100e6 x 4 B (the first unit's,
    # counted at accumulation 1) - 6 GiB (one sample of activations) = +1.08 GiB
    grown = _phases("fsdp-full", 1, 2)["backward"] - _phases("fsdp-full", 2, 1)["backward"]
    assert grown == 2_000_000_000 * 4 - 100_000_000 * 4 - 6 * GiB
    e = shrink_effect(plan("fsdp-full"), 2, 1, 0.91)
    assert e.delta_frac == pytest.approx((total("fsdp-full", 1, 2) - total("fsdp-full", 2, 1))
                                         / CARD, abs=1e-12)
    assert e.memory_frac_after > 0.91
    assert "last-micro-batch gradient sync" in e.basis


def test_shrink_lowers_the_peak_under_fsdp_every_micro_batch_sync():
    # the model at accumulation 1, micro-batch 1, plus the sharded gradients (2e9 x 4 / 8 B)
    # alive through backward: the backward peak falls by 6 GiB - 1e9 B, and with it the
    # fragmentation share of the reserve
    fell = _phases("fsdp-full", 1, 1)["backward"] + 2_000_000_000 * 4 // 8 \
        - _phases("fsdp-full", 2, 1)["backward"]
    assert fell == 1_000_000_000 - 6 * GiB
    e = shrink_effect(plan("fsdp-full", GradSync.EVERY_MICRO_BATCH), 2, 1, 0.91)
    assert e.delta_frac == pytest.approx(fell * (1 + CFG.fragmentation_frac) / CARD, abs=1e-9)
    assert e.memory_frac_after < 0.85


def test_shrink_frees_nothing_where_the_optimizer_step_is_the_peak():
    # DDP: the optimizer phase (48e9 B) is the peak at both layouts: no change predicted
    assert max(_phases("ddp", 2, 1), key=_phases("ddp", 2, 1).get) == "optimizer"
    assert shrink_effect(plan("ddp"), 2, 1, 0.91).delta_frac == 0.0


def test_reserved_peak_at_accumulation_1_is_the_models_whatever_the_sync():
    for sync in GradSync:
        p = plan("fsdp-full", sync)
        assert reserved_peak_bytes(p, 2, 1) == total("fsdp-full", 2, 1) - CFG.cuda_context_bytes


def test_odd_micro_batch_is_not_shrunk():
    assert "odd" in shrink_effect(plan("ddp"), 3, 1, 0.91)


def test_release_frees_reserved_minus_allocated_less_what_the_peak_re_reserves():
    # reserved 72 GiB, allocated 60 GiB: 12 GiB cached (15 % of the card)
    e = release_effect(0.90, 60 * GiB, 72 * GiB, CARD)
    assert e.delta_frac == pytest.approx(-12 / 80) and e.cost_frac == 0.0
    # with the plan, the next step's reserved peak comes back: only the cache above it is freed
    p = plan("ddp")
    peak = reserved_peak_bytes(p, 2, 1)
    e = release_effect(0.90, 1 * GiB, peak + 3 * GiB, CARD, p, 2, 1)
    assert e.delta_frac == pytest.approx(-3 * GiB / CARD)


def test_prefetch_frees_the_batches_in_flight():
    # 4 -> 2 on 2 ranks of 4 workers, 256 MiB batches: (4 - 2) x 4 x 256 MiB x 2 = 4 GiB
    e = prefetch_effect(0.95, 100 * GiB, 4, 2, [(4, 256 * MiB), (4, 256 * MiB)], 0.02)
    assert e.delta_frac == pytest.approx(-0.04) and e.cost_frac == 0.02
    assert e.resource == "host_memory"


def test_plan_round_trips_as_a_dict():
    p = plan("fsdp-grad-op", GradSync.EVERY_MICRO_BATCH)
    assert RunPlan.from_dict(p.to_dict()) == p


# -- the policy picks the cheapest action predicted to help ------------------------------------

def _window(rank, mem, first=31, n=10):
    return tuple(StepStats(step=s, total_s=1.0, data_wait_s=0.05, forward_s=0.5,
                           comm_wait_s=0.45, memory_frac=mem, world_rank=rank)
                 for s in range(first, first + n))


def _view(mem, *, run_plan=None, cached_gib=1.0, device="cuda", mb=2, ga=1):
    reserved = int(mem * CARD)
    setup = RunSetup(mb, ga, 2, device=device, allocated_bytes=reserved - int(cached_gib * GiB),
                     reserved_bytes=reserved, device_total_bytes=CARD)
    return ClusterView({0: RankView(0, "n0", _window(0, 0.5), setup),
                        1: RankView(1, "n0", _window(1, mem), setup)}, {}, run_plan)


def _decide(v, state=None):
    return decide(v, state or PolicyState(), CFG, 60)


def test_shrink_refused_under_fsdp_last_sync_and_a_release_chosen_instead():
    # rank 1 at 91 % (critical): the shrink is predicted to raise it, the release of 8 GiB
    # cached (10 % of the card) to bring it to 81 % < 85 %: the release
    out = _decide(_view(0.91, run_plan=plan("fsdp-full"), cached_gib=8.0))
    (d,) = out.decisions
    assert d.action is Action.RELEASE_CACHE
    assert d.predicted["memory_frac_after"] == pytest.approx(0.91 - 0.1, abs=1e-4)
    e = shrink_effect(plan("fsdp-full"), 2, 1, 0.91)
    assert any(n.startswith(f"shrink_micro_batch not chosen: predicted 91.0% -> "
                            f"{e.memory_frac_after:.1%}") for n in out.notes)


def test_shrink_refused_and_nothing_else_helps_checkpoint_and_stop():
    # 1 GiB cached (1.25 % < 5 % of the card): no release; the shrink would raise the peak
    out = _decide(_view(0.91, run_plan=plan("fsdp-full")))
    (d,) = out.decisions
    assert d.action is Action.CHECKPOINT_AND_STOP and out.state.stop_step == 60
    assert "no action is predicted to bring it under 85%" in d.reason
    e = shrink_effect(plan("fsdp-full"), 2, 1, 0.91)
    assert f"shrink_micro_batch predicted {e.memory_frac_after:.1%}" in d.reason


def test_shrink_chosen_under_every_micro_batch_sync_with_its_prediction():
    p = plan("fsdp-full", GradSync.EVERY_MICRO_BATCH)
    out = _decide(_view(0.91, run_plan=p))
    (d,) = out.decisions
    assert d.action is Action.SHRINK_MICRO_BATCH and dict(d.params) == {"micro_batch": 1,
                                                                        "grad_accum": 2}
    e = shrink_effect(p, 2, 1, 0.91)
    assert d.predicted == e.to_dict() and d.predicted["memory_frac_after"] < 0.85


def test_a_release_is_cheaper_than_a_shrink_when_both_help():
    p = plan("fsdp-full", GradSync.EVERY_MICRO_BATCH)
    (d,) = _decide(_view(0.91, run_plan=p, cached_gib=8.0)).decisions
    assert d.action is Action.RELEASE_CACHE


def test_no_cache_release_on_cpu():
    out = _decide(_view(0.89, device="cpu", cached_gib=8.0))
    assert out.decisions == ()
    assert "no cache release: the run is on CPU, where there is no allocator cache" in out.notes


def test_no_release_when_the_allocator_holds_little_cache():
    out = _decide(_view(0.89, cached_gib=2.0))          # 2.5 % of the card < 5 %
    assert out.decisions == ()
    assert out.notes == (("no cache release: rank 1 (node n0) holds 2048 MiB cached but "
                          "unallocated, under 5% of the card"),)


def test_no_repeated_release_on_a_steady_reading_without_allocator_figures():
    def unpriced(mem):
        return ClusterView({0: RankView(0, "n0", _window(0, 0.5)),
                            1: RankView(1, "n0", _window(1, mem))})
    first = _decide(unpriced(0.89))
    assert [d.action for d in first.decisions] == [Action.RELEASE_CACHE]
    assert first.decisions[0].predicted is None
    cooled = dataclasses.replace(first.state, last_release_step=20)     # cooldown over
    assert _decide(unpriced(0.89), cooled).decisions == ()               # steady: not again
    dipped = _decide(unpriced(0.84), cooled).state                       # under 85 %: re-armed
    assert [d.action for d in _decide(unpriced(0.89), dipped).decisions] == \
        [Action.RELEASE_CACHE]


def test_escalation_after_a_release_that_missed():
    missed_release = PolicyState(missed=frozenset({"release_cache:device_memory"}))
    # 91 %, 8 GiB cached: the release would be chosen, but it missed: the shrink
    p = plan("fsdp-full", GradSync.EVERY_MICRO_BATCH)
    (d,) = _decide(_view(0.91, run_plan=p, cached_gib=8.0), missed_release).decisions
    assert d.action is Action.SHRINK_MICRO_BATCH
    # FSDP last-micro-batch sync: the shrink would raise the peak: checkpoint and stop
    (d,) = _decide(_view(0.91, run_plan=plan("fsdp-full"), cached_gib=8.0),
                   missed_release).decisions
    assert d.action is Action.CHECKPOINT_AND_STOP


def test_a_miss_is_below_half_the_prediction_and_unpriced_is_not_judged():
    def m(before, after):
        return Measured(before, after, 1.0, 1.0, 0.0, 0.0, 10, 10)
    predicted = {"delta_frac": -0.08}
    assert judge(predicted, m(0.90, 0.89), 0.5) is Verdict.MISS         # 0.01 < 0.04
    assert judge(predicted, m(0.90, 0.85), 0.5) is Verdict.HIT          # 0.05 >= 0.04
    # nothing to hold it to: unpriced, a fall fell or not
    assert judge(None, m(0.90, 0.90), 0.5) is Verdict.NOT_JUDGED
    assert judge(None, m(0.90, 0.80), 0.5) is Verdict.NOT_JUDGED
    assert judge({"delta_frac": 0.0}, m(0.90, 0.80), 0.5) is Verdict.NOT_JUDGED  # no fall due
    assert judge(predicted, m(None, 0.80), 0.5) is Verdict.NOT_JUDGED   # no reading before


def test_prefetch_decision_carries_its_prediction():
    # 92.5 % used (under the 93 % stop line); prefetch 4 -> 2 frees 2 x 4 workers x 128 MiB
    # on each of 2 ranks: 2 % of the node, leaving it at 90.5 %, over the 90 % watermark
    host = HostSample(100 * GiB, int(7.5 * GiB))
    setup = RunSetup(8, 1, 4, num_workers=4, batch_bytes=128 * MiB)
    v = ClusterView({0: RankView(0, "n1", _window(0, None), setup),
                     1: RankView(1, "n1", _window(1, None), setup)},
                    {"n1": NodeSample("n1", 1, "e", 0.0, host)})
    (d,) = _decide(v).decisions
    assert d.action is Action.SET_PREFETCH and d.cause is Cause.HOST_MEMORY
    assert d.predicted["delta_frac"] == pytest.approx(-0.02)
    assert "short of the watermark" in d.reason


def test_decision_keeps_predicted_and_measured_through_dicts_and_pickling():
    import pickle

    from raytrain_guard.core.decisions import Decision
    e = shrink_effect(plan("fsdp-full", GradSync.EVERY_MICRO_BATCH), 2, 1, 0.91)
    d = Decision(Action.SHRINK_MICRO_BATCH, "why", 60, Cause.DEVICE_MEMORY, "cluster",
                 dict(e.params), 7, predicted=e.to_dict(),
                 measured={"delta_frac": -0.05, "verdict": "hit"})
    assert Decision.from_dict(d.to_dict()) == d
    assert pickle.loads(pickle.dumps(d)) == d
    assert d.at(70).predicted == d.predicted and d.at(70).step == 70
    # a dict from before issue 11 (no predicted / measured) still reads
    old = {k: v for k, v in d.to_dict().items() if k not in ("predicted", "measured")}
    assert Decision.from_dict(old).predicted is None


def test_at_critical_the_effect_of_a_recent_action_is_awaited_before_escalating():
    # a release applied at step 30; latest step 40 < 30 + 20: its effect is not reported yet
    recent = PolicyState(last_release_step=30)
    out = _decide(_view(0.91, run_plan=plan("fsdp-full")), recent)
    assert out.decisions == ()
    assert "waiting for the effect of the cache release before escalating" in out.notes[-1]
    # once it is (released at 20: 40 >= 40), nothing predicted to help: checkpoint and stop
    (d,) = _decide(_view(0.91, run_plan=plan("fsdp-full")),
                   PolicyState(last_release_step=20)).decisions
    assert d.action is Action.CHECKPOINT_AND_STOP


def test_no_repeated_priced_release_on_a_steady_reading_until_its_effect_is_measured():
    first = _decide(_view(0.89, cached_gib=8.0))
    assert [d.action for d in first.decisions] == [Action.RELEASE_CACHE]
    cooled = dataclasses.replace(first.state, last_release_step=20)
    assert _decide(_view(0.89, cached_gib=8.0), cooled).decisions == ()   # same reading: no
    hit = dataclasses.replace(cooled, release_armed=True)                 # measured a hit
    assert [d.action for d in _decide(_view(0.89, cached_gib=8.0), hit).decisions] == \
        [Action.RELEASE_CACHE]


def test_a_cpu_runs_gpu_readings_are_not_its_pressure():
    # the node's GPU reads 89 % while no worker of the run is registered with its monitor
    # yet; every rank reports a CPU setup, so no rank holds an allocator cache to release
    from raytrain_guard.core.node_samples import GpuSample
    gpu = GpuSample(0, int(0.89 * CARD), CARD)
    nodes = {"n0": NodeSample("n0", 1, "e", 0.0, None, (gpu,))}

    def view(device):
        setup = RunSetup(2, 1, 2, device=device)
        return ClusterView({r: RankView(r, "n0", _window(r, 0.1), setup) for r in (0, 1)},
                           nodes, None)

    out = _decide(view("cpu"))
    assert out.decisions == ()
    assert "GPU readings left out: every rank of the run runs on CPU" in out.notes
    # a simulated card rehearses a GPU: the node's GPU reading counts, but there is no cache
    out = _decide(view("simulated"))
    assert out.decisions == ()
    assert "no cache release: the run is on a simulated card, where there is no allocator " \
        "cache" in out.notes
    assert "GPU readings left out: every rank of the run runs on CPU" not in out.notes
    # a rank not yet known to run on CPU leaves it open: the unpriced release, as before
    (d,) = _decide(view(None)).decisions
    assert d.action is Action.RELEASE_CACHE


def test_a_priced_shrink_is_taken_at_the_watermark_before_the_gates_critical_stop():
    # rank 1 at 89 % (over the 88 % watermark, under the 90 % critical line at which its own
    # gate checkpoints and stops): under FSDP every-micro-batch sync the shrink frees one
    # sample of activations, so it is decided now; no cache to release (1 GiB cached)
    out = _decide(_view(0.89, run_plan=plan("fsdp-full", GradSync.EVERY_MICRO_BATCH)))
    (d,) = out.decisions
    assert d.action is Action.SHRINK_MICRO_BATCH
    assert d.predicted["memory_frac_after"] < CFG.memory_watermark_frac - \
        CFG.memory_hysteresis_frac
    # without a plan the shrink stays unpriced, and unpriced it waits for critical
    assert not [d for d in _decide(_view(0.89)).decisions
                if d.action is Action.SHRINK_MICRO_BATCH]
