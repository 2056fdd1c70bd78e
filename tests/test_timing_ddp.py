"""Real 2-process gloo DDP: an injected compute delay on rank 1 shows rank 0 waiting in
communication, rank 1 not, and the cross-rank attribution names rank 1 the compute straggler.
Also: the wrapped hook keeps DDP's gradients (same result as DDP without a hook)."""

from __future__ import annotations

import json
import os
import statistics

import pytest

torch = pytest.importorskip("torch")
from gloo_world import spawn

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.gate import RankRole, attribute_across_ranks
from raytrain_guard.core.steps import StepStats

NUM_STEPS = 12
DELAY_S = 0.06
WARMUP = 2          # DDP's first step builds, then rebuilds, its buckets


def _arm(rank: int, with_timer: bool) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from raytrain_guard.experiment.rehearsal import FaultInjector
    from raytrain_guard.runtime.guard.comm_timers import attach_comm_timer
    from raytrain_guard.runtime.guard.step_guard import StepGuard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])
    # Small buckets: several allreduces per step, as in a real model.
    ddp = DDP(model, bucket_cap_mb=0.1)
    injector = FaultInjector(world_rank=rank)
    injector.delay(DELAY_S, phase="forward", ranks={1})
    guard = StepGuard(GuardConfig(), world_rank=rank, fault_injector=injector)
    if with_timer:
        attach_comm_timer(ddp, guard.timer)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    events = []
    for step in range(NUM_STEPS):
        guard.begin_step(step)
        x = torch.randn(32, 128, generator=gen)
        guard.mark("data")
        loss = ddp(x).square().mean()
        guard.mark("forward")
        loss.backward()
        guard.mark("backward")
        opt.step()
        opt.zero_grad()
        guard.mark("optimizer")
        events += [d.to_dict() for d in guard.end_step(step)]
    stats = [s.to_dict() for s in guard.drain_stats()]
    weights = [w for p in model.parameters() for w in p.detach().flatten().tolist()[:8]]
    return {"stats": stats, "events": events, "weights": weights}


def _worker(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    # the same training twice: with the timing hook, and with DDP's own allreduce
    arms = {"timed": _arm(rank, with_timer=True), "plain": _arm(rank, with_timer=False)}
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as fh:
        json.dump(arms, fh)


@pytest.fixture(scope="module")
def arms(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp_timed")
    spawn(_worker, 2, str(tmp))
    return [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def timed(arms):
    return [r["timed"] for r in arms]


def test_rank0_waits_in_communication_rank1_does_not(timed):
    windows = [[StepStats.from_dict(d) for d in r["stats"]][WARMUP:] for r in timed]
    assert [len(w) for w in windows] == [NUM_STEPS - WARMUP] * 2
    wait0 = statistics.median(s.comm_wait_s for s in windows[0])
    wait1 = statistics.median(s.comm_wait_s for s in windows[1])
    fwd1 = statistics.median(s.forward_s for s in windows[1])
    # Rank 1 sleeps DELAY_S in forward; rank 0's last allreduce waits for it.
    assert fwd1 >= DELAY_S
    assert wait0 >= 0.5 * DELAY_S, (wait0, wait1)
    assert wait1 < 0.5 * wait0, (wait0, wait1)
    # The wait is taken out of backward: rank 0's backward compute stays well below the delay.
    assert statistics.median(s.backward_s for s in windows[0]) < 0.5 * DELAY_S

    roles = attribute_across_ranks(windows)
    assert [(r.world_rank, r.role) for r in roles] == [(0, RankRole.WAITING),
                                                       (1, RankRole.STRAGGLER_COMPUTE)]
    assert "waiting on rank 1" in roles[0].reason


def test_hook_keeps_ddp_gradients(arms):
    # Same seeds, same data, DDP's own allreduce (no hook): the same weights after training.
    for rank in range(2):
        assert arms[rank]["plain"]["weights"] == pytest.approx(arms[rank]["timed"]["weights"],
                                                               rel=1e-5, abs=1e-7)
    assert arms[0]["timed"]["weights"] == pytest.approx(arms[1]["timed"]["weights"])  # in sync
