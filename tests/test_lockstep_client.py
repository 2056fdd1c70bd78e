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


class _CountingClient:
    """A coordinator client stand-in that counts how often the source asks it for decisions."""

    def __init__(self):
        self.polled_at, self.recorded, self._step = [], 0, None

    def record(self, stats):
        self.recorded += 1

    def poll_decisions(self):
        self.polled_at.append(self._step)
        return []


def test_decisions_are_collected_only_at_agreement_steps():
    client = _CountingClient()
    source = LockstepDecisionSource(Lockstep(every_steps=5), client)
    for step in range(1, 21):
        client._step = step
        source.poll(step, [StepStats(step=step - 1, total_s=0.1)])
    # K=5: steps 5, 10, 15, 20 only (before the fix: every step, each a ray.wait)
    assert client.polled_at == [5, 10, 15, 20] and client.recorded == 20


def _agree_main(rank: int, started: list, out_dir: str) -> None:
    import json
    import os

    from raytrain_guard.cluster.client import agree_on_start
    got = [agree_on_start(7 if rank == 0 else 0, ok) for ok in started[rank]]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(got, fh)


def test_ranks_agree_on_the_attempt_and_on_starting_together(tmp_path):
    """Two real gloo ranks. Rank 0 brings the coordinator's attempt 7, rank 1 brings 0. In the
    second round rank 1 could not start: both ranks fall back (never one alone)."""
    import json

    from gloo_world import spawn
    started = [[True, True], [True, False]]        # per rank, per round
    spawn(_agree_main, 2, started, str(tmp_path))
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == [[7, True], [7, False]]
