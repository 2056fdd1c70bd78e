"""Naming the hung rank: the pure rule (core.hang), the coordinator collecting the watchdogs'
records per attempt, what status, the status page and the run summary say, the watchdog's
look at the watched thread, and the bounded send from a dying rank."""

from __future__ import annotations

import json
import threading
import time

import pytest

from raytrain_guard.cluster.coordinator.coordinator import Coordinator
from raytrain_guard.cluster.status import format_status
from raytrain_guard.cluster.summary import summarize
from raytrain_guard.config import GuardConfig
from raytrain_guard.coordination.client import ClusterDecisionSource, send_hang_record
from raytrain_guard.core.hang import SETTLE_S, HangRecord, name_hung_rank
from raytrain_guard.core.steps import StepStats
from raytrain_guard.runtime.guard.watchdog import thread_position
from raytrain_guard.runtime.loop.hang import HangExit
from raytrain_guard.runtime.loop.recorder import RunRecorder

WALL = 1_700_000_000.0      # the step began here on every rank


def rec(rank, phase, *, step=40, progress=0.0, coll=None, world=None, node="") -> HangRecord:
    """Rank ``rank`` in ``phase`` of ``step`` since ``WALL + progress`` (its last progress);
    watchdogs fire 10.5 s after the step began."""
    return HangRecord(world_rank=rank, step=step, phase=phase, phase_for_s=10.5 - progress,
                      step_for_s=10.5, last_progress_wall=WALL + progress, node_id=node,
                      world_size=world, in_collective=coll)


# -- the rule ----------------------------------------------------------------------------------

def test_ddp_the_rank_stuck_in_forward_while_the_others_wait_in_backward():
    # rank 1 blocks before its forward (0.002 s into the step); ranks 0 and 2 run forward and
    # backward and wait in DDP's all-reduce (its wait runs in the autograd engine: no
    # torch.distributed frame, the phase tells)
    v = name_hung_rank([rec(0, "backward", progress=0.03), rec(1, "forward", progress=0.002),
                        rec(2, "backward", progress=0.031)], range(3))
    assert (v.world_rank, v.phase, v.step, v.basis, v.settled) == (1, "forward", 40,
                                                                    "earliest_phase", True)
    assert v.reason.startswith("rank 1 is the hung rank: stuck in forward of step 40 for 10.5 s")
    assert "rank 0 in backward of step 40" in v.reason and "rank 2 in backward" in v.reason


def test_fsdp_every_rank_in_forward_the_one_outside_torch_distributed_is_named():
    # FSDP: the waiting ranks block in forward too, in the all-gather of the next unit, and
    # they entered forward later than the hung rank only by milliseconds: the stack tells
    v = name_hung_rank([rec(0, "forward", progress=0.001, coll=True),
                        rec(1, "forward", progress=0.004, coll=False),
                        rec(2, "forward", progress=0.002, coll=True)])
    assert (v.world_rank, v.basis, v.suspects) == (1, "not_in_collective", (1,))
    assert "not inside torch.distributed" in v.reason


def test_a_rank_that_never_reported_while_all_others_wait_is_named_once_settled():
    waiting = [rec(0, "backward", world=3, coll=False), rec(2, "forward", world=3, coll=True)]
    early = name_hung_rank(waiting, waited_s=1.0, nodes={1: "b" * 56})
    assert early.world_rank == 1 and early.basis == "silent" and not early.settled
    assert "provisional" in early.reason
    late = name_hung_rank(waiting, waited_s=SETTLE_S, nodes={1: "b" * 56})
    assert (late.world_rank, late.node_id, late.silent, late.settled) == (1, "b" * 56, (1,), True)
    assert late.reason.startswith("rank 1 (node bbbbbbbb...) is the hung rank: it never reported")
    # two silent ranks: cannot tell which one the others wait for
    two = name_hung_rank([rec(0, "backward", world=4), rec(3, "backward", world=4)],
                         waited_s=10.0)
    assert two.world_rank is None and two.suspects == (1, 2)


def test_a_silent_rank_is_not_blamed_when_a_reporter_itself_looks_stuck():
    # the hung rank 1 reported and exited first; rank 0's collective then failed, so it never
    # reported: rank 0's silence is no evidence, rank 1 is in forward, not waiting
    v = name_hung_rank([rec(1, "forward", world=2, coll=False)], waited_s=SETTLE_S)
    assert (v.world_rank, v.basis, v.silent) == (1, "only_report", (0,))
    assert "rank(s) [0] did not report" in v.reason


