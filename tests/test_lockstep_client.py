"""The coordinator client fails open: no coordinator, no blocking, lazy re-lookup."""

from __future__ import annotations

import threading
import time

from raytrain_guard.coordination.client import (
    CoordinatorClient,
    LockstepDecisionSource,
    coordinator_name,
)
from raytrain_guard.coordination.lockstep import Lockstep
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
                               background=False,
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


class _Coordinator:
    """Stands in for the coordinator's handle: records the steps of each report; the client's
    one method that waits on Ray (:class:`_SlowClient`) waits until ``answer`` is set."""

    def __init__(self) -> None:
        self.steps: list[list[int]] = []
        self.answer = threading.Event()
        reports = self

        class ReportSteps:
            def remote(self, world_rank, node_id, attempt, rows, setup, cursor, **applied):
                reports.steps.append([row[0] for row in rows])
                return "report"

        class DecisionsSince:
            def remote(self, cursor):
                return "decisions"

        self.report_steps, self.decisions_since = ReportSteps(), DecisionsSince()


class _SlowClient(CoordinatorClient):
    def _answers(self, refs):
        self.lookup("", None).answer.wait(10.0)      # a coordinator that answers late
        return [None, []][:len(refs)]


def _timed_steps(source, steps):
    """The longest a step boundary took (seconds) over ``steps``."""
    longest = 0.0
    for step in steps:
        started = time.perf_counter()
        assert source.poll(step, [StepStats(step=step, total_s=0.1)]) == []
        longest = max(longest, time.perf_counter() - started)
    return longest


def test_a_lookup_that_blocks_never_holds_a_step(monkeypatch):
    """ray.get_actor waiting on an unresponsive GCS: the steps go on at once, their reports
    queued on the link (4 at most, the next dropped and counted); once the lookup answers,
    the queued reports go out."""
    import ray
    release, calls, coordinator = threading.Event(), [], _Coordinator()
    coordinator.answer.set()

    def get_actor(name, namespace=None):
        calls.append((name, namespace))
        release.wait(3.0)
        return coordinator

    monkeypatch.setattr(ray, "get_actor", get_actor)
    client = _SlowClient("c", namespace="ns", world_rank=0, node_id="n0",
                         report_every_steps=1, retry_after_s=0.0,
                         lookup=lambda name, ns: get_actor(name, ns) if name else coordinator)
    source = LockstepDecisionSource(Lockstep(every_steps=1), client)
    assert _timed_steps(source, range(5)) < 0.05          # not the lookup's 3 s
    assert calls == [("c", "ns")] and not client.connected
    assert client.num_reports_dropped == 1                 # 4 queued, the fifth dropped
    release.set()
    _wait_until(lambda: coordinator.steps == [[0], [1], [2], [3]])
    source.poll(5, [StepStats(step=5, total_s=0.1)])
    _wait_until(lambda: coordinator.steps[-1] == [5])
    assert client.connected and client.num_failures == 0


def test_the_step_path_never_waits_on_a_slow_coordinator():
    """A coordinator that takes seconds to answer: every step boundary returns within
    milliseconds, reports beyond the link's queue are dropped and counted, and once the
    coordinator answers the queued ones go out and new ones follow."""
    coordinator = _Coordinator()
    client = _SlowClient("c", namespace="ns", world_rank=0, node_id="n0",
                         report_every_steps=2, lookup=lambda name, ns: coordinator)
    _wait_until(lambda: client.connected)
    source = LockstepDecisionSource(Lockstep(every_steps=2), client)
    assert _timed_steps(source, range(2)) < 0.05
    _wait_until(lambda: coordinator.steps == [[0, 1]])      # sent; its answer does not come
    # 18 more steps = 9 reports: 4 wait in the queue, 5 are dropped
    assert _timed_steps(source, range(2, 20)) < 0.05
    assert coordinator.steps == [[0, 1]] and client.num_reports_dropped == 5
    coordinator.answer.set()
    _wait_until(lambda: len(coordinator.steps) == 5)
    assert _timed_steps(source, range(20, 22)) < 0.05
    _wait_until(lambda: coordinator.steps[-1] == [20, 21])
    assert client.num_reports_sent == 6 and client.num_failures == 0


def test_the_last_partial_batch_leaves_at_the_end_within_a_bounded_wait():
    """finish() queues the steps kept and waits for them to leave: at once with a coordinator
    that answers, at most ``flush``'s bound with one that does not."""
    coordinator = _Coordinator()
    coordinator.answer.set()
    client = _SlowClient("c", namespace="ns", world_rank=0, node_id="n0",
                         report_every_steps=10, lookup=lambda name, ns: coordinator)
    _wait_until(lambda: client.connected)
    source = LockstepDecisionSource(Lockstep(every_steps=10), client)
    source.poll(0, [StepStats(step=0, total_s=0.1)])
    source.finish([StepStats(step=1, total_s=0.1)])
    assert coordinator.steps == [[0, 1]]                  # sent before finish returned
    silent = _Coordinator()                               # never answers
    client = _SlowClient("c", namespace="ns", world_rank=0, node_id="n0",
                         report_every_steps=10, lookup=lambda name, ns: silent)
    _wait_until(lambda: client.connected)
    client.record([StepStats(step=s, total_s=0.1) for s in range(10)])   # a batch, waiting
    client.record(StepStats(step=10, total_s=0.1))
    started = time.monotonic()
    client.flush(timeout_s=0.3)
    assert time.monotonic() - started < 1.0 and silent.steps == [list(range(10))]
    silent.answer.set()


def _wait_until(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_a_source_without_client_is_plain_lockstep():
    source = LockstepDecisionSource(Lockstep(every_steps=2))
    assert [source.poll(s, None) for s in range(4)] == [[], [], [], []]
    assert source.applied == []


def test_cluster_source_that_cannot_start_fails_open_and_pickles_without_state():
    import pickle

    from raytrain_guard.coordination.client import ClusterDecisionSource
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

    from raytrain_guard.coordination.client import agree_on_start
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
