"""A GuardedDataLoader attached to a StepGuard (``StepGuard.attach_loader``) opens each step
where the loop starts fetching its first batch and ends the data phase where each batch
arrives: the figures must be the ones the loop's own begin_step / mark("data") give."""

from __future__ import annotations

import pytest
import torch

from raytrain_guard.config import GuardConfig
from raytrain_guard.experiment.rehearsal import FaultInjector
from raytrain_guard.runtime.data.loader import GuardedDataLoader
from raytrain_guard.runtime.guard.step_guard import StepGuard
from raytrain_guard.runtime.guard.timing import StepTimer


class Clock:
    """A clock the test moves by hand (reads do not advance it)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedDataset:
    """Sample i: a 4-float vector; reading a sample advances ``clock`` by ``read_s``."""

    def __init__(self, n: int, clock: Clock, read_s: float = 0.01) -> None:
        self.n, self.clock, self.read_s = n, clock, read_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.clock.now += self.read_s
        return torch.full((4,), float(i))


def make(dataset, clock: Clock, batch_size: int = 2) -> GuardedDataLoader:
    return GuardedDataLoader(dataset, batch_size, world_rank=0, world_size=1, num_workers=0,
                             gpus_per_node=1, watch_worker_memory=False, clock=clock,
                             shuffle=False)


def guard_on(clock: Clock, **kw) -> StepGuard:
    return StepGuard(GuardConfig(gate_batch_steps=1), timer=StepTimer(clock=clock), **kw)


def run(guard: StepGuard, loader, clock: Clock, steps: int, *, explicit: bool,
        grad_accum: int = 1, between_s: float = 0.0) -> list:
    """``steps`` steps of ``grad_accum`` micro-batches: forward 0.1 s, backward 0.2 s per
    micro-batch, optimizer 0.05 s, and ``between_s`` of the loop's own work between steps
    (a report, a checkpoint). ``explicit``: the loop calls begin_step and mark("data"), else
    neither, as the train loop does with an attached loader."""
    batches = iter(loader)
    for step in range(steps):
        clock.now += between_s
        if explicit:
            guard.begin_step(step)
        for _ in range(grad_accum):
            next(batches)
            if explicit:
                guard.mark("data")
            clock.now += 0.1
            guard.mark("forward")
            clock.now += 0.2
            guard.mark("backward")
        clock.now += 0.05
        guard.mark("optimizer")
        guard.end_step(step)
    return guard.drain_stats()


def figures(stats) -> list[tuple]:
    return [(s.step, round(s.total_s, 9), round(s.data_wait_s, 9), round(s.forward_s, 9),
             round(s.backward_s, 9), round(s.optimizer_s, 9)) for s in stats]


class EventLikeTimer(StepTimer):
    """A timer the loader must call, as it calls a timer of CUDA events (not on the host);
    its stamps are the host clock's here, so the figures can be compared."""

    on_host = False

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.calls: list[str] = []

    def begin_step(self, step: int) -> None:
        self.calls.append(f"begin {step}")
        super().begin_step(step)

    def mark(self, phase: str) -> None:
        self.calls.append(phase)
        super().mark(phase)


@pytest.mark.parametrize("timer_kind", ["host", "events"])
@pytest.mark.parametrize("grad_accum", [1, 3])
def test_attached_loader_gives_the_loops_own_figures(grad_accum, timer_kind):
    got = {}
    for explicit in (True, False):
        clock = Clock()
        loader = make(TimedDataset(24, clock), clock)
        timer_type = StepTimer if timer_kind == "host" else EventLikeTimer
        guard = StepGuard(GuardConfig(gate_batch_steps=1), timer=timer_type(clock=clock))
        assert guard.attach_loader(loader) and guard.loader_attached
        got[explicit] = figures(run(guard, loader, clock, 4, explicit=explicit,
                                    grad_accum=grad_accum, between_s=5.0))
        if timer_kind == "events" and not explicit:
            # the loader calls the timer: begin where a step's first fetch starts, a data mark
            # per fetch (the loop's own marks: forward, backward per micro-batch, optimizer)
            assert guard.timer.calls == [
                call for step in range(4) for call in
                [f"begin {step}"] + ["data", "forward", "backward"] * grad_accum + ["optimizer"]]
    assert got[False] == got[True]
    # each fetch reads 2 samples (0.02 s): the data phase is the fetches only; the 5 s between
    # steps (the loop's own work) is in no step
    for step, total, data, fwd, bwd, opt in got[False]:
        assert data == pytest.approx(0.02 * grad_accum)
        assert fwd == pytest.approx(0.1 * grad_accum) and bwd == pytest.approx(0.2 * grad_accum)
        assert opt == pytest.approx(0.05)
        assert total == pytest.approx(0.32 * grad_accum + 0.05)


def test_without_attaching_the_steps_start_where_the_last_ended():
    # the control for the test above: the same loop, not attached, calling neither begin_step
    # nor mark("data"): the loop's 5 s land in every step after the first (what attach avoids)
    clock = Clock()
    loader = make(TimedDataset(24, clock), clock)
    guard = guard_on(clock)
    stats = run(guard, loader, clock, 3, explicit=False, between_s=5.0)
    assert [round(s.total_s, 6) for s in stats][1:] == [5.37, 5.37]
    assert all(s.data_wait_s == 0 for s in stats)


