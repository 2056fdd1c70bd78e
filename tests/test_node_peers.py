"""The node's board of per-step work (raytrain_guard.runtime.guard.node_peers): what a rank
reads of the other local ranks, what its timer publishes, and the sweep of boards left by
killed ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from raytrain_guard.runtime.guard.node_peers import (
    RING_STEPS,
    SWEEP_MIN_AGE_S,
    NodePeers,
    sweep_stale_boards,
)
from raytrain_guard.runtime.guard.timing import StepTimer

V = "raytrain_guard-peers-v5"


def test_the_board_gives_the_most_work_another_local_rank_did_in_a_step(tmp_path):
    path = str(tmp_path / "board")
    ranks = [NodePeers(path, r, 3) for r in range(3)]
    ranks[1].publish(5, 0.010)
    ranks[2].publish(5, 0.020)
    ranks[0].publish(5, 0.030)                # rank 0's own work is not another's
    assert ranks[0].peer_work(5) == 0.020
    assert ranks[1].peer_work(5) == 0.030
    assert ranks[0].peer_work(6) is None      # nobody published step 6 yet
    ranks[1].publish(5 + RING_STEPS, 0.1)     # the ring moved on past step 5 on rank 1
    assert ranks[2].peer_work(5) == 0.030
    ranks[0].close()
    assert not os.path.exists(path)           # local rank 0 removes the board
    assert ranks[1].peer_work(5) == 0.030     # the others still hold it
    for board in ranks[1:]:
        board.close()


def test_an_earlier_groups_entry_for_the_same_step_is_not_read(tmp_path):
    # a crashed attempt (or a finished run) on the same rendezvous port left its file: its
    # entry for step 5 was written before this group's step 5 began, so it is not this one's
    now = [100.0]
    path = str(tmp_path / "board")
    earlier = NodePeers(path, 1, 2, clock=lambda: now[0])
    earlier.publish(5, 0.75)
    now[0] = 200.0
    rank0, rank1 = (NodePeers(path, r, 2, clock=lambda: now[0]) for r in (0, 1))
    assert rank0.peer_work(5, since_s=150.0) is None    # rank 1 has not closed step 5
    assert rank0.peer_work(5) == 0.75                   # (what an unstamped read would take)
    rank1.publish(5, 0.125)
    assert rank0.peer_work(5, since_s=150.0) == 0.125
    for board in (earlier, rank1, rank0):
        board.close()


def test_a_peer_that_has_not_closed_the_step_yet_gives_its_step_before(tmp_path):
    # rank 0 closed step 5 first (the two closes race): rank 1's step 4, written after rank
    # 0's step 4 began (t=10), stands in for it; an earlier group's step 4 does not
    now = [12.0]
    path = str(tmp_path / "board")
    rank0, rank1 = (NodePeers(path, r, 2, clock=lambda: now[0]) for r in (0, 1))
    rank1.publish(4, 0.030)
    assert rank0.peer_work(5, since_s=20.0, prev_since_s=10.0) == 0.030
    assert rank0.peer_work(5, since_s=20.0, prev_since_s=13.0) is None     # stale
    assert rank0.peer_work(5, since_s=20.0) is None     # no step before asked for
    now[0] = 21.0
    rank1.publish(5, 0.020)
    assert rank0.peer_work(5, since_s=20.0, prev_since_s=10.0) == 0.020
    rank1.close()
    rank0.close()


def test_a_timer_reads_the_peers_entries_written_since_its_step_began(tmp_path):
    # StepTimer passes the host time its step began: the stale entry above is left out
    now = [10.0]
    path = str(tmp_path / "board")
    stale = NodePeers(path, 1, 2, clock=lambda: now[0])
    stale.publish(1, 0.5)                              # an earlier group's step 1
    now[0] = 20.0
    board = NodePeers(path, 0, 2, clock=lambda: now[0])
    timer = StepTimer(clock=lambda: now[0], peers=board)
    timer.begin_step(1)
    now[0] = 21.0
    assert timer.finish_step(1).peer_work_s is None
    timer.begin_step(2)
    now[0] = 22.0
    stale.publish(2, 0.25)
    assert timer.finish_step(2).peer_work_s == 0.25
    stale.close()
    timer.close()
    assert not os.path.exists(path)                    # the timer closed its board


def test_a_timer_publishes_the_work_of_the_steps_the_gate_may_judge(tmp_path):
    # local rank 1 closes steps on the fast path (close_step, then publish_work for a step
    # over the gate's quiet bound): step 1 spent 2 ms in data, 3 in forward, 4 in backward
    # and 1 after it (optimizer), then waited 5 ms in a collective; rank 0's step 1 gets that
    # 10 ms of work as peer_work_s. A step closed without publish_work leaves nothing there.
    now = [0.0]
    path = str(tmp_path / "board")
    boards = [NodePeers(path, r, 2, clock=lambda: now[0]) for r in (0, 1)]
    slow = StepTimer(clock=lambda: now[0], peers=boards[1])
    ours = StepTimer(clock=lambda: now[0], peers=boards[0])
    for step in (0, 1, 2):
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
        if step < 2:
            slow.publish_work(record)
        stats = ours.finish_step(step)
        if step == 1:
            assert stats.peer_work_s == pytest.approx(0.010)
            assert slow.stats_of(record, None).comm_wait_s == pytest.approx(0.005)
    assert stats.step == 2 and stats.peer_work_s == pytest.approx(0.010)   # its step 1
    for board in boards:
        board.close()


def test_no_board_for_a_rank_alone_on_its_node_or_without_a_group():
    group = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert NodePeers.for_group(0, 1, group) is None
    assert NodePeers.for_group(0, 2, {}) is None
    board = NodePeers.for_group(0, 2, group)
    try:
        assert "10.0.0.1-29500" in board.path
    finally:
        board.close()


def test_boards_that_no_process_holds_are_swept_by_the_next_local_rank_0(tmp_path):
    # a rank killed before its close leaves its board in /dev/shm; the boards of live groups
    # (held: a shared lock per open board) and files just created stay
    folder, old = str(tmp_path), time.time() - 2 * SWEEP_MIN_AGE_S
    live = NodePeers(os.path.join(folder, f"{V}-a-1"), 1, 2)
    left = NodePeers(os.path.join(folder, f"{V}-b-2"), 1, 2)
    left.close()                              # local rank 1: closes without removing
    # v4: another version's board (another layout): never swept
    for name in ("raytrain_guard-peers-v4-c-3", f"{V}-d-4", "other"):
        with open(os.path.join(folder, name), "wb") as fh:
            fh.write(b"\0" * 64)
    for name in os.listdir(folder):
        if not name.endswith("d-4"):          # d-4: created just now, maybe being opened
            os.utime(os.path.join(folder, name), (old, old))
    assert sweep_stale_boards(folder, keep=f"{V}-a-1") == 1
    assert sorted(os.listdir(folder)) == ["other", "raytrain_guard-peers-v4-c-3",
                                          f"{V}-a-1", f"{V}-d-4"]
    assert sweep_stale_boards(folder, keep="mine") == 0      # held by ``live``
    live.close()


def test_a_killed_ranks_board_is_swept_and_a_live_ones_is_not(tmp_path):
    path = str(tmp_path / f"{V}-x-9")
    code = ("import sys, time; from raytrain_guard.runtime.guard.node_peers import NodePeers; "
            "b = NodePeers(sys.argv[1], 1, 2); print('open', flush=True); time.sleep(120)")
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
