"""The coordinator's step-by-step straggler rule (core.straggler.persistent_slowdowns): pure,
scripted figures."""

from __future__ import annotations

import pytest

from raytrain_guard.core.decisions import Cause
from raytrain_guard.core.steps import StepStats
from raytrain_guard.core.straggler import StepColumns, persistent_slowdowns, summarize


def _slow_at(slow_steps, num_steps=40):
    """Rank 0 computes 5 ms a step; rank 1 computes 15 ms at ``slow_steps``, 5 ms elsewhere."""
    return {rank: [StepStats(step, 0.010, 0.001, 0.015 if rank == 1 and step in slow_steps
                             else 0.005, world_rank=rank) for step in range(num_steps)]
            for rank in (0, 1)}


def _found(windows, num_steps=20):
    return persistent_slowdowns({r: StepColumns.of(w) for r, w in windows.items()},
                                {r: summarize(w) for r, w in windows.items()},
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


def test_a_missing_batch_leaves_its_steps_out_of_the_common_steps():
    """Rank 0's report of steps 30-34 never arrived: the steps both ranks reported are
    compared (the latest 20 of rank 0 up to 39 hold 15 that rank 1 has too)."""
    windows = _slow_at(range(40))
    windows[0] = [s for s in windows[0] if not 30 <= s.step < 35]
    found = persistent_slowdowns({r: StepColumns.of(w) for r, w in windows.items()},
                                 {r: summarize(w) for r, w in windows.items()},
                                 num_steps=10, scan_steps=20)
    assert found[1].steps == (25, 26, 27, 28, 29, 35, 36, 37, 38, 39)
    assert found[1].cause is Cause.COMPUTE and found[1].excess_s == pytest.approx(0.010)
