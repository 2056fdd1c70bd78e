"""The coordinator's step-by-step straggler rule (core.straggler.persistent_slowdowns) with the
host's contention: pure, scripted figures."""

from __future__ import annotations

import pytest

from raytrain_guard.core.decisions import Cause
from raytrain_guard.core.steps import StepStats
from raytrain_guard.core.straggler import persistent_slowdowns, summarize

HOST = {"host_wait_frac": 0.5, "host_settle_steps": 3, "host_settle_factor": 1.5}


def _windows(slow_waits):
    """Rank 0 computes 5 ms a step (10 ms steps); rank 1 likewise, but 15 ms at steps 7-9
    (20 ms steps), having waited ``slow_waits`` seconds for a CPU in them (0.5 ms elsewhere)."""
    windows = {0: [], 1: []}
    for step in range(10):
        for rank in (0, 1):
            slow = rank == 1 and step >= 7
            wait_s = slow_waits[step - 7] if slow else 0.0005
            windows[rank].append(StepStats(step, 0.020 if slow else 0.010, 0.001,
                                           0.015 if slow else 0.005, world_rank=rank,
                                           cpu_wait_s=wait_s))
    return windows


@pytest.mark.parametrize("waits,host,named", [
    # no wait for a CPU: rank 1's compute is 10 ms over rank 0's at 3 steps in a row
    ((0.0005, 0.0005, 0.0005), HOST, True),
    # it waited 9 ms at step 7 (over half the 10 ms): the host's; 8 and 9 its aftermath
    ((0.0095, 0.0005, 0.0005), HOST, False),
    # the rule off (the function's default): named
    ((0.0095, 0.0005, 0.0005), {}, True),
    # 4 ms is under half: the rank's
    ((0.0045, 0.0005, 0.0005), HOST, True),
])
def test_a_slowdown_the_hosts_contention_explains_is_not_a_straggler(waits, host, named):
    windows = _windows(waits)
    found = persistent_slowdowns(windows, {r: summarize(w) for r, w in windows.items()},
                                 **host)
    if named:
        assert list(found) == [1] and found[1].cause is Cause.COMPUTE
        assert found[1].steps == (7, 8, 9)
    else:
        assert found == {}


def _slow_at(slow_steps, num_steps=40):
    """Rank 0 computes 5 ms a step; rank 1 computes 15 ms at ``slow_steps``, 5 ms elsewhere."""
    return {rank: [StepStats(step, 0.010, 0.001, 0.015 if rank == 1 and step in slow_steps
                             else 0.005, world_rank=rank) for step in range(num_steps)]
            for rank in (0, 1)}


def _found(windows, num_steps=20):
    return persistent_slowdowns(windows, {r: summarize(w) for r, w in windows.items()},
                                num_steps=num_steps, scan_steps=40)


@pytest.mark.parametrize("slow,named", [
    # 20 steps in a row: named, over those 20
    (range(15, 35), range(15, 35)),
    # 19 in a row (this box's own episodes of one slow rank lasted at most 10): not named
    (range(15, 34), None),
    # 20 steps, 2 of them under the line: 1 step in 10 may miss
    (set(range(15, 35)) - {20, 30}, range(15, 35)),
    # 3 misses in those 20: not named
    (set(range(15, 35)) - {20, 25, 30}, None),
    # the latest 20 that begin and end slow: steps 18-37 (a miss at 19 and one at 36)
    (set(range(10, 38)) - {19, 36}, range(18, 38)),
])
def test_a_straggler_is_slow_at_all_but_one_in_ten_of_straggler_steps(slow, named):
    found = _found(_slow_at(slow))
    if named is None:
        assert found == {}
        return
    assert list(found) == [1] and found[1].steps == tuple(named)
    assert found[1].num_over == len(set(named) & set(slow))
    assert found[1].excess_s == pytest.approx(0.010)


def test_a_short_run_still_asks_every_step():
    # num_steps 3 (the gate's run): 3 of 3, no miss allowed (10 % of 3 rounds down to 0)
    assert list(_found(_slow_at({20, 21, 22}), num_steps=3)) == [1]
    assert _found(_slow_at({20, 22, 23}), num_steps=3) == {}
