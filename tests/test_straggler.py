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
