"""StepTimer on the host clock: exact phase arithmetic with a fake clock, and the CUDA path
(skipped without CUDA)."""

from __future__ import annotations

import pytest

from raytrain_guard.errors import InputError
from raytrain_guard.runtime.guard.timing import StepTimer


class TickClock:
    """Returns the next value of a script on each call."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def __call__(self) -> float:
        return self.values.pop(0)


def test_lap_marks_and_comm_wait():
    # Stamps: construction 0.0 (unused, begin_step restarts), begin 1.0, data 1.1, forward 1.3,
    # last bucket ready 1.55, done 1.60 (a bucket that finished before the last one was ready,
    # so it does not count beyond the last), done 1.70, backward mark 1.72, optimizer 1.80,
    # finish 1.85.
    clock = TickClock(0.0, 1.0, 1.1, 1.3, 1.55, 1.60, 1.70, 1.72, 1.80, 1.85)
    timer = StepTimer(clock=clock, world_rank=2)
    timer.begin_step(7)
    timer.mark("data")
    timer.mark("forward")
    timer.record_bucket_ready(is_last=False)   # not stamped: only the last bucket is
    timer.record_bucket_ready(is_last=True)
    timer.record_bucket_done()
    timer.record_bucket_done()
    timer.mark("backward")
    timer.mark("optimizer")
    stats = timer.finish_step(7)
    # comm_wait = max(1.60, 1.70) - 1.55 = 0.15; backward mark 1.72 - 1.3 = 0.42, minus the
    # wait -> 0.27; total 1.85 - 1.0 = 0.85.
    assert stats.step == 7 and stats.world_rank == 2
    assert stats.total_s == pytest.approx(0.85)
    assert stats.data_wait_s == pytest.approx(0.1)
    assert stats.forward_s == pytest.approx(0.2)
    assert stats.comm_wait_s == pytest.approx(0.15)
    assert stats.backward_s == pytest.approx(0.27)
    assert stats.optimizer_s == pytest.approx(0.08)
    assert stats.compute_s == pytest.approx(0.55)


def test_context_manager_phases_leave_gaps_untimed_and_add_up():
    # begin 0.0; enter forward 0.5, exit 0.6; enter forward 0.7, exit 0.9 (micro-batches add
    # up: 0.3); finish 1.0. The gaps (0.0-0.5, 0.6-0.7, 0.9-1.0) are in total only.
    clock = TickClock(0.0, 0.0, 0.5, 0.6, 0.7, 0.9, 1.0)
    timer = StepTimer(clock=clock)
    timer.begin_step(0)
    with timer.phase("forward"):
        pass
    with timer.phase("forward"):
        pass
    stats = timer.finish_step(0)
    assert stats.forward_s == pytest.approx(0.3) and stats.total_s == pytest.approx(1.0)
    assert stats.comm_wait_s == 0.0 and stats.data_wait_s == 0.0


def test_step_without_begin_starts_where_the_last_ended():
    clock = TickClock(0.0, 0.4, 1.0, 1.5)
    timer = StepTimer(clock=clock)
    timer.mark("data")                       # 0.0 -> 0.4
    first = timer.finish_step(0)             # ends at 1.0
    second = timer.finish_step(1)            # 1.0 -> 1.5
    assert first.total_s == pytest.approx(1.0) and first.data_wait_s == pytest.approx(0.4)
    assert second.total_s == pytest.approx(0.5) and second.step == 1


def test_comm_fully_overlapped_is_zero():
    # Completion (0.2) before the last bucket was ready (0.3): nothing exposed.
    clock = TickClock(0.0, 0.0, 0.2, 0.3, 0.4, 0.5)
    timer = StepTimer(clock=clock)
    timer.begin_step(0)
    timer.record_bucket_done()
    timer.record_bucket_ready(is_last=True)
    timer.mark("backward")
    stats = timer.finish_step(0)
    assert stats.comm_wait_s == 0.0 and stats.backward_s == pytest.approx(0.4)


def test_unknown_phase_names_the_fix():
    timer = StepTimer()
    with pytest.raises(InputError, match="unknown phase.*'fwd'.*backward"):
        timer.mark("fwd")
    with pytest.raises(InputError), timer.phase("bogus"):
        pass


def test_real_clock_measures_a_sleep():
    import time

    timer = StepTimer()
    timer.begin_step(0)
    time.sleep(0.02)
    timer.mark("forward")
    stats = timer.finish_step(0)
    assert stats.forward_s >= 0.019 and stats.total_s >= stats.forward_s


@pytest.mark.gpu
def test_cuda_events_come_back_a_step_later():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    timer = StepTimer(device="cuda")
    x = torch.randn(2048, 2048, device="cuda")
    got = []
    for step in range(4):
        timer.begin_step(step)
        y = x @ x
        timer.mark("forward")
        got.append(timer.finish_step(step))
        del y
    torch.cuda.synchronize()
    got.append(timer.finish_step(4))
    done = [s for s in got if s is not None]
    assert done and done[0].step == 0 and done[0].forward_s > 0
    assert [s.step for s in done] == sorted(s.step for s in done)


@pytest.mark.gpu
def test_cuda_events_are_pooled():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    timer = StepTimer(device="cuda")
    x = torch.randn(512, 512, device="cuda")
    for step in range(200):
        timer.begin_step(step)
        y = x @ x
        timer.mark("forward")
        timer.mark("backward")
        timer.finish_step(step)
        if step % 50 == 0:
            torch.cuda.synchronize()
        del y
    # 3-4 events per step: without the pool 200 steps make ~800; with it, only the steps in
    # flight (at most max_pending + 1 of them) hold events at once
    assert timer._events.num_created <= 4 * (timer._max_pending + 2)
    torch.cuda.synchronize()
    stats = timer.finish_step(200)
    assert stats is not None and stats.forward_s >= 0


def test_comm_timer_wraps_a_given_hook(tmp_path):
    # One-process gloo group: DDP still runs its hook on every bucket. A counting hook around
    # fp16 compression shows the given hook is the one called, and the stats come back.
    torch = pytest.importorskip("torch")
    from gloo_world import one_rank
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from raytrain_guard.runtime.guard.comm_timers import attach_comm_timer

    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        return fp16_compress_hook(state, bucket)

    def body():
        model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)),
                    bucket_cap_mb=0.01)
        timer = StepTimer()
        attach_comm_timer(model, timer, hook=counting_hook)
        for step in range(3):
            timer.begin_step(step)
            model(torch.randn(8, 64)).sum().backward()
            timer.mark("backward")
            stats = timer.finish_step(step)
            assert stats.comm_wait_s >= 0.0 and stats.backward_s >= 0.0
        assert len(calls) >= 3 and stats.step == 2
        with pytest.raises(InputError, match="register_comm_hook"):
            attach_comm_timer(torch.nn.Linear(2, 2), timer)

    one_rank(body, tmp_path)


def test_comm_wait_is_the_late_completion_after_the_last_bucket(tmp_path):
    # A hook whose last bucket's future completes 50 ms after it was launched (a slow link):
    # DDP's backward waits for it, comm_wait_s reads about 50 ms and backward_s excludes it.
    torch = pytest.importorskip("torch")
    import threading

    from gloo_world import one_rank
    from torch.nn.parallel import DistributedDataParallel as DDP

    from raytrain_guard.runtime.guard.comm_timers import attach_comm_timer

    def slow_last_bucket(state, bucket):
        fut = torch.futures.Future()
        buf = bucket.buffer()
        if bucket.is_last():
            threading.Timer(0.05, fut.set_result, args=(buf,)).start()
        else:
            fut.set_result(buf)
        return fut

    def body():
        model = DDP(torch.nn.Linear(64, 64))
        timer = StepTimer()
        attach_comm_timer(model, timer, hook=slow_last_bucket)
        got = []
        for step in range(3):
            timer.begin_step(step)
            model(torch.randn(8, 64)).sum().backward()
            timer.mark("backward")
            got.append(timer.finish_step(step))
        for stats in got:
            assert 0.045 <= stats.comm_wait_s < 1.0, stats
            # Counted once: were the wait left in backward_s, the two would exceed the step.
            assert stats.backward_s + stats.comm_wait_s <= stats.total_s, stats

    one_rank(body, tmp_path)


def test_close_step_and_stats_of_sum_like_finish_step():
    # StepGuard's fast path closes host steps with close_step and builds their StepStats later
    # with stats_of (its own loop): the same figures as finish_step, communication wait included
    stamps = (0.0, 1.0, 1.1, 1.3, 1.55, 1.60, 1.70, 1.72, 1.80, 1.85, 1.9)
    got = []
    for close in (False, True):
        timer = StepTimer(clock=TickClock(*stamps), world_rank=2)
        timer.begin_step(7)
        timer.mark("data")
        timer.mark("forward")
        timer.record_bucket_ready(is_last=True)
        timer.record_bucket_done()
        timer.record_bucket_done()
        timer.mark("backward")
        timer.mark("optimizer")
        timer.mark("data")                     # a second data phase adds up
        if close:
            record, total_s = timer.close_step(7)
            stats = timer.stats_of(record, 0.5)
            assert total_s == pytest.approx(stats.total_s)
        else:
            stats = timer.finish_step(7, memory_frac=0.5)
        got.append(stats)
    assert got[0] == got[1]
    # comm 1.70 - 1.55; backward 1.72 - 1.3 less that wait; data 0.1 + 0.05; total 1.9 - 1.0
    assert got[1].comm_wait_s == pytest.approx(0.15) and got[1].backward_s == pytest.approx(0.27)
    assert got[1].data_wait_s == pytest.approx(0.15) and got[1].total_s == pytest.approx(0.9)
    assert got[1].world_rank == 2


# The optimizer phase needs no mark: a step whose last mark is backward counts the time from
# it to the step's end as optimizer. Stamps: begin 1.0, then the marks' stamps, finish 1.75.
@pytest.mark.parametrize("marks, stamps, expected", [
    # data 0.1, forward 0.2, backward 0.3, the rest (1.75 - 1.6) optimizer
    (["data", "forward", "backward"], [1.1, 1.3, 1.6], (0.1, 0.2, 0.3, 0.15)),
    # an optimizer mark: its own 0.1; the 0.05 after it is untimed
    (["data", "forward", "backward", "optimizer"], [1.1, 1.3, 1.6, 1.7], (0.1, 0.2, 0.3, 0.1)),
    # last mark forward: the rest (0.45) is of no phase
    (["data", "forward"], [1.1, 1.3], (0.1, 0.2, 0.0, 0.0)),
    # two micro-batches: backward 0.2 + 0.1; the rest after the last backward 1.75 - 1.6
    (["data", "forward", "backward", "data", "forward", "backward"],
     [1.05, 1.1, 1.3, 1.35, 1.5, 1.6], (0.1, 0.2, 0.3, 0.15)),
    # no mark at all: nothing timed
    ([], [], (0.0, 0.0, 0.0, 0.0)),
])
@pytest.mark.parametrize("path", ["finish_step", "close_step"])
def test_the_rest_after_the_last_backward_mark_is_the_optimizer(marks, stamps, expected, path):
    clock = TickClock(0.0, 1.0, *stamps, 1.75)
    timer = StepTimer(clock=clock)
    timer.begin_step(3)
    for phase in marks:
        timer.mark(phase)
    if path == "finish_step":
        stats = timer.finish_step(3)
    else:
        record, total_s = timer.close_step(3)
        assert total_s == pytest.approx(0.75)
        stats = timer.stats_of(record, None)
    got = (stats.data_wait_s, stats.forward_s, stats.backward_s, stats.optimizer_s)
    assert got == pytest.approx(expected)
    assert stats.total_s == pytest.approx(0.75)


class FakeEvent:
    """A CUDA event's timing API over a number of milliseconds."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.ms - self.ms

    def query(self) -> bool:
        return True


def test_event_stamps_give_the_optimizer_the_rest_after_backward_too():
    # CUDA stamps (events, read with elapsed_time in ms): start 0, data 10, forward 30,
    # backward 60, end 75 -> optimizer 15 ms from the last backward mark to the end
    from raytrain_guard.runtime.guard.timing import UNTIMED, _elapsed_s, _StepRecord

    record = _StepRecord(FakeEvent(0.0), 0.0)
    record.marks += [(0, FakeEvent(10.0)), (1, FakeEvent(30.0)), (2, FakeEvent(60.0)),
                     (UNTIMED, FakeEvent(75.0))]
    stats = StepTimer()._stats(record, _elapsed_s, None)
    got = (stats.total_s, stats.data_wait_s, stats.forward_s, stats.backward_s,
           stats.optimizer_s)
    assert got == pytest.approx((0.075, 0.010, 0.020, 0.030, 0.015))
