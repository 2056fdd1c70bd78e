"""The experiment's device-time model: GPU-like steps on a CPU (experiment/device_time.py)."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from raytrain_guard.experiment.device_time import DeviceTime
from raytrain_guard.experiment.faults import parse_fault
from raytrain_guard.runtime.loop.config import REHEARSAL
from raytrain_guard.runtime.loop.train_loop import DirectoryReporter, GuardedTrainLoop, LoopConfig

BUILT_IN = {"model_factory": "raytrain_guard.experiment.model:make_model",
            "dataset_factory": "raytrain_guard.experiment.model:make_dataset",
            "optimizer_factory": "raytrain_guard.experiment.model:make_optimizer",
            "loss_fn": "raytrain_guard.experiment.model:loss_fn"}


def test_forward_waits_a_third_and_backward_two_thirds_scaled_by_elements_and_factor():
    slept: list[float] = []
    device = DeviceTime(0.06, sleep=slept.append)
    model = torch.nn.Linear(4, 2)
    device.attach(model)
    model(torch.randn(8, 4)).sum().backward()
    assert slept == pytest.approx([0.02, 0.04])          # 60 ms: 20 in forward, 40 in backward
    slept.clear()
    model(torch.randn(16, 4)).sum().backward()            # twice the elements of the first
    assert slept == pytest.approx([0.04, 0.08])
    slept.clear()
    device.factor = 3.0                                   # slow_compute x3
    model(torch.randn(8, 4)).sum().backward()
    assert slept == pytest.approx([0.06, 0.12])


def test_the_wait_leaves_outputs_and_gradients_as_they_were():
    torch.manual_seed(0)
    plain = torch.nn.Linear(4, 2)
    timed = torch.nn.Linear(4, 2)
    timed.load_state_dict(plain.state_dict())
    DeviceTime(0.01, sleep=lambda s: None).attach(timed)
    x = torch.randn(3, 4)
    torch.testing.assert_close(timed(x), plain(x))
    (timed(x) ** 2).sum().backward()
    (plain(x) ** 2).sum().backward()
    torch.testing.assert_close(timed.weight.grad, plain.weight.grad)


def test_the_loop_waits_the_device_time_and_slow_compute_stretches_it(tmp_path):
    # one rank, the built-in job at 40 ms of device time; rank 0 x6 slower at steps 6-8: the
    # trace's step times are the device's, and the slowed steps about six times as long
    slow = parse_fault("slow_compute:rank=0,start=6,stop=9,factor=6")
    config = LoopConfig.from_dict({
        **BUILT_IN, "micro_batch": 8, "max_steps": 12, "num_workers": 0, "seed": 3,
        "measure_bandwidth": False, "checkpoint_every_steps": 100,
        "trace_dir": str(tmp_path / "trace"), "rehearsal": REHEARSAL,
        "faults": {"inject": [slow.to_dict()], "marker_dir": str(tmp_path),
                   "device_step_s": 0.04}})
    GuardedTrainLoop(config, reporter=DirectoryReporter(str(tmp_path))).run()
    steps = {r["step"]: r["total_s"] for r in map(json.loads, open(tmp_path / "trace/rank0.jsonl"))
             if r["t"] == "step"}
    normal = [steps[s] for s in (2, 3, 4, 10, 11)]
    slowed = [steps[s] for s in (6, 7, 8)]
    assert min(normal) >= 0.04                             # at least the device time
    assert min(slowed) >= 0.24                             # 6 x 40 ms of device time
    # the stretch adds 200 ms of waited device time: half of it survives the host noise that
    # slows the normal steps (at a load of 20 on 2 cores they took 80-340 ms)
    assert min(slowed) - statistics.median(normal) > 0.1
