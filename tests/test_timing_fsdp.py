"""FSDP2's collectives timed apart from compute, and a slow link injected in them.

The pure part: time blocked in collectives leaves the phase it fell in and becomes
communication wait. The real part: two gloo ranks train a small FSDP2 model with
:func:`attach_fsdp_comm_timer`; the parameters equal an untimed run's, the collectives show up
as communication wait, and a 100 ms delay before each of rank 1's reduce-scatters is waited for
by rank 0 inside the collective: its communication wait grows by the delay, its backward does not
(medians of the delayed arm against the untouched one of the same run).
"""

from __future__ import annotations

import json
import os
import statistics

import pytest

torch = pytest.importorskip("torch")

from gloo_world import spawn  # noqa: E402

from raytrain_guard.runtime.guard.timing import StepTimer  # noqa: E402


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_blocked_time_leaves_its_phase_and_becomes_communication():
    clock = _Clock()
    timer = StepTimer(clock=clock)
    timer.begin_step(1)
    clock.t = 1.0
    timer.mark("data")                       # data 0..1
    timer.record_collective(1.2, 1.5)        # an all-gather in the forward
    clock.t = 2.0
    timer.mark("forward")                    # forward 1..2, 0.3 of it blocked
    timer.record_collective(2.5, 3.5)        # a reduce-scatter running past the backward mark
    clock.t = 3.0
    timer.mark("backward")                   # backward 2..3, 0.5 blocked; 0.5 more after it
    clock.t = 4.0
    stats = timer.finish_step(1)
    assert stats.data_wait_s == pytest.approx(1.0)
    assert stats.forward_s == pytest.approx(0.7)
    assert stats.backward_s == pytest.approx(0.5)
    assert stats.optimizer_s == pytest.approx(0.5)
    assert stats.comm_wait_s == pytest.approx(1.3)
    assert stats.total_s == pytest.approx(4.0)


def test_collectives_outside_the_step_are_not_counted():
    clock = _Clock()
    timer = StepTimer(clock=clock)
    clock.t = 10.0
    timer.begin_step(2)
    timer.record_collective(9.0, 10.5)       # began before the step: only its 0.5 inside
    clock.t = 11.0
    timer.mark("forward")
    stats = timer.finish_step(2)
    assert stats.comm_wait_s == pytest.approx(0.5)
    assert stats.forward_s == pytest.approx(0.5)


DELAY_S = 0.1       # per reduce-scatter: a few per step, far above a busy box's backward noise
STEPS = 5           # step 0 (lazy initialisation) is left out of every figure


def _worker(rank: int, out_dir: str) -> None:
    import time

    from raytrain_guard.runtime.dist.model import wrap_model
    from raytrain_guard.runtime.guard.comm_timers import attach_fsdp_comm_timer
    from raytrain_guard.runtime.guard.timing import StepTimer

    torch.set_num_threads(1)            # two ranks on two cores: one thread each
    out: dict = {"delays": 0}

    def slow_link() -> None:            # rank 1 enters each reduce-scatter DELAY_S late
        out["delays"] += 1
        time.sleep(DELAY_S)

    for arm in ("plain", "timed", "delayed"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 1))
        planned = wrap_model(model, strategy="fsdp-full", use_ray=False)
        optimizer = torch.optim.SGD(planned.module.parameters(), lr=0.1)
        timer = StepTimer(world_rank=rank)
        delay = slow_link if arm == "delayed" and rank == 1 else None
        if arm != "plain":
            out[f"{arm}_units"] = attach_fsdp_comm_timer(planned.module, timer,
                                                         before_reduce_scatter=delay)
        rows = []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
            timer.begin_step(step)
            timer.mark("data")
            loss = torch.nn.functional.mse_loss(planned.module(x), y)
            timer.mark("forward")
            loss.backward()
            timer.mark("backward")
            optimizer.step()
            optimizer.zero_grad()
            s = timer.finish_step(step)
            rows.append([s.forward_s, s.backward_s, s.comm_wait_s, s.total_s])
        out[arm] = rows
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        state = get_model_state_dict(planned.module,
                                     options=StateDictOptions(full_state_dict=True))
        out[f"{arm}_params"] = [state[k].flatten().tolist() for k in sorted(state)]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(out, fh)


@pytest.fixture(scope="module")
def fsdp_timed(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_timed")
    spawn(_worker, 2, str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_timed_collectives_train_exactly_like_fsdp2s_own(fsdp_timed):
    for got in fsdp_timed:
        assert got["timed_units"] >= 2                 # the blocks and the root
        for a, b in zip(got["plain_params"], got["timed_params"]):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6)
        for a, b in zip(got["plain_params"], got["delayed_params"]):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6)


def test_collectives_are_communication_and_a_slow_link_is_waited_for_inside_them(fsdp_timed):
    rank0, rank1 = fsdp_timed
    for got in fsdp_timed:
        for fwd, bwd, comm, total in got["timed"][1:]:
            assert comm > 0.0                          # every step gathers and scatters
            assert fwd + bwd + comm <= total + 1e-6
    # rank 1 slept before each of its reduce-scatters (one per unit that holds parameters),
    # rank 0 not at all: the delay a step carries
    assert rank0["delays"] == 0 and rank1["delays"] % STEPS == 0 and rank1["delays"] >= STEPS
    injected_s = rank1["delays"] // STEPS * DELAY_S
    for got in fsdp_timed:
        # medians over the steps: (forward, backward, communication wait)
        timed, delayed = ([statistics.median(column) for column in zip(*got[arm][1:])][:3]
                          for arm in ("timed", "delayed"))
        # rank 0 waits for it inside the collectives (rank 1 sleeps inside its own): the
        # communication wait grows by about the delay, the backward compute by nothing of it
        # (were the blocked time left in backward_s, it would grow by the whole delay)
        assert delayed[2] >= timed[2] + 0.5 * injected_s, (timed, delayed)
        assert delayed[1] < timed[1] + 0.5 * injected_s, (timed, delayed)