def test_an_epoch_change_inside_a_step_counts_as_data_wait():
    # 6 samples, batches of 2: the 4th fetch of the loop ends the epoch (StopIteration) and the
    # next iterator starts the new one. The step that spans the change waits for both fetches,
    # from the first one's start: the loader does not restart a step it opened already.
    clock = Clock()
    loader = make(TimedDataset(6, clock), clock)
    guard = guard_on(clock)
    assert guard.attach_loader(loader)

    def forever():
        while True:
            yield from loader

    batches = forever()
    for step in range(4):
        clock.now += 1.0
        next(batches)
        clock.now += 0.1
        guard.mark("forward")
        guard.end_step(step)
    stats = guard.drain_stats()
    assert [round(s.data_wait_s, 6) for s in stats] == [0.02, 0.02, 0.02, 0.02]
    # the end of epoch costs no clock time here; make it cost some and see it counted
    clock2 = Clock()
    loader2 = make(TimedDataset(2, clock2), clock2)
    guard2 = guard_on(clock2)
    guard2.attach_loader(loader2)
    first = iter(loader2)
    next(first)                                    # step 0: the epoch's only batch
    guard2.end_step(0)
    clock2.now += 1.0                              # between steps: not counted
    with pytest.raises(StopIteration):
        next(first)                                # step 1 opens here, the epoch is over
    clock2.now += 0.5                              # the loop's epoch change, inside step 1
    next(iter(loader2))
    guard2.end_step(1)
    step1 = guard2.drain_stats()[-1]
    assert step1.data_wait_s == pytest.approx(0.52) and step1.total_s == pytest.approx(0.52)


def test_attach_works_on_any_timer_clock_and_with_a_fault_injector():
    # the loader calls the guard, which stamps with its own timer: a timer on another clock
    # than the loader's is fine, and the injector's data delays run in the loader's data mark
    clock = Clock()
    loader = make(TimedDataset(8, clock), clock)
    other = Clock()
    guard = StepGuard(GuardConfig(gate_batch_steps=1), timer=StepTimer(clock=other))
    assert guard.attach_loader(loader)
    batches = iter(loader)
    next(batches)
    other.now += 0.3
    guard.end_step(0)
    assert guard.drain_stats()[0].total_s == pytest.approx(0.3)   # the timer's own clock

    def sleep(seconds):
        clock.now += seconds

    injector = FaultInjector(sleep=sleep)
    injector.delay(0.5, phase="data")
    injected = StepGuard(GuardConfig(gate_batch_steps=1), timer=StepTimer(clock=clock),
                         fault_injector=injector)
    assert injected.attach_loader(loader) and injected.loader_attached
    stats = run(injected, loader, clock, 2, explicit=False)
    assert injector.num_delays == 2
    assert [round(s.data_wait_s, 6) for s in stats] == [0.52, 0.52]   # fetch 0.02 + 0.5


def test_a_failing_loader_leaves_the_loop_marking():
    # the guard fails open: the loop marks as before
    class Broken:
        def time_steps(self, steps):
            raise RuntimeError("bug")

    guard = guard_on(Clock())
    assert not guard.attach_loader(Broken()) and not guard.loader_attached


def test_pacing_sleeps_before_each_step_the_loader_opens():
    # pacing with an attached loader: the loader sleeps before it opens each step, outside the
    # step's time, once per step (not per micro-batch); an explicit begin_step sleeps instead
    clock = Clock()
    loader = make(TimedDataset(40, clock), clock)
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        clock.now += seconds

    guard = guard_on(clock, sleep=sleep)
    assert guard.attach_loader(loader)
    guard.set_pace(0.25)
    stats = run(guard, loader, clock, 2, explicit=False, grad_accum=2)
    assert slept == [0.25, 0.25]
    assert [round(s.data_wait_s, 6) for s in stats] == [0.04, 0.04]
    assert [round(s.total_s, 6) for s in stats] == [0.69, 0.69]
    stats = run(guard, loader, clock, 1, explicit=True)
    assert slept == [0.25, 0.25, 0.25] and round(stats[0].total_s, 6) == 0.37
    guard.set_pace(0)
    run(guard, loader, clock, 2, explicit=False)
    assert len(slept) == 3


def test_a_resumed_guard_opens_the_step_it_resumes_at():
    # a run resumed at step 10: the attached loader opens step 10 (not 0), so the faults and
    # logs of that step are its own; the injector's delay for steps 10-11 runs at both
    clock = Clock()
    loader = make(TimedDataset(40, clock), clock)

    def sleep(seconds):
        clock.now += seconds

    injector = FaultInjector(sleep=sleep)
    injector.delay(0.3, phase="forward", steps=range(10, 12))
    guard = guard_on(clock, fault_injector=injector)
    assert guard.attach_loader(loader)
    guard.note_pause(10)
    batches = iter(loader)
    for step in (10, 11, 12):
        next(batches)
        clock.now += 0.01
        guard.mark("forward")
        guard.end_step(step)
    stats = guard.drain_stats()
    assert [s.step for s in stats] == [10, 11, 12]
    assert injector.num_delays == 2