def test_ties_name_no_rank_and_a_clear_gap_names_the_earliest():
    tie = name_hung_rank([rec(0, "forward", progress=0.010), rec(1, "forward", progress=0.030)])
    assert (tie.world_rank, tie.basis, tie.suspects) == (None, "tie", (0, 1))
    assert tie.reason.startswith("cannot tell which rank hung: ranks [0, 1]")
    gap = name_hung_rank([rec(0, "forward", progress=2.0), rec(1, "forward", progress=0.5)])
    assert (gap.world_rank, gap.basis) == (1, "earliest_progress")


def test_a_rank_hung_in_its_optimizer_while_the_others_went_on_to_the_next_step():
    v = name_hung_rank([rec(0, "backward", step=41), rec(1, "optimizer", step=40)])
    assert (v.world_rank, v.step, v.basis) == (1, 40, "earliest_step")


def test_no_records_no_verdict_and_a_bad_record_names_its_field():
    assert name_hung_rank([]) is None
    with pytest.raises(ValueError, match="phase_for_s"):
        HangRecord.from_dict({"world_rank": 0, "step": 1, "phase": "forward",
                              "phase_for_s": float("nan"), "step_for_s": 1.0,
                              "last_progress_wall": WALL})
    with pytest.raises(ValueError, match=r"hang record step: must be an integer >= 0 \(got -1"):
        HangRecord.from_dict({"world_rank": 0, "step": -1, "phase": "forward",
                              "phase_for_s": 1.0, "step_for_s": 1.0,
                              "last_progress_wall": WALL})


# -- the coordinator (plain class) -------------------------------------------------------------

class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class Counted:
    """The metrics seam: what the coordinator counts."""

    def __init__(self):
        self.hangs = []

    def record_hang(self, verdict):
        self.hangs.append(verdict)


def _steps(rank):
    return [StepStats(step=s, total_s=0.01, world_rank=rank).to_dict() for s in range(10)]


def _record(rank, phase, progress, node):
    return {"world_rank": rank, "node_id": node, "step": 40, "world_size": 2, "phase": phase,
            "phase_for_s": 10.5 - progress, "step_for_s": 10.5,
            "last_progress_wall": WALL + progress, "in_collective": False,
            "where": "torch/autograd/graph.py:824 _engine_run_backward" if phase == "backward"
            else "threading.py:355 wait", "reason": "..."}


def test_the_coordinator_names_the_hung_rank_per_attempt_in_status_page_and_summary():
    clock, counted = Clock(), Counted()
    c = Coordinator("run1", GuardConfig(decision_interval_s=1e9), clock=clock, metrics=counted)
    attempt = c.next_attempt()
    for rank in (0, 1):
        c.report_steps(rank, f"node{rank}", attempt, _steps(rank))
    first = c.report_hang(0, "node0", attempt, _record(0, "backward", 0.03, "node0"))
    # rank 0 alone so far: rank 1 is silent, provisional, not counted yet
    assert first["world_rank"] == 1 and not first["settled"] and counted.hangs == []
    clock.t += 0.4
    verdict = c.report_hang(1, "node1", attempt, _record(1, "forward", 0.002, "node1"))
    assert (verdict["attempt"], verdict["world_rank"], verdict["node_id"], verdict["phase"],
            verdict["basis"], verdict["settled"]) == (attempt, 1, "node1", "forward",
                                                      "earliest_phase", True)
    assert [v.world_rank for v in counted.hangs] == [1]            # counted once

    c.next_attempt()                                                # the group restarts
    status = c.status()
    assert len(status["hangs"]) == 1 and len(counted.hangs) == 1
    hang = status["hangs"][0]
    assert hang["attempt"] == attempt and hang["world_rank"] == 1
    assert [r["phase"] for r in hang["records"]] == ["backward", "forward"]
    json.dumps(status)                                              # as the actor returns it

    page = format_status({"coordinator": "raytrain_guard:coordinator:run1", **status})
    assert f"hang in attempt {attempt}: rank 1 (node node1) is the hung rank" in page
    summary = summarize("run1", {"step": 60, "total_steps": 60, "world_size": 2}, status, 30.0)
    assert any(d.startswith(f"hang in attempt {attempt}: rank 1") for d in summary.detections)


def test_a_silent_rank_is_named_with_its_node_from_its_step_reports_once_settled():
    clock = Clock()
    c = Coordinator("run1", GuardConfig(decision_interval_s=1e9), clock=clock)
    attempt = c.next_attempt()
    for rank in (0, 1):
        c.report_steps(rank, f"node{rank}", attempt, _steps(rank))
    c.report_hang(0, "node0", attempt, _record(0, "backward", 0.03, "node0"))
    assert not c.status()["hangs"][0]["settled"]
    clock.t += SETTLE_S
    hang = c.status()["hangs"][0]
    assert (hang["world_rank"], hang["node_id"], hang["basis"], hang["settled"]) == \
        (1, "node1", "silent", True)


