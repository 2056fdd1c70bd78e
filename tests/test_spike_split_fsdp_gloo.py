"""An activation spike on one FSDP rank: every rank splits it alike (real gloo ranks, no Ray).

Under FSDP2 each forward gathers and each backward scatters with the other ranks, so a rank
that ran its oversized micro-batch in pieces alone would leave the others in a mismatched
collective (a hang). Rank 1's data spikes at steps 6-7 on the built-in job's simulated card; the ranks
agree on the pieces before the forward and both split. The run finishes, both ranks record
the split at the same steps with the same pieces, and the weights equal those of a run on a
card big enough for the whole batch (only the summation order differs).
"""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")

from gloo_world import spawn  # noqa: E402

from raytrain_guard.experiment.runner import BUILT_IN_DEVICE_MEMORY_BYTES  # noqa: E402
from raytrain_guard.runtime.loop.config import REHEARSAL

BUILT_IN = {"model_factory": "raytrain_guard.experiment.model:make_model",
            "dataset_factory": "raytrain_guard.experiment.model:make_dataset",
            "optimizer_factory": "raytrain_guard.experiment.model:make_optimizer",
            "loss_fn": "raytrain_guard.experiment.model:loss_fn"}


def _spike_worker(rank: int, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from raytrain_guard.coordination.context import WorkerContext
    from raytrain_guard.experiment.faults import parse_fault
    from raytrain_guard.runtime.loop.train_loop import (
        DirectoryReporter,
        GuardedTrainLoop,
        LoopConfig,
    )

    spike = parse_fault("activation_spike:rank=1,start=6,factor=8,steps=2")
    got = {}
    for name, card in (("small", BUILT_IN_DEVICE_MEMORY_BYTES),
                       ("big", 16 * BUILT_IN_DEVICE_MEMORY_BYTES)):
        os.makedirs(os.path.join(out, name), exist_ok=True)
        config = LoopConfig.from_dict({
            **BUILT_IN, "strategy": "fsdp-full", "micro_batch": 8, "max_steps": 10,
            "num_workers": 0, "seed": 3, "measure_bandwidth": False,
            "checkpoint_every_steps": 100, "device_memory_bytes": card, "rehearsal": REHEARSAL,
            "faults": {"inject": [spike.to_dict()], "marker_dir": os.path.join(out, name)}})
        loop = GuardedTrainLoop(config, reporter=DirectoryReporter(os.path.join(out, name)),
                                context=WorkerContext(world_rank=rank, world_size=2))
        results = loop.run()
        state = get_model_state_dict(loop.model.planned.module,
                                     options=StateDictOptions(full_state_dict=True))
        got[name] = {"step": results["step"],
                     "splits": [[d["applied_at"], d["params"]["pieces"], d["applied"]]
                                for d in loop.recorder.decisions
                                if d["action"] == "split_micro_batch"],
                     "params": [state[k].flatten().tolist() for k in sorted(state)]}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(got, fh)


def test_an_fsdp_spike_is_split_alike_on_every_rank(runs):
    ranks = [json.loads((runs / "spike" / f"rank{r}.json").read_text()) for r in range(2)]
    for got in ranks:
        assert got["small"]["step"] == got["big"]["step"] == 10
        assert [s[0] for s in got["small"]["splits"]] == [6, 7], got["small"]["splits"]
        assert all(s[1] >= 2 and s[2] for s in got["small"]["splits"])
        assert got["big"]["splits"] == []
        for a, b in zip(got["small"]["params"], got["big"]["params"]):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5)
    assert ranks[0]["small"]["splits"] == ranks[1]["small"]["splits"]   # the same pieces


SAMPLE_S = 0.015    # per sample on rank 1: 8 of them a step, far above a busy box's compute noise


def _slow_data_worker(rank: int, out: str) -> None:
    from raytrain_guard.coordination.context import WorkerContext
    from raytrain_guard.experiment.faults import parse_fault
    from raytrain_guard.runtime.loop.train_loop import (
        DirectoryReporter,
        GuardedTrainLoop,
        LoopConfig,
    )

    torch.set_num_threads(1)            # two ranks on two cores: one thread each
    slow = parse_fault(f"slow_data:rank=1,start=0,seconds={SAMPLE_S}")
    config = LoopConfig.from_dict({
        **BUILT_IN, "strategy": "fsdp-full", "micro_batch": 8, "max_steps": 10,
        "num_workers": 0, "seed": 3, "measure_bandwidth": False, "checkpoint_every_steps": 100,
        "device_memory_bytes": 1 << 30, "trace_dir": out, "rehearsal": REHEARSAL,
        "faults": {"inject": [slow.to_dict()], "marker_dir": out}})
    GuardedTrainLoop(config, reporter=DirectoryReporter(out),
                     context=WorkerContext(world_rank=rank, world_size=2)).run()


def _worker(rank: int, out: str) -> None:
    """Both jobs in one world (one start-up of the ranks for the module's tests)."""
    _spike_worker(rank, os.path.join(out, "spike"))
    _slow_data_worker(rank, os.path.join(out, "slow_data"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_spike")
    for job in ("spike", "slow_data"):
        (out / job).mkdir()
    spawn(_worker, 2, str(out))
    return out


def test_the_agreement_wait_is_communication_not_compute(runs):
    """Rank 1's data is slow; rank 0 waits for it in the per-micro-batch agreement (and the
    gathers after it). That wait is communication: rank 0's compute stays its own (booked as
    compute, it would carry rank 1's whole data wait)."""
    import statistics
    medians = {}
    for rank in (0, 1):
        rows = [json.loads(line) for line in (runs / "slow_data" / f"rank{rank}.jsonl").read_text()
                .splitlines() if '"t": "step"' in line][3:]
        medians[rank] = {k: statistics.median(r[k] for r in rows)
                         for k in ("compute_s", "comm_wait_s", "data_wait_s")}
    waiting, slow = medians[0], medians[1]
    assert slow["data_wait_s"] >= 8 * SAMPLE_S, medians          # a sleep per sample
    assert waiting["comm_wait_s"] > 0.5 * slow["data_wait_s"], medians
    assert waiting["compute_s"] < slow["compute_s"] + 0.5 * slow["data_wait_s"], medians
