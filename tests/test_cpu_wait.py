"""The training thread's wait for a CPU: the timer's per-step figure, the real reader, and the
gate telling a host's contention from a rank's slowdown on real processes."""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import subprocess
import sys
import time

import pytest

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action
from raytrain_guard.runtime.cpu_wait import ThreadCpuWait
from raytrain_guard.runtime.node_cpu_waits import (
    RING_STEPS,
    SWEEP_MIN_AGE_S,
    NodeCpuWaits,
    sweep_stale_boards,
)
from raytrain_guard.runtime.step_guard import StepGuard
from raytrain_guard.runtime.timing import StepTimer

HAS_SCHEDSTAT = os.path.exists("/proc/thread-self/schedstat") and hasattr(os, "sched_setaffinity")
needs_schedstat = pytest.mark.skipif(not HAS_SCHEDSTAT,
                                     reason="needs Linux /proc/thread-self/schedstat")


def test_the_timer_gives_a_step_the_wait_since_the_previous_close_when_both_were_read():
    readings = iter([1.0, 1.25, 1.5, 3.0, 3.5])
    clock = iter(float(i) for i in range(100))
    timer = StepTimer(clock=lambda: next(clock), cpu_wait=lambda: next(readings))
    timer.begin_step(0)
    assert timer.finish_step(0).cpu_wait_s is None      # no close before it
    assert timer.finish_step(1).cpu_wait_s == 0.25      # finish_step reads every close
    timer.begin_step(2)
    assert timer.finish_step(2).cpu_wait_s == 0.25
    # the fast path reads only the closes it asks for: step 4's previous close was not read
    record, _ = timer.close_step(3)
    record, _ = timer.close_step(4)
    timer.read_cpu_wait(record)                         # 3.0
    assert timer.stats_of(record, None).cpu_wait_s is None
    record, _ = timer.close_step(5)
    timer.read_cpu_wait(record)                         # 3.5
    assert timer.stats_of(record, None).cpu_wait_s == 0.5
    assert StepTimer(clock=lambda: 0.0).finish_step(0).cpu_wait_s is None


def test_a_reader_without_its_file_gives_none_and_stops_asking(tmp_path):
    reader = ThreadCpuWait(str(tmp_path / "missing"))
    assert reader.read() is None
    assert reader.read() is None


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _busy_child(cpu: int, ready, seconds: float) -> None:
    os.sched_setaffinity(0, {cpu})
    ready.set()
    _spin(seconds)


@contextlib.contextmanager
def _pinned_to_one_cpu():
    before = os.sched_getaffinity(0)
    cpu = min(before)
    os.sched_setaffinity(0, {cpu})
    try:
        yield cpu
    finally:
        os.sched_setaffinity(0, before)


@contextlib.contextmanager
def _contender(cpu: int, seconds: float = 30.0):
    """Another process spinning on ``cpu`` (the host's contention) until the block ends."""
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_busy_child, args=(cpu, ready, seconds), daemon=True)
    child.start()
    try:
        assert ready.wait(10)
        yield
    finally:
        child.kill()
        child.join(10)


@needs_schedstat
def test_the_reader_sees_a_busy_neighbour_and_not_a_sleep():
    reader = ThreadCpuWait()
    with _pinned_to_one_cpu() as cpu:
        start = reader.read()
        time.sleep(0.2)                       # a voluntary wait is no wait for a CPU
        slept = reader.read() - start
        with _contender(cpu):
            start = reader.read()
            _spin(0.4)                        # about half of it on the CPU, half waiting
            contended = reader.read() - start
    assert slept < 0.05
    assert contended > 0.1


WORK_S = 0.01     # a step's CPU work: several scheduler slices, so a shared core doubles it


