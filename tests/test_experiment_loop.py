"""The experiment's seams in the shared train loop, in-process (one rank, CPU, no Ray).

A simulated card, an activation spike that overflows it, and the two arms: observing, the spike
raises ``torch.OutOfMemoryError`` inside the step; acting, the loop prices the long batch before
its forward and runs it in pieces within the same optimizer step, so the weights come out as
those of a run on a card big enough for the whole batch.
"""

from __future__ import annotations

import json

import pytest
import torch

from raytrain_guard.experiment.card import SimulatedDevice
from raytrain_guard.experiment.faults import parse_fault
from raytrain_guard.experiment.injection import lengthen
from raytrain_guard.experiment.runner import BUILT_IN_DEVICE_MEMORY_BYTES
from raytrain_guard.runtime.loop.config import REHEARSAL
from raytrain_guard.runtime.loop.train_loop import DirectoryReporter, GuardedTrainLoop, LoopConfig
from raytrain_guard.units import MiB

BUILT_IN = {"model_factory": "raytrain_guard.experiment.model:make_model",
            "dataset_factory": "raytrain_guard.experiment.model:make_dataset",
            "optimizer_factory": "raytrain_guard.experiment.model:make_optimizer",
            "loss_fn": "raytrain_guard.experiment.model:loss_fn"}
SPIKE = parse_fault("activation_spike:rank=0,start=6,factor=8,steps=2")


def _run(tmp_path, name, *, act=True, card=BUILT_IN_DEVICE_MEMORY_BYTES, faults=(SPIKE,),
         delays=(), **extra):
    config = LoopConfig.from_dict({
        **BUILT_IN, "micro_batch": 8, "max_steps": 10, "num_workers": 0, "seed": 3,
        "measure_bandwidth": False, "checkpoint_every_steps": 100, "act": act,
        "rehearsal": REHEARSAL, "device_memory_bytes": card, "trace_dir": str(tmp_path / name / "trace"),
        "faults": {"inject": [f.to_dict() for f in faults], "delay": list(delays),
                   "marker_dir": str(tmp_path / name)}, **extra})
    (tmp_path / name).mkdir(exist_ok=True)
    loop = GuardedTrainLoop(config, reporter=DirectoryReporter(str(tmp_path / name)))
    return loop, loop.run


def test_observing_the_spike_overflows_the_simulated_card_inside_the_step(tmp_path):
    loop, run = _run(tmp_path, "observe", act=False)
    with pytest.raises(torch.OutOfMemoryError, match="simulated card of rank 0") as raised:
        run()
    assert loop.steps.step == 6                             # the spike's first step
    trace = [json.loads(line) for line in
             (tmp_path / "observe/trace/rank0.jsonl").read_text().splitlines()]
    assert trace[-1]["t"] == "error" and trace[-1]["error"] == "OutOfMemoryError"
    # what the card would have held had the allocation fitted: past its capacity
    assert trace[-1]["capacity_bytes"] == BUILT_IN_DEVICE_MEMORY_BYTES
    assert trace[-1]["needed_bytes"] == raised.value.needed_bytes > BUILT_IN_DEVICE_MEMORY_BYTES
    split = [d for d in trace if d.get("action") == "split_micro_batch"]
    assert split and not split[0]["applied"]                # priced, not acted on


def test_acting_splits_the_spike_and_trains_as_a_card_big_enough_would(tmp_path):
    loop, run = _run(tmp_path, "act")
    results = run()
    assert results["step"] == 10
    splits = [d for d in loop.recorder.decisions if d["action"] == "split_micro_batch"]
    assert [d["applied_at"] for d in splits] == [6, 7]
    for d in splits:
        pieces = d["params"]["pieces"]
        assert pieces >= 2
        # the prediction holds: the measured peak is within 10 % of the card of it, under the
        # watermark it was sized for
        assert abs(d["measured"]["peak_frac"] - d["predicted"]["peak_frac"]) < 0.1
        assert d["measured"]["peak_frac"] < 0.88
    big, run_big = _run(tmp_path, "big", card=16 * BUILT_IN_DEVICE_MEMORY_BYTES)
    run_big()
    assert not [d for d in big.recorder.decisions if d["action"] == "split_micro_batch"]
    for a, b in zip(loop.model.planned.module.parameters(),
                    big.model.planned.module.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)   # only the summation order


