"""The test harness's ranks exit cleanly even when gloo's worker threads outlive their group.

A gloo worker thread that runs a ``Future.then`` callback during interpreter finalization
takes the GIL and aborts its process (SIGABRT, "terminate called without an active
exception"). ``destroy_process_group`` joins those threads only when nothing else holds the
group, so a rank that keeps the group alive must leave without finalization.
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist
from gloo_world import spawn

_KEPT: list = []


def _leave_a_callback_running(rank: int) -> None:
    def slow(fut):
        time.sleep(0.5)               # still running in gloo's thread when the rank returns
        return fut.value()

    _KEPT.append(dist.group.WORLD)   # the group outlives destroy_process_group
    _KEPT.append(dist.all_reduce(torch.ones(4), async_op=True).get_future().then(slow))
    time.sleep(0.1)                   # the allreduce is done, its callback is asleep


def test_rank_with_a_callback_in_flight_exits_cleanly():
    spawn(_leave_a_callback_running, 2)


def _fail(rank: int) -> None:
    raise ValueError(f"rank {rank} fails on purpose")


def test_a_failing_rank_still_fails_the_spawn():
    with pytest.raises(Exception, match="fails on purpose"):
        spawn(_fail, 2)
