"""The coordinator client fails open: no coordinator, no blocking, lazy re-lookup."""

from __future__ import annotations

from raytrain_guard.cluster.client import (
    CoordinatorClient, LockstepDecisionSource, coordinator_name)
from raytrain_guard.cluster.lockstep import Lockstep
from raytrain_guard.core.steps import StepStats


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _absent(calls):
    def lookup(name, namespace):
        calls.append((name, namespace))
        raise ValueError(f"Failed to look up actor {name!r}")
    return lookup


def test_coordinator_name():
    assert coordinator_name("run7") == "raytrain_guard:coordinator:run7"


def test_without_a_coordinator_steps_go_on_and_lookups_are_lazy():
    calls, clock = [], _Clock()
    client = CoordinatorClient("raytrain_guard:coordinator:x", namespace="ns", world_rank=1,
                               node_id="n1", report_every_steps=5, lookup=_absent(calls),
                               clock=clock, retry_after_s=5.0)
    source = LockstepDecisionSource(Lockstep(every_steps=5), client)
    for step in range(20):                         # 20 steps = 4 report batches, same instant
        assert source.poll(step, StepStats(step=step, total_s=0.1, world_rank=1)) == []
    # one lookup only: the next is not due before 5 s of the injected clock have passed
    assert calls == [("raytrain_guard:coordinator:x", "ns")]
    assert client.num_reports_dropped == 4 and not client.connected
    clock.now += 5.0
    for step in range(20, 25):
        source.poll(step, StepStats(step=step, total_s=0.1, world_rank=1))
    assert len(calls) == 2                         # retried once the interval had passed
    assert client.num_failures == 2


def test_a_source_without_client_is_plain_lockstep():
    source = LockstepDecisionSource(Lockstep(every_steps=2))
    assert [source.poll(s, None) for s in range(4)] == [[], [], [], []]
    assert source.applied == []


def test_cluster_source_that_cannot_start_fails_open_and_pickles_without_state():
    import pickle

    from raytrain_guard.cluster.client import ClusterDecisionSource
    source = ClusterDecisionSource("r", "ns", {"no_such_key": 1})   # bad guard config
    assert source.poll(1, []) == [] and source.poll(2, []) == []    # training goes on
    assert source.applied == []
    copy = pickle.loads(pickle.dumps(source))        # what each TorchTrainer worker receives
    assert copy._source is None and copy.run_id == "r"
