"""FSDP1's gradient reduction is communication wait, not the backward it falls in (real gloo
ranks; FSDP1 on CPU: tests/fsdp1_cpu.py).

Two ranks step a FSDP1-wrapped model (``FULL_SHARD`` and ``NO_SHARD``) under a host StepTimer
with :func:`attach_comm_timers`; rank 1 waits 100 ms before each backward, as a slow rank
does. Rank 0 reaches the reduction first and waits there for rank 1: its communication wait
carries the 100 ms, and rank 1's does not.
"""

from __future__ import annotations

import json
import os
import time

import pytest

torch = pytest.importorskip("torch")

from gloo_world import spawn  # noqa: E402

DELAY_S = 0.1
STEPS = 4


def _worker(rank: int, out: str) -> None:
    from fsdp1_cpu import allow_fsdp1_on_cpu
    from torch.distributed import fsdp

    from raytrain_guard.runtime.guard.comm_timers import attach_comm_timers
    from raytrain_guard.runtime.guard.timing import StepTimer

    torch.set_num_threads(1)
    allow_fsdp1_on_cpu()
    got = {}
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        torch.manual_seed(0)
        model = fsdp.FullyShardedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 8)),
            sharding_strategy=fsdp.ShardingStrategy[strategy])
        timer = StepTimer(device=torch.device("cpu"))
        attach_comm_timers(model, timer, world_rank=rank)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        waits = []
        for step in range(STEPS):
            timer.begin_step(step)
            loss = model(torch.randn(16, 64)).square().mean()
            timer.mark("forward")
            if rank == 1:
                time.sleep(DELAY_S)
            loss.backward()
            timer.mark("backward")
            optimizer.step()
            optimizer.zero_grad()
            waits.append(timer.finish_step(step).comm_wait_s)
        got[strategy] = waits
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(got, fh)


@pytest.fixture(scope="module")
def waits(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp1_timer")
    spawn(_worker, 2, str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_the_rank_that_waits_for_a_slow_one_waits_in_communication(waits, strategy):
    first, slow = waits[0][strategy][1:], waits[1][strategy][1:]    # step 0 warms up
    assert all(w >= 0.7 * DELAY_S for w in first), first
    assert all(w < 0.5 * DELAY_S for w in slow), slow