def _work(cpu_s: float) -> None:
    """``cpu_s`` seconds of this thread's CPU time: a step's work, which takes longer on a
    shared core (a spin to a wall-clock deadline would not)."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def _work_step(guard: StepGuard, step: int, *, sleep_s: float = 0.0) -> list:
    guard.begin_step(step)
    with guard.phase("forward"):
        _work(WORK_S)
        if sleep_s:
            time.sleep(sleep_s)               # a slow device: the thread waits, voluntarily
    return guard.end_step(step)


@needs_schedstat
def test_a_busy_neighbour_is_not_named_a_slow_rank_and_a_slow_device_still_is():
    # One core shared with another spinning process doubles every step for 6 steps: the steps
    # are slow, but the thread waited for the CPU as long as they grew, so no slow-step event
    # (the first is read without the step before it, a quiet one: it counts as slow alone).
    # Five steps slowed by a sleep of three times their work (a slow device) afterwards are
    # named compute.
    guard = StepGuard(GuardConfig())
    events, step = [], 0
    with _pinned_to_one_cpu() as cpu:
        for _ in range(30):
            events += _work_step(guard, step)
            step += 1
        with _contender(cpu):
            for _ in range(6):
                events += _work_step(guard, step)
                step += 1
        contended = [d for d in events if d.action is Action.SLOW_STEP]
        starved = guard.gate.num_host_starved
        for _ in range(10):
            events += _work_step(guard, step)
            step += 1
        for _ in range(5):
            events += _work_step(guard, step, sleep_s=3 * WORK_S)
            step += 1
        guard.feed.flush()
    assert contended == [], [d.reason for d in contended]
    assert starved >= 2
    named = [d for d in events if d.action is Action.SLOW_STEP]
    assert len(named) == 1 and named[0].cause.value == "compute", [d.reason for d in named]


# -- the other ranks of the node -----------------------------------------------------------------

def test_the_board_gives_the_most_another_local_rank_waited_and_worked_in_a_step(tmp_path):
    path = str(tmp_path / "board")
    ranks = [NodeCpuWaits(path, r, 3) for r in range(3)]
    ranks[1].publish(5, 0.25, 0.010)
    ranks[2].publish(5, 0.5)                  # its work not known yet (CUDA events)
    ranks[0].publish(5, 1.0, 0.030)           # rank 0's own figures are not another's
    assert ranks[0].peers_at(5) == (0.5, 0.010)
    assert ranks[1].peers_at(5) == (1.0, 0.030)
    ranks[2].publish_work(5, 0.020)           # the events completed
    assert ranks[0].peers_at(5) == (0.5, 0.020)
    ranks[2].publish_work(4, 0.040)           # no entry of step 4: nothing written
    assert ranks[0].peers_at(4) == (None, None)
    assert ranks[0].peers_at(6) == (None, None)    # nobody published step 6 yet
    ranks[1].publish(5 + RING_STEPS, 0.1)     # the ring moved on past step 5 on rank 1
    assert ranks[2].peers_at(5) == (1.0, 0.030)
    ranks[0].close()
    assert not os.path.exists(path)           # local rank 0 removes the board
    assert ranks[1].peers_at(5) == (1.0, 0.030)    # the others still hold it


def test_an_earlier_groups_entry_for_the_same_step_is_not_read(tmp_path):
    # a crashed attempt (or a finished run) on the same rendezvous port left its file: its
    # entry for step 5 was written before this group's step 5 began, so it is not this one's
    now = [100.0]
    path = str(tmp_path / "board")
    earlier = NodeCpuWaits(path, 1, 2, clock=lambda: now[0])
    earlier.publish(5, 0.75)
    now[0] = 200.0
    rank0, rank1 = NodeCpuWaits(path, 0, 2, clock=lambda: now[0]), \
        NodeCpuWaits(path, 1, 2, clock=lambda: now[0])
    assert rank0.peers_at(5, since_s=150.0) == (None, None)  # rank 1 has not closed step 5
    assert rank0.peers_at(5)[0] == 0.75                # (what an unstamped read would take)
    rank1.publish(5, 0.125)
    assert rank0.peers_at(5, since_s=150.0)[0] == 0.125


def test_a_peer_that_has_not_closed_the_step_yet_gives_its_step_before(tmp_path):
    # rank 0 closed step 5 first (the two closes race): rank 1's step 4, written after rank
    # 0's step 4 began (t=10), stands in for it; an earlier group's step 4 does not
    now = [12.0]
    path = str(tmp_path / "board")
    rank0, rank1 = (NodeCpuWaits(path, r, 2, clock=lambda: now[0]) for r in (0, 1))
    rank1.publish(4, math.nan, 0.030)
    assert rank0.peers_at(5, since_s=20.0, prev_since_s=10.0) == (None, 0.030)
    assert rank0.peers_at(5, since_s=20.0, prev_since_s=13.0) == (None, None)   # stale
    assert rank0.peers_at(5, since_s=20.0) == (None, None)      # no step before asked for
    now[0] = 21.0
    rank1.publish(5, 0.002, 0.020)
    assert rank0.peers_at(5, since_s=20.0, prev_since_s=10.0) == (0.002, 0.020)


def test_a_timer_reads_the_peers_entries_written_since_its_step_began(tmp_path):
    # StepTimer passes the host time its step began: the stale entry above is left out
    now = [10.0]
    path = str(tmp_path / "board")
    stale = NodeCpuWaits(path, 1, 2, clock=lambda: now[0])
    stale.publish(1, 0.5)                              # an earlier group's step 1
    now[0] = 20.0
    board = NodeCpuWaits(path, 0, 2, clock=lambda: now[0])
    timer = StepTimer(clock=lambda: now[0], node_waits=board)
    timer.begin_step(1)
    now[0] = 21.0
    assert timer.finish_step(1).peer_cpu_wait_s is None
    timer.begin_step(2)
    now[0] = 22.0
    NodeCpuWaits(path, 1, 2, clock=lambda: now[0]).publish(2, 0.25)
    assert timer.finish_step(2).peer_cpu_wait_s == 0.25
    board.close()


def test_a_timer_publishes_its_steps_work_for_the_others(tmp_path):
    # local rank 1 closes steps 0 and 1 on the fast path (close_step, then read_cpu_wait):
    # step 1 spent 2 ms in data, 3 in forward, 4 in backward and 1 after it (optimizer), then
    # waited 5 ms in a collective; rank 0's step 1 gets that 10 ms of work as peer_work_s
    now = [0.0]
    path = str(tmp_path / "board")
    boards = [NodeCpuWaits(path, r, 2, clock=lambda: now[0]) for r in (0, 1)]
    waits = iter([0.001, 0.003])
    slow = StepTimer(clock=lambda: now[0], cpu_wait=lambda: next(waits), node_waits=boards[1])
    ours = StepTimer(clock=lambda: now[0], node_waits=boards[0])
    for step in (0, 1):
        ours.begin_step(step)
        slow.begin_step(step)
        for phase, ms in (("data", 2), ("forward", 3), ("backward", 4)):
            now[0] += ms / 1000
            slow.mark(phase)
        now[0] += 0.001
        start = now[0]
        now[0] += 0.005
        slow.record_collective(start, now[0])
        record, _ = slow.close_step(step)
        slow.read_cpu_wait(record)
        stats = ours.finish_step(step)
    assert stats.peer_cpu_wait_s == pytest.approx(0.002)
    assert stats.peer_work_s == pytest.approx(0.010)
    assert slow.stats_of(record, None).comm_wait_s == pytest.approx(0.005)   # built again alike
    for board in boards:
        board.close()


def test_no_board_for_a_rank_alone_on_its_node_or_without_a_group():
    group = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert NodeCpuWaits.for_group(0, 1, group) is None
    assert NodeCpuWaits.for_group(0, 2, {}) is None
    board = NodeCpuWaits.for_group(0, 2, group)
    try:
        assert "10.0.0.1-29500" in board.path
    finally:
        board.close()


def _starved_rank(path: str, cpu: int, ready, go, done) -> None:
    """Local rank 1, pinned to ``cpu``: computes step 7 and publishes its CPU wait."""
    os.sched_setaffinity(0, {cpu})
    board, own = NodeCpuWaits(path, 1, 2), ThreadCpuWait()
    start = own.read()
    ready.set()
    go.wait(10)
    _spin(0.4)
    board.publish(7, own.read() - start)
    done.set()
    time.sleep(5)                             # keep the board open until the parent read it


@needs_schedstat
def test_another_rank_starved_of_cpu_shows_on_the_board(tmp_path):
    # Local rank 1 computes for 0.4 s on a core it shares with a spinning process: about half
    # of that it waits for the CPU, and local rank 0 (this test) reads it from the board.
    path = str(tmp_path / "board")
    board = NodeCpuWaits(path, 0, 2)
    ctx = multiprocessing.get_context("fork")
    ready, go, done = ctx.Event(), ctx.Event(), ctx.Event()
    cpu = min(os.sched_getaffinity(0))
    rank = ctx.Process(target=_starved_rank, args=(path, cpu, ready, go, done), daemon=True)
    rank.start()
    try:
        assert ready.wait(10)
        with _contender(cpu):
            go.set()
            assert done.wait(10)
        waited = board.peers_at(7)[0]
    finally:
        rank.kill()
        rank.join(10)
        board.close()
    assert waited > 0.1


def test_boards_that_no_process_holds_are_swept_by_the_next_local_rank_0(tmp_path):
    # a rank killed before its close leaves its board in /dev/shm; the boards of live groups
    # (held: a shared lock per open board) and files just created stay
    folder, old = str(tmp_path), time.time() - 2 * SWEEP_MIN_AGE_S
    live = NodeCpuWaits(os.path.join(folder, "raytrain_guard-cpuwait-v4-a-1"), 1, 2)
    left = NodeCpuWaits(os.path.join(folder, "raytrain_guard-cpuwait-v4-b-2"), 1, 2)
    left.close()                              # local rank 1: closes without removing
    # v3: an earlier version's board, which its ranks do not lock: never swept
    for name in ("raytrain_guard-cpuwait-v3-c-3", "raytrain_guard-cpuwait-v4-d-4", "other"):
        with open(os.path.join(folder, name), "wb") as fh:
            fh.write(b"\0" * 64)
    for name in os.listdir(folder):
        if not name.endswith("d-4"):          # d-4: created just now, maybe being opened
            os.utime(os.path.join(folder, name), (old, old))
    assert sweep_stale_boards(folder, keep="raytrain_guard-cpuwait-v4-a-1") == 1
    assert sorted(os.listdir(folder)) == ["other", "raytrain_guard-cpuwait-v3-c-3",
                                          "raytrain_guard-cpuwait-v4-a-1",
                                          "raytrain_guard-cpuwait-v4-d-4"]
    assert sweep_stale_boards(folder, keep="mine") == 0      # held by ``live``
    live.close()


def test_a_killed_ranks_board_is_swept_and_a_live_ones_is_not(tmp_path):
    path = str(tmp_path / "raytrain_guard-cpuwait-v4-x-9")
    code = ("import sys, time; from raytrain_guard.runtime.node_cpu_waits import NodeCpuWaits; "
            "b = NodeCpuWaits(sys.argv[1], 1, 2); print('open', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "open"
        old = time.time() - 2 * SWEEP_MIN_AGE_S
        os.utime(path, (old, old))
        assert sweep_stale_boards(str(tmp_path), keep="mine") == 0   # its rank is alive
        proc.kill()
        proc.wait(timeout=30)
        assert sweep_stale_boards(str(tmp_path), keep="mine") == 1
        assert not os.path.exists(path)
    finally:
        proc.kill()
        proc.wait(timeout=30)