def test_the_card_counts_saved_activations_and_held_memory_and_raises_past_it():
    device = SimulatedDevice(1 * MiB)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    static = device.measure_static(model, opt)
    assert static == 2 * (64 * 64 + 64) * 4                # parameters and gradients, fp32
    x = torch.randn(16, 64)
    with device.tracking():
        model(x).relu().sum().backward()
    # saved: x (16 x 64 fp32) for the weight gradient and the relu output (16 x 64)
    assert device.last_activation_bytes == 2 * 16 * 64 * 4
    assert device.take_step_peak() == static + 2 * 16 * 64 * 4
    device.hold(512 * 1024, reason="test")
    with pytest.raises(torch.OutOfMemoryError, match="fault memory 512.0 KiB") as raised:
        device.hold(512 * 1024, reason="test")
    # it asked for what it holds (static and 512 KiB) and 512 KiB more, of a 1 MiB card
    assert (raised.value.needed_bytes, raised.value.capacity_bytes) == (static + MiB, MiB)


def test_lengthen_repeats_the_sequence_dimension_only():
    batch = {"id": torch.arange(4), "x": torch.randn(4, 5, 3), "y": torch.randn(4, 1),
             "labels": torch.zeros(4, 5, dtype=torch.long)}
    longer = lengthen(batch, 3)
    assert longer["x"].shape == (4, 15, 3) and longer["labels"].shape == (4, 15)
    assert longer["y"].shape == (4, 1) and longer["id"].shape == (4,)


@pytest.mark.parametrize("workers, wait, rest, needed", [
    (0, 0.035, 0.008, 6),     # a 35 ms fetch against 8 ms of work: ceil(4.4) + 1
    (2, 0.010, 0.008, 6),     # 2 workers deliver every 18 ms: a fetch is 36 ms -> ceil(4.5) + 1
    (4, 0.000, 0.010, 5),     # keeping up already: 4 x 10 ms / 10 ms + 1
    (0, 0.001, 0.050, 2),     # a fast fetch still gets the least workers
])
def test_loader_workers_needed_keep_up_with_the_step(workers, wait, rest, needed):
    from raytrain_guard.planner.dataloader_sizing import loader_workers_needed
    assert loader_workers_needed(workers, wait, rest) == needed


@pytest.mark.parametrize("act, delay", [(True, 0.5), (False, 0.0)])
def test_a_step_guard_that_observes_applies_no_local_decision(act, delay):
    from raytrain_guard.config import GuardConfig
    from raytrain_guard.core.decisions import Action, Decision
    from raytrain_guard.runtime.guard.step_guard import StepGuard

    guard = StepGuard(GuardConfig(pacing_enabled=True), act=act)
    guard._applied([Decision(Action.PACE, "memory above the watermark",
                             params={"delay_s": 0.5})])
    assert guard.pace_delay_s == delay


def test_the_host_memory_fault_is_a_process_holding_the_ram_until_its_stop(tmp_path):
    import time

    import psutil

    from raytrain_guard.experiment.injection import FaultRuntime

    faults = FaultRuntime([parse_fault("host_memory:rank=0,start=2,stop=4,size=64MiB")],
                          world_rank=0, marker_dir=str(tmp_path))
    faults.begin_step(1)
    assert faults._hog is None
    faults.begin_step(2)
    hog = psutil.Process(faults._hog.pid)
    deadline = time.monotonic() + 20
    while hog.memory_info().rss < 64 * MiB and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hog.memory_info().rss >= 64 * MiB
    faults.begin_step(4)                                   # its stop: the process is gone
    assert faults._hog is None and not psutil.pid_exists(hog.pid) or \
        hog.status() == psutil.STATUS_ZOMBIE


def _rss_reaches(pid: int, num_bytes: int, timeout_s: float = 20.0) -> int:
    import time

    import psutil
    deadline = time.monotonic() + timeout_s
    while (rss := psutil.Process(pid).memory_info().rss) < num_bytes \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    return rss


def test_the_host_memory_fault_grows_per_step_and_is_the_oom_killers_last_pick(tmp_path):
    import os

    from raytrain_guard.experiment.injection import FaultRuntime

    root = os.geteuid() == 0
    if root:      # as a Ray worker is (Ray's oom_score_adj 1000), which the process inherits
        with open("/proc/self/oom_score_adj", "w") as fh:
            fh.write("500")
    faults = FaultRuntime([parse_fault("host_memory:rank=0,start=2,stop=5,size=16MiB,"
                                       "per_step=16MiB")], world_rank=0,
                          marker_dir=str(tmp_path))
    try:
        faults.begin_step(2)
        pid = faults._hog.pid
        assert _rss_reaches(pid, 16 * MiB) >= 16 * MiB
        assert _rss_reaches(pid, 32 * MiB, timeout_s=1.0) < 32 * MiB   # size at its start
        faults.begin_step(3)
        assert _rss_reaches(pid, 32 * MiB) >= 32 * MiB                 # then 16 MiB a step
        faults.begin_step(4)
        assert _rss_reaches(pid, 48 * MiB) >= 48 * MiB
        assert faults.num_injected == 3
        if root:
            with open(f"/proc/{pid}/oom_score_adj") as fh:
                assert fh.read().strip() == "0"
    finally:
        faults.close()
        if root:
            with open("/proc/self/oom_score_adj", "w") as fh:
                fh.write("0")


