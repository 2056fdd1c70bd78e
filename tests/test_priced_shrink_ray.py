"""Coordinator -> lockstep -> priced shrink, on real runs: ``launch`` (TorchTrainer, 2 gloo
workers, the real coordinator and node monitor actors, the traced plan the coordinator prices
with).

* **DDP, the shrink is taken.** Each rank trains the built-in sequence model on a simulated card
  sized so that its own reading is 86.5 % (between the re-arm line 85 % and the watermark
  88 %: its local gate has nothing to do). The node monitor's GPU reads what NVML would read of
  that card with another process holding 6 % of it (:class:`SimulatedCardGpu`): 92.5 %, past
  critical (90 %). The coordinator prices a shrink 8 x 1 -> 4 x 2 with the memory model
  (predicted under the re-arm line), decides it, both ranks apply it at one agreed step, the
  card's reading falls by the activations of 4 samples (about a third of it), the coordinator
  measures that against its prediction (a hit), and the run finishes both epochs with
  every sample once per epoch.
* **FSDP with last-micro-batch gradient sync, the shrink is refused.** The toy MLP's gradients
  outweigh its activations: 4 x 2 keeps the first micro-batch's unsharded gradients alive
  through the second backward, so the model predicts a higher peak; with no action predicted to
  help at critical (92 % read on the GPU), the coordinator checkpoints and stops every rank
  instead, and no rank changes its layout.

Why the pressure comes from the node monitor's GPU reading and not from the rank's own: the
rank's gate stops the run at ``memory_critical_frac`` on its own reading at the next stop check,
the same threshold at which the coordinator's policy first considers a shrink, and a cluster
decision reaches the ranks one report and one agreement later. On a rank's own reading alone a
coordinator shrink in act mode is never applied before the gate's stop; NVML, which also counts
other processes and the CUDA context, is where a real GPU can read critical first.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from examples import toy
from raytrain_guard.cluster.launcher import launch
from raytrain_guard.cluster.planning import traced_plan
from raytrain_guard.core.effects import shrink_effect
from raytrain_guard.core.node_samples import GpuSample
from raytrain_guard.experiment import model as seq
from raytrain_guard.runtime.loop.config import REHEARSAL

pytestmark = pytest.mark.ray
RAY_NAMESPACE = "rtg_test_priced_shrink"

NUM_SAMPLES = 640          # 2 ranks x micro-batch 8: 40 steps an epoch, 2 epochs
MICRO_BATCH = 8
RANK_FRAC = 0.865          # the ranks' own reading: under the watermark, over the re-arm line
OTHER_FRAC = 0.06          # what another process holds on the GPU: NVML reads 0.925
# node samples and policy rounds 5 times a second: the runs last a few seconds; a shrink's
# effect is judged over the 20 steps after it (decision_cooldown_steps) of the 80
GUARD = {"monitor_interval_s": 0.2, "decision_interval_s": 0.2}
SLOW = {"delay": [{"seconds": 0.03, "phase": "forward"}]}   # steps long enough to be watched


class SimulatedCardGpu:
    """``probe_factory`` and GPU probe of the node monitor: one GPU holding the node's train
    workers, read as NVML would read the ranks' simulated cards if they were that GPU: the
    highest memory fraction the ranks' traces report (their step peak on the card), plus
    ``other_bytes`` another process holds on it (NVML counts every process on a GPU; a rank's
    own reading counts only its allocations)."""

    def __init__(self, trace_dir: str, card_bytes: int, other_bytes: int) -> None:
        self.trace_dir, self.card_bytes, self.other_bytes = trace_dir, card_bytes, other_bytes

    def __call__(self, node_id: str) -> tuple[SimulatedCardGpu, None]:
        return self, None                  # the real psutil host probe

    def sample(self, workers: dict[int, int | None]) -> tuple[GpuSample, ...]:
        fracs = [0.0]
        for path in Path(self.trace_dir).glob("rank*.jsonl"):
            steps = [r for r in map(json.loads, path.read_text().splitlines()[-40:])
                     if r.get("t") == "step" and r.get("memory_frac") is not None]
            if steps:
                fracs.append(steps[-1]["memory_frac"])
        used = int(max(fracs) * self.card_bytes) + self.other_bytes
        return (GpuSample(0, used, self.card_bytes, process_pids=tuple(sorted(workers))),)


def _step_peak_bytes(micro_batch: int) -> int:
    """A rank's step peak at ``micro_batch`` as the loop's simulated card counts it:
    parameters, gradients, optimizer state, saved activations."""
    import torch
    from torch.utils.data import default_collate

    from raytrain_guard.experiment.card import SimulatedDevice
    torch.manual_seed(0)
    model = seq.make_model()
    sim = SimulatedDevice(1 << 40)
    sim.measure_static(model, seq.make_optimizer(model.parameters()))
    data = seq.SequenceDataset(NUM_SAMPLES)
    with sim.tracking():
        seq.loss_fn(model, default_collate([data[i] for i in range(micro_batch)])).backward()
    return sim.take_step_peak()


def _card_bytes() -> int:
    """The card on which a rank's step peak at micro-batch 8 reads ``RANK_FRAC``."""
    return int(_step_peak_bytes(MICRO_BATCH) / RANK_FRAC)


