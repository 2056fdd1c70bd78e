"""The shared train loop reads the step guard's StepStats at the report cadence, in-process (one
rank, torch on CPU, no Ray).

The guard's fast path buffers quiet steps and feeds them to its gate in batches; a read of the
stats (``drain_stats``) builds the StepStats of the waiting steps without feeding the gate (an
earlier version flushed the buffer: one read per step meant no batching at all). The loop reads
them every ``report_every_steps`` steps and at boundaries that may stop or checkpoint, and hands
``[]`` to the decision source in between. Over a run, every step's StepStats reaches the gauges and the decision source exactly
once, in order, the last partial report period included; the coordinator client still gets
every step in batches and the lockstep exchange still runs at every agreement step.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from examples import toy
from raytrain_guard.coordination.client import CoordinatorClient, LockstepDecisionSource
from raytrain_guard.coordination.context import WorkerContext
from raytrain_guard.coordination.lockstep import Lockstep, SingleRankExchange
from raytrain_guard.core.decisions import Action, Cause, Decision
from raytrain_guard.runtime.loop.train_loop import DirectoryReporter, GuardedTrainLoop, LoopConfig

# One rank, 64 samples, micro-batch 4: 16 steps per epoch; max_steps 23 ends inside the sixth
# report period of N = 4 (steps 20-22). lockstep_every_steps K = 4, so the stop agreement
# (default: K) and the lockstep share the boundaries 4, 8, ..., 20; the guard feeds its gate
# every B = 4 buffered steps too. slow_step_factor 1000: no step of the toy model is slow, every
# step after the gate's first bounds is quiet.
N = K = B = 4
TOTAL = 23
BASE = {"model_factory": toy.make_model,
        "dataset_factory": functools.partial(toy.make_dataset, 64),
        "optimizer_factory": toy.make_optimizer, "loss_fn": toy.loss_fn, "micro_batch": 4,
        "epochs": 2, "max_steps": TOTAL, "checkpoint_every_steps": 100, "num_workers": 0,
        "seed": 1, "measure_bandwidth": False,
        "guard": {"report_every_steps": N, "lockstep_every_steps": K, "gate_batch_steps": B,
                  # no slow step on a loaded box: a gate decision reads the stats off-cadence
                  "slow_step_factor": 1000.0, "slow_component_growth_steps": 0.0}}


class RecordingGauges:
    """Stands in for the Ray gauges (no-ops outside Ray): the steps recorded, in order."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def record(self, stats) -> None:
        self.steps.extend(s.step for s in stats)

    def record_decision(self, decision) -> None:
        pass


class ObservedLoop(GuardedTrainLoop):
    """The loop with its gauges recorded."""

    def _build_guard(self) -> None:
        super()._build_guard()
        self.metrics = RecordingGauges()


class RecordingSource:
    """A decision source that notes what each boundary hands it (and how many quiet steps the
    guard holds back then), and passes the call on to ``inner`` (None: no decisions)."""

    def __init__(self, inner=None, script=None) -> None:
        self.inner = inner
        self.script = script or {}        # boundary -> decisions returned there
        self.loop: GuardedTrainLoop | None = None
        self.polls: list[tuple[int, list[int], int]] = []   # (step, stats steps, buffered)
        self.finished: list[int] | None = None              # steps handed to finish()

    def poll(self, step, stats):
        # the steps the guard's feed buffers for its gate now
        self.polls.append((step, [s.step for s in stats], len(self.loop.guard.feed._buffer)))
        due = self.inner.poll(step, stats) if self.inner is not None else []
        return due + self.script.get(step, [])

    def finish(self, stats):
        self.finished = [s.step for s in stats]
        if self.inner is not None:
            self.inner.finish(stats)


class CountingExchange(SingleRankExchange):
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.step = 0

    def exchange(self, newest_id, pending):
        self.steps.append(self.step)
        return super().exchange(newest_id, pending)


class CountingLockstep(Lockstep):
    def poll(self, step):
        self.exchange.step = step
        return super().poll(step)


class AnsweredClient(CoordinatorClient):
    """The real client; the one method that waits on Ray finds every call answered, with no
    decisions."""

    def _answers(self, refs):
        return [[] for _ in refs]