def test_the_host_memory_fault_fills_the_host_to_its_fraction(tmp_path, monkeypatch):
    from raytrain_guard.experiment import injection
    from raytrain_guard.experiment.injection import FaultRuntime

    # a host of 1000 MiB with 950 free: 10 % of it is 100 MiB, 50 of them used already
    monkeypatch.setattr(injection, "host_memory", lambda: (1000 * MiB, 950 * MiB))
    faults = FaultRuntime([parse_fault("host_memory:rank=0,start=2,frac=0.1")],
                          world_rank=0, marker_dir=str(tmp_path))
    try:
        faults.begin_step(2)
        assert faults._hog_size == 50 * MiB
        assert _rss_reaches(faults._hog.pid, 50 * MiB) >= 50 * MiB
    finally:
        faults.close()


def test_a_node_fault_is_on_the_ranks_of_its_node_and_one_of_them_holds_its_ram(tmp_path):
    import socket

    from raytrain_guard.experiment.injection import FaultRuntime
    from raytrain_guard.experiment.rehearsal import node_index

    slow = parse_fault("slow_compute:node=1,start=2,factor=3", num_nodes=2)
    assert [len(FaultRuntime([slow], world_rank=r, marker_dir=None, node_index=n).specs)
            for r, n in ((0, 1), (1, 1), (1, 0), (1, None))] == [1, 1, 0, 0]
    # outside Ray a process's node id is its host name: its place in the node list
    assert node_index(["elsewhere", socket.gethostname()]) == 1
    assert node_index(["elsewhere"]) is None and node_index(None) is None

    # both ranks of node 0 have the fault; one process holds the node's RAM, not one each
    ram = parse_fault("host_memory:node=0,start=2,size=1MiB", num_nodes=2)
    ranks = [FaultRuntime([ram], world_rank=r, marker_dir=str(tmp_path), node_index=0)
             for r in (0, 1)]
    try:
        for rank in ranks:
            rank.begin_step(2)
        assert [rank._hog is not None for rank in ranks] == [True, False]
        ranks[0].close()                        # its process ends: the other takes it over
        ranks[1].begin_step(3)
        assert ranks[1]._hog is not None
    finally:
        for rank in ranks:
            rank.close()


def test_a_crash_fires_once_per_run(tmp_path):
    from raytrain_guard.experiment.injection import FaultRuntime, InjectedCrash

    spec = parse_fault("crash:rank=1,start=3")
    first = FaultRuntime([spec], world_rank=1, marker_dir=str(tmp_path))
    with pytest.raises(InjectedCrash, match="rank 1 at step 3"):
        first.begin_step(3)
    again = FaultRuntime([spec], world_rank=1, marker_dir=str(tmp_path))   # the restart
    again.begin_step(3)
    other = FaultRuntime([spec], world_rank=0, marker_dir=str(tmp_path))
    other.begin_step(3)


def _fsdp_card(rank: int, out: str) -> None:
    from raytrain_guard.runtime.dist.model import wrap_model
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    planned = wrap_model(model, strategy="fsdp-full", use_ray=False)
    opt = torch.optim.AdamW(planned.module.parameters(), lr=1e-3)
    planned.module(torch.randn(4, 64)).sum().backward()
    opt.step()                                           # AdamW's state exists now
    device = SimulatedDevice(64 * MiB, world_rank=rank)
    with open(f"{out}/rank{rank}.json", "w") as fh:
        json.dump({"static": device.measure_static(planned.module, opt)}, fh)


def test_the_card_counts_this_ranks_fsdp2_shards(tmp_path):
    """Under FSDP2 the parameters and optimizer state are DTensors: the card counts the local
    shard of each (a DTensor's storage cannot be read; its numel is the global one)."""
    from gloo_world import spawn
    spawn(_fsdp_card, 2, str(tmp_path))
    whole = 2 * (64 * 64 + 64) * 4                     # parameters of both layers, fp32
    # parameters + gradients + AdamW's two moments, half of each per rank (64 rows split
    # evenly), plus the two step counters (scalar tensors) that AdamW keeps per parameter
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())["static"]
        assert whole * 4 // 2 <= got <= whole * 4 // 2 + 4 * 8, got