def _records(directory: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (directory / f"rank{rank}.jsonl").read_text()
            .splitlines() if line]


@pytest.fixture(scope="module")
def ddp_run(ray_instance, tmp_path_factory):
    from ray import cloudpickle
    cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the monitor's probe
    tmp = tmp_path_factory.mktemp("priced_ddp")
    card = _card_bytes()
    config = {"model_factory": seq.make_model,
              "dataset_factory": functools.partial(seq.SequenceDataset, NUM_SAMPLES),
              "optimizer_factory": seq.make_optimizer, "loss_fn": seq.loss_fn,
              "micro_batch": MICRO_BATCH, "epochs": 2, "num_workers": 0,
              "measure_bandwidth": False, "checkpoint_every_steps": 10_000,
              "device_memory_bytes": card, "trace_dir": str(tmp / "trace"),
              "audit_dir": str(tmp / "audit"), "faults": SLOW, "rehearsal": REHEARSAL,
              "guard": GUARD}
    summary = launch(config, num_workers=2, run_id="priced_ddp", namespace=RAY_NAMESPACE,
                     device_memory_bytes=card, force=True,
                     storage_path=str(tmp / "storage"),
                     probe_factory=SimulatedCardGpu(str(tmp / "trace"), card,
                                                    int(OTHER_FRAC * card)))
    return tmp, summary


def test_the_coordinator_decides_a_shrink_its_memory_model_says_helps(ddp_run):
    _, summary = ddp_run
    shrinks = [d for d in summary.decisions if d["action"] == "shrink_micro_batch"]
    assert len(shrinks) == 1, summary.decisions
    decided = next(d for d in summary.coordinator["effects"]
                   if d["action"] == "shrink_micro_batch")
    assert decided["decision_id"] == shrinks[0]["decision_id"] and decided["scope"] == "cluster"
    assert decided["params"] == {"micro_batch": 4, "grad_accum": 2}
    predicted = decided["predicted"]
    assert predicted["memory_frac_before"] == pytest.approx(RANK_FRAC + OTHER_FRAC, abs=0.01)
    assert predicted["memory_frac_after"] <= 0.85          # under the re-arm line: it helps
    assert "memory model (ddp)" in predicted["basis"]
    assert not any(d["action"] == "checkpoint_and_stop" for d in summary.decisions)


def test_every_rank_switches_at_the_one_agreed_step(ddp_run):
    tmp, summary = ddp_run
    shrink = next(d for d in summary.decisions if d["action"] == "shrink_micro_batch")
    assert sorted(shrink["ranks"]) == [0, 1] and len(shrink["steps"]) == 1
    at = shrink["steps"][0]
    assert 10 <= at <= 60
    for rank in (0, 1):
        layouts = {(r["step"], r["micro_batch"], r["grad_accum"])
                   for r in _records(tmp / "trace", rank) if r["t"] == "step"}
        assert {(mb, ga) for s, mb, ga in layouts if s < at} == {(8, 1)}, rank
        assert {(mb, ga) for s, mb, ga in layouts if s >= at} == {(4, 2)}, rank
        sizes = {}
        for entry in _records(tmp / "audit", rank):
            sizes.setdefault(entry["step"], []).append(len(entry["ids"]))
        assert all(sizes[s] == ([8] if s < at else [4, 4]) for s in sizes), rank


