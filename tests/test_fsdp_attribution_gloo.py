"""Under FSDP2 a slow rank and a slow link are told apart, as under DDP (real gloo ranks).

Two ranks run the shared train loop with FSDP2 (``fsdp-full``) and one injected fault on rank 1
from the first step: ``slow_compute`` (its forward and backward take 4 times as long) or
``comm_delay`` (its first reduce-scatter of each step starts 150 ms late, several times a busy
box's compute noise). FSDP2's collectives are timed apart from compute
(:func:`attach_fsdp_comm_timer`), so the run's attribution names rank 1 the compute straggler in
the first case, with rank 0 waiting in communication; in the second no rank's compute stands
out, and rank 0's communication wait carries the delay, its compute as in the first run.
"""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")

from gloo_world import spawn  # noqa: E402

from raytrain_guard.runtime.loop.config import REHEARSAL

BUILT_IN = {"model_factory": "raytrain_guard.experiment.model:make_model",
            "dataset_factory": "raytrain_guard.experiment.model:make_dataset",
            "optimizer_factory": "raytrain_guard.experiment.model:make_optimizer",
            "loss_fn": "raytrain_guard.experiment.model:loss_fn"}
DELAY_S = 0.15
FAULTS = {"slow_compute": "slow_compute:rank=1,start=0,factor=4",
          "comm_delay": f"comm_delay:rank=1,start=0,seconds={DELAY_S}"}


def _worker(rank: int, out: str) -> None:
    from raytrain_guard.coordination.context import WorkerContext
    from raytrain_guard.experiment.faults import parse_fault
    from raytrain_guard.runtime.loop.train_loop import (
        DirectoryReporter,
        GuardedTrainLoop,
        LoopConfig,
    )

    torch.set_num_threads(1)            # two ranks on two cores: one thread each
    got = {}
    for name, spec in FAULTS.items():
        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        config = LoopConfig.from_dict({
            **BUILT_IN, "strategy": "fsdp-full", "micro_batch": 8, "max_steps": 12,
            "num_workers": 0, "seed": 3, "measure_bandwidth": False,
            "checkpoint_every_steps": 100, "act": False, "rehearsal": REHEARSAL,
            "faults": {"inject": [parse_fault(spec).to_dict()], "marker_dir": d}})
        loop = GuardedTrainLoop(config, reporter=DirectoryReporter(d),
                                context=WorkerContext(world_rank=rank, world_size=2))
        got[name] = loop.run()["attribution"]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(got, fh)


@pytest.fixture(scope="module")
def attribution(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_attribution")
    spawn(_worker, 2, str(out))
    return json.loads((out / "rank0.json").read_text())   # rank 0 names every rank's role


def test_a_slow_rank_is_the_compute_straggler_and_the_other_waits(attribution):
    roles = {a["world_rank"]: a for a in attribution["slow_compute"]}
    assert roles[1]["role"] == "straggler_compute", roles[1]["reason"]
    assert roles[0]["role"] == "waiting", roles[0]["reason"]
    assert roles[0]["comm_wait_s"] > roles[1]["comm_wait_s"]
    assert roles[1]["compute_s"] > 2 * roles[0]["compute_s"]


def test_a_slow_link_is_communication_on_the_waiting_rank_not_a_straggler(attribution):
    roles = {a["world_rank"]: a for a in attribution["comm_delay"]}
    assert not [a for a in roles.values() if a["role"].startswith("straggler")], roles
    assert roles[0]["comm_wait_s"] >= 0.5 * DELAY_S, roles    # rank 0 waits in the collective
    # and not in compute: its compute is what it is in the other run, where nothing slows it
    # (booked as compute, the wait would add the whole delay)
    unslowed = {a["world_rank"]: a for a in attribution["slow_compute"]}[0]["compute_s"]
    assert roles[0]["compute_s"] < unslowed + 0.5 * DELAY_S, (roles, unslowed)