def test_a_malformed_hang_record_is_counted_and_ignored():
    c = Coordinator("run1", GuardConfig(decision_interval_s=1e9), clock=Clock())
    assert c.report_hang(0, "n0", 0, {"step": "forty"}) is None
    assert c.ignored["malformed"] == 1 and c.status()["hangs"] == []


# -- the rank's side ---------------------------------------------------------------------------

def test_the_watchdog_sees_whether_the_watched_thread_is_inside_torch_distributed():
    import torch.distributed as dist
    from torch.distributed.elastic.utils.store import barrier

    # a two-member barrier of torch.distributed that one thread enters alone: it blocks
    # inside torch.distributed until the second member (this test) arrives
    store, idle = dist.HashStore(), threading.Event()
    threads = [threading.Thread(target=barrier, args=(store, 2, "hang"),
                                kwargs={"barrier_timeout": 30}, daemon=True),
               threading.Thread(target=idle.wait, args=(30,), daemon=True)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10          # they get there in ms; a busy box may take longer
    while time.monotonic() < deadline and not (
            thread_position(threads[0].ident)[0] and thread_position(threads[1].ident)[1]
            .endswith(" wait")):
        time.sleep(0.01)
    in_dist, where = thread_position(threads[0].ident)
    assert in_dist is True and where.startswith("torch/distributed/"), where
    in_dist, where = thread_position(threads[1].ident)
    assert in_dist is False and "threading.py:" in where and where.endswith(" wait"), where
    barrier(store, 2, "hang", barrier_timeout=30)
    idle.set()
    for t in threads:
        t.join(5)
    assert thread_position(threads[0].ident) == (None, "")           # the thread is gone


def test_a_dead_or_slow_coordinator_holds_the_rank_at_most_the_timeout():
    def lookup_hangs(name, namespace):
        time.sleep(30)

    started = time.monotonic()
    assert send_hang_record("c", "ns", 1, "n1", 1, {"step": 40}, timeout_s=0.5,
                            lookup=lookup_hangs) is None
    assert time.monotonic() - started < 1.5

    class Gone:                 # the handle of a coordinator that died
        class report_hang:      # the actor method's name
            @staticmethod
            def remote(*args):
                raise RuntimeError("actor died")

    started = time.monotonic()
    assert send_hang_record("c", "ns", 1, "n1", 1, {}, handle=Gone(), timeout_s=5) is None
    assert time.monotonic() - started < 1.0
    # before the source started (no coordinator known): nothing to send
    assert ClusterDecisionSource("run1", "ns").report_hang({"step": 1}) is None


def _traced(tmp_path, source):
    """The loop's hang handler (observing: it does not end the process) and its trace."""
    recorder = RunRecorder(trace_dir=str(tmp_path), audit_dir=None, world_rank=1)
    recorder.open()
    return HangExit(recorder, source=source, act=False), tmp_path / "rank1.jsonl"


def test_the_loops_hang_handler_sends_the_record_and_traces_the_verdict(tmp_path):
    sent = []

    class Source:
        def report_hang(self, record):
            sent.append(record)
            return {"attempt": 1, "world_rank": 1, "reason": "rank 1 is the hung rank"}

    on_hang, trace = _traced(tmp_path / "a", Source())
    record = {"world_rank": 1, "step": 40, "phase": "forward", "reason": "rank 1 ... hang"}
    on_hang(record)
    assert sent == [record]
    kinds = [json.loads(line)["t"] for line in trace.read_text().splitlines()]
    assert kinds == ["hang", "hang_verdict"]

    class Broken:
        def report_hang(self, record):
            raise RuntimeError("no coordinator")

    on_hang, trace = _traced(tmp_path / "b", Broken())
    on_hang(record)                         # fail open: written down all the same
    assert [json.loads(x)["t"] for x in trace.read_text().splitlines()] == ["hang"]


def test_the_experiments_analysis_names_the_hung_rank_by_the_coordinators_rule():
    from raytrain_guard.experiment.analysis import _hang_detections

    def record(rank, phase, progress, **extra):
        return {"t": "hang", "_try": 0, "wall": 1010.0, "world_rank": rank, "step": 40,
                "phase": phase, "phase_for_s": 10.0, "step_for_s": 10.5,
                "last_progress_wall": progress, "node_id": "n0", "world_size": 2, **extra}

    hangs = [record(0, "backward", 1000.2), record(1, "forward", 1000.0)]
    (d,) = _hang_detections(hangs, [{"wall": 1015.0}])
    assert (d["rank"], d["phase"], d["step"]) == (1, "forward", 40)
    assert "rank 1" in d["reason"] and "hung rank" in d["reason"]
    assert d["seconds_to_restart"] == pytest.approx(15.5)
    # a tie names nobody
    assert _hang_detections([record(0, "forward", 1000.0), record(1, "forward", 1000.01)],
                            []) == []