def test_the_coordinator_measures_the_effect_against_its_prediction(ddp_run):
    _, summary = ddp_run
    effect = next(d for d in summary.coordinator["effects"]
                  if d["action"] == "shrink_micro_batch")
    measured = effect["measured"]
    assert measured["verdict"] == "hit"
    # from the step the ranks applied it at (the lockstep's agreement step when the decision
    # reached them after the step it asked for), over the 20 steps after it
    applied = next(d for d in summary.decisions if d["action"] == "shrink_micro_batch")
    assert measured["applied_at"] == applied["steps"][0] >= effect["step"]
    assert measured["num_steps_after"] == 2 * 20
    assert measured["memory_frac_before"] == pytest.approx(RANK_FRAC, abs=0.01)
    # the card sheds the activations of 4 samples (-34 % of it for the built-in model)
    shed_frac = (_step_peak_bytes(MICRO_BATCH // 2) - _step_peak_bytes(MICRO_BATCH)) / _card_bytes()
    assert measured["delta_frac"] == pytest.approx(shed_frac, abs=0.02)
    assert measured["delta_frac"] <= 0.5 * effect["predicted"]["delta_frac"]
    assert summary.coordinator["missed"] == []


def test_the_run_finishes_with_every_sample_once_per_epoch(ddp_run):
    tmp, summary = ddp_run
    assert summary.steps == summary.total_steps == 80 and not summary.stopped_early
    for epoch in (0, 1):
        ids = [i for rank in (0, 1) for e in _records(tmp / "audit", rank)
               if e["epoch"] == epoch for i in e["ids"]]
        assert sorted(ids) == list(range(NUM_SAMPLES)), epoch


# -- FSDP, last-micro-batch gradient sync: the shrink would raise the peak -------------------

FSDP_CARD = 256 * 1024


@pytest.fixture(scope="module")
def fsdp_run(ray_instance, tmp_path_factory):
    from raytrain_guard.cluster.monitor.probes import ScriptedProbeFactory
    tmp = tmp_path_factory.mktemp("priced_fsdp")
    config = {"model_factory": toy.make_model,
              "dataset_factory": functools.partial(toy.make_dataset, NUM_SAMPLES),
              "optimizer_factory": toy.make_optimizer, "loss_fn": toy.loss_fn,
              "micro_batch": MICRO_BATCH, "epochs": 2, "num_workers": 0,
              "strategy": "fsdp-full", "fsdp_grad_sync": "last_micro_batch",
              "measure_bandwidth": False, "checkpoint_every_steps": 10_000,
              # a simulated card rehearses the GPU the scripted reading is of (a plain CPU
              # run's ranks report no GPU, and the policy leaves GPU readings out)
              "device_memory_bytes": FSDP_CARD,
              "trace_dir": str(tmp / "trace"), "faults": SLOW, "rehearsal": REHEARSAL,
              "guard": GUARD}
    gpu = [[GpuSample(0, int(0.92 * FSDP_CARD), FSDP_CARD)]]      # NVML: 92 %, critical
    summary = launch(config, num_workers=2, run_id="priced_fsdp", namespace=RAY_NAMESPACE,
                     device_memory_bytes=FSDP_CARD, force=True,
                     storage_path=str(tmp / "storage"),
                     probe_factory=ScriptedProbeFactory(gpu, worker_gpus=(0,)))
    _, plan = traced_plan(config, num_workers=2, device_memory_bytes=FSDP_CARD)
    return tmp, summary, plan


def test_fsdp_a_shrink_predicted_to_raise_the_peak_is_not_taken(fsdp_run):
    tmp, summary, plan = fsdp_run
    # what the coordinator's model says of 8 x 1 -> 4 x 2 here: the unsharded gradients of the
    # first micro-batch live through the second backward, more than half the activations free
    effect = shrink_effect(plan, MICRO_BATCH, 1, 0.92)
    assert plan.grad_sync.value == "last_micro_batch" and effect.memory_frac_after > 0.92
    assert not any(d["action"] == "shrink_micro_batch" for d in summary.decisions)
    stops = [d for d in summary.decisions if d["action"] == "checkpoint_and_stop"]
    assert len(stops) == 1 and stops[0]["decision_id"] and sorted(stops[0]["ranks"]) == [0, 1]
    assert len(stops[0]["steps"]) == 1
    reason = stops[0]["reason"]
    assert "no action is predicted to bring it under 85%" in reason
    assert f"shrink_micro_batch predicted {effect.memory_frac_after:.1%}" in reason
    assert summary.stopped_early and summary.steps == stops[0]["steps"][0] < 80
    for rank in (0, 1):
        layouts = {(r["micro_batch"], r["grad_accum"]) for r in _records(tmp / "trace", rank)
                   if r["t"] == "step"}
        assert layouts == {(MICRO_BATCH, 1)}, rank
