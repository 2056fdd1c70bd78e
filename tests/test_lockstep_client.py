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
                               run_lookup=lambda look_up: look_up(),
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


class _Reports:
    """Stands in for the coordinator's handle: records the steps of each report."""

    def __init__(self) -> None:
        self.steps: list[list[int]] = []
        reports = self

        class ReportSteps:
            def remote(self, world_rank, node_id, attempt, rows, setup, cursor, **applied):
                reports.steps.append([row[0] for row in rows])
                return object()

        class DecisionsSince:
            def remote(self, cursor):
                return object()

        self.report_steps, self.decisions_since = ReportSteps(), DecisionsSince()


def test_a_lookup_that_blocks_never_holds_a_step(monkeypatch):
    """ray.get_actor waiting on an unresponsive GCS: the steps go on at once (their reports
    dropped), one lookup at a time; once it answers, the next report goes out."""
    import threading
    import time

    import ray
    release, calls, coordinator = threading.Event(), [], _Reports()

    def get_actor(name, namespace=None):
        calls.append((name, namespace))
        release.wait(3.0)
        return coordinator

    monkeypatch.setattr(ray, "get_actor", get_actor)
    client = CoordinatorClient("c", namespace="ns", world_rank=0, node_id="n0",
                               report_every_steps=1, retry_after_s=0.0)
    source = LockstepDecisionSource(Lockstep(every_steps=1), client)
    started = time.monotonic()
    for step in range(5):
        assert source.poll(step, [StepStats(step=step, total_s=0.1)]) == []
    assert time.monotonic() - started < 0.5         # not the lookup's 3 s
    assert calls == [("c", "ns")]                   # a retry is due, but one is running
    assert client.num_reports_dropped == 5 and not client.connected
    release.set()
    deadline = time.monotonic() + 5.0
    while not client.connected and time.monotonic() < deadline:
        time.sleep(0.01)
    source.poll(5, [StepStats(step=5, total_s=0.1)])
    assert coordinator.steps == [[5]] and client.num_failures == 0


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