class FakeCoordinator:
    """Stands in for the coordinator actor handle: records the report batches."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        coordinator = self

        class Reports:
            def remote(self, world_rank, node_id, attempt, rows, setup, cursor):
                coordinator.batches.append([row[0] for row in rows])
                return object()

        class Fetches:
            def remote(self, cursor):
                return object()

        self.report_steps, self.decisions_since = Reports(), Fetches()


def _run(tmp: Path, source: RecordingSource, **changes) -> ObservedLoop:
    config = LoopConfig.from_dict({**BASE, "decision_source": source, **changes})
    loop = ObservedLoop(config, context=WorkerContext(world_rank=0, world_size=1),
                        reporter=DirectoryReporter(str(tmp)))
    source.loop = loop
    loop.run()
    return loop


def _stop(step: int | None) -> Decision:
    return Decision(Action.CHECKPOINT_AND_STOP, "test stop", step, Cause.DEVICE_MEMORY,
                    "cluster", {}, 7)


def test_stats_are_read_every_report_period_and_none_is_lost(tmp_path):
    coordinator = FakeCoordinator()
    client = AnsweredClient("c", namespace="ns", world_rank=0, node_id="n0",
                           report_every_steps=N, lookup=lambda name, ns: coordinator,
                           background=False)
    exchange = CountingExchange()
    source = RecordingSource(LockstepDecisionSource(CountingLockstep(K, exchange), client))
    loop = _run(tmp_path, source)

    assert loop.steps.step == TOTAL and loop.boundary.stop_reason is None
    # stats at boundaries 4, 8, ..., 20 and at the last one (23), [] at the others
    handed = {step: steps for step, steps, _ in source.polls if steps}
    assert [step for step, _, _ in source.polls] == list(range(1, TOTAL + 1))
    assert handed == {4: [0, 1, 2, 3], 8: [4, 5, 6, 7], 12: [8, 9, 10, 11],
                      16: [12, 13, 14, 15], 20: [16, 17, 18, 19], 23: [20, 21, 22]}
    # every step once, in order, to the decision source and to the gauges
    assert [s for steps in handed.values() for s in steps] == list(range(TOTAL))
    assert loop.metrics.steps == list(range(TOTAL))
    # the fast path works between and across reads: once the gate's window holds the steps
    # after the 2 warm-up ones, quiet steps wait, B at most; a read does not flush them, so
    # from boundary 13 on the guard holds 0, 1, ..., B - 1 of them in turn, whatever the
    # report cadence
    held = [h for step, _, h in source.polls if step >= 13]
    assert sorted(set(held)) == list(range(B))
    assert all((b - a) % B == 1 for a, b in zip(held, held[1:]))
    # the coordinator gets the full batches of N, and at the end of the run the last, partial
    # one (20-22; the boundary at 23 read them, so finish() gets nothing more); the lockstep
    # agrees at every multiple of K
    assert coordinator.batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                   [12, 13, 14, 15], [16, 17, 18, 19], [20, 21, 22]]
    assert source.finished == [] and client._buffer == []
    assert client.num_reports_dropped == 0
    assert exchange.steps == [4, 8, 12, 16, 20]
    # the gate saw every step (the end-of-run attribution reads its window)
    assert loop.guard.state_dict()["gate"]["num_seen"] == TOTAL
    assert loop.guard.gate.window[-1].step == TOTAL - 1
    # the loop marks forward and backward only: the optimizer phase is timed from the backward
    # mark to end_step, and the phases fit in the step
    for s in loop.guard.gate.window:
        assert s.forward_s > 0 and s.backward_s > 0 and s.optimizer_s > 0
        assert s.data_wait_s + s.compute_s + s.comm_wait_s <= s.total_s


@pytest.mark.parametrize("script,handed_last", [
    # a stop due at once, returned at boundary 11 (no read there): steps 8-10 reach the gauges
    # and the source's finish() after the loop; the source had them up to the read at 8
    ({11: [_stop(None)]}, 8),
    # a stop for boundary 11 handed over at 9: pending, so boundary 11 reads the stats first
    ({9: [_stop(11)]}, 11),
])
def test_a_stop_between_report_steps_loses_no_stats(tmp_path, script, handed_last):
    source = RecordingSource(script=script)
    loop = _run(tmp_path, source)
    assert loop.steps.step == 11 and loop.boundary.stop_reason == "test stop"
    assert loop.metrics.steps == list(range(11))
    handed = [s for _, steps, _ in source.polls for s in steps]
    assert handed == list(range(handed_last))
    assert handed + source.finished == list(range(11))      # every step, once, in order