def test_without_split_spikes_the_spike_overflows_the_card_even_when_acting(tmp_path):
    loop, run = _run(tmp_path, "nosplit", split_spikes=False)
    with pytest.raises(torch.OutOfMemoryError, match="simulated card of rank 0"):
        run()
    assert loop.steps.step == 6
    assert not [d for d in loop.recorder.decisions if d["action"] == "split_micro_batch"]


# The settle tests' steps are mostly a wait, as on a device: a 30 ms sleep in every forward
# against 5-10 ms of CPU work, so a busy core that doubles the work adds a fifth to a step,
# far under the slow-step line (1.5 x the median). The slowdown under test is 500 ms more in
# the forward of three steps, a dozen steps' worth: a fixed time, where a factor on the compute
# (slow_compute x6 of a 6 ms step) was a few tens of ms that a busy box's noise hid. Twenty
# steps come before it, so that bursts of noise are a minority of the window: half of eight
# steps at +100 ms (a box loaded past its cores) widened the gate's robust spread to 500 ms
# over the median. What the settle rule guarantees is asserted: which steps the gate judged
# (its window) and which steps an event names; noise in other steps is the gate's business.
DEVICE_LIKE = {"seconds": 0.03, "phase": "forward"}


def _slow_steps(start):
    return {"seconds": 0.5, "phase": "forward", "steps": [start, start + 3]}


def _judged(loop):
    """The steps the gate judged (its window: warm-up and settling steps are left out)."""
    return {s.step for s in loop.guard.gate.window}


def _named(loop):
    """The steps each slow-step event named: its run of num_steps from first_step."""
    return [set(range(d["params"]["first_step"],
                      d["params"]["first_step"] + d["params"]["num_steps"]))
            for d in loop.recorder.decisions if d["action"] == "slow_step"]


def _steps_ms(loop):
    """What the gate judged, for a failure's message: (step, total) in ms."""
    return [(s.step, round(s.total_s * 1e3))
            for s in loop.guard.gate.window]


def test_the_steps_after_a_checkpoint_settle_and_later_ones_are_judged(tmp_path):
    # A checkpoint after step 19. Three slow steps right after it (20-22) are the
    # checkpoint's aftermath to the gate: not judged, named by no event; the same three steps
    # from 24 are judged and named.
    got = {}
    for name, start in (("after", 20), ("later", 24)):
        loop, run = _run(tmp_path, name, faults=(), delays=(DEVICE_LIKE, _slow_steps(start)),
                         max_steps=28, checkpoint_every_steps=20)
        run()
        got[name] = loop
    after, later = got["after"], got["later"]
    assert not {20, 21, 22} & _judged(after)
    assert not [run for run in _named(after) if run & {20, 21, 22}], _named(after)
    assert {24, 25, 26} <= _judged(later)
    # named: a run of the slowed steps (a busy box's noise may make the step before them the
    # run's first, so the event names 23-25)
    assert any(len(run & {24, 25, 26}) >= 2 for run in _named(later)), (_named(later),
                                                                         _steps_ms(later))


def test_a_resumed_runs_first_steps_settle(tmp_path):
    # A run of 10 steps leaves its checkpoint; the run resumed from it (new loop, restored
    # gate, past its warm-up) runs three steps six times slower in compute: the fresh
    # start's aftermath to the gate, not judged (the window stays the restored one), no event.
    # Only settling steps run, so the host's noise has no judged step to show in.
    first, run_first = _run(tmp_path, "resumed", faults=())
    run_first()
    slow = parse_fault("slow_compute:rank=0,start=10,stop=13,factor=6")
    loop, run = _run(tmp_path, "resumed", faults=(slow,), max_steps=13)
    run()
    assert loop.steps.resumed_from == 10
    assert _judged(first) and _judged(loop) == _judged(first)
    assert _named(loop) == []


def test_the_steps_a_spike_ran_in_pieces_are_not_judged_slow(tmp_path):
    # Acting, the spike's three steps (20-22) run in pieces: each piece's forward waits as a
    # device's does, so they take two to three times a step. Their time is the spike's, and
    # each split decision says so: the gate judges none of them and no slow-step event names
    # them (acting on a spike of three steps raised a "compute" event at its last step).
    spike = parse_fault("activation_spike:rank=0,start=20,factor=8,steps=3")
    loop, run = _run(tmp_path, "pieces", faults=(spike,), delays=(DEVICE_LIKE,), max_steps=26)
    run()
    splits = [d["applied_at"] for d in loop.recorder.decisions
              if d["action"] == "split_micro_batch"]
    assert splits == [20, 21, 22]
    assert not {20, 21, 22} & _judged(loop)
    assert {23, 24, 25} <= _judged(loop)
    assert not [run for run in _named(loop) if run & {20, 21, 22}], (_named(loop),
                                                                      _steps_ms(loop))
