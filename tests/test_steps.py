"""StepStats: a frozen value whose hand-written __init__ (one dict update, for speed) keeps the
dataclass's fields, order and defaults."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from raytrain_guard.core.steps import StepStats


def test_init_takes_the_fields_in_order_with_their_defaults():
    params = list(inspect.signature(StepStats).parameters.values())
    fields = dataclasses.fields(StepStats)
    assert [p.name for p in params] == [f.name for f in fields]
    assert [p.default for p in params] == [
        inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        for f in fields]


def test_a_frozen_value():
    a = StepStats(3, 0.5, 0.1, 0.2, 0.1, 0.05, 0.05, 0.4, 1)
    assert a == StepStats(step=3, total_s=0.5, data_wait_s=0.1, forward_s=0.2, backward_s=0.1,
                          comm_wait_s=0.05, optimizer_s=0.05, memory_frac=0.4, world_rank=1)
    assert hash(a) == hash(StepStats.from_dict(a.to_dict()))
    assert a.compute_s == pytest.approx(0.35)
    assert dataclasses.replace(a, world_rank=2).world_rank == 2
    assert StepStats(1, 0.2).memory_frac is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.step = 4
    with pytest.raises(TypeError):
        StepStats(1)                        # total_s is required
