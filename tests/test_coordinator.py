"""Coordinator as a plain class: report validation, policy rounds, decisions_since, status."""

from __future__ import annotations

import logging

import pytest

from raytrain_guard.cluster.coordinator.coordinator import Coordinator
from raytrain_guard.config import GuardConfig
from raytrain_guard.core.node_samples import GpuSample, HostSample, NodeSample
from raytrain_guard.core.steps import StepStats
from raytrain_guard.units import GiB


class Clock:
    def __init__(self, t=0.0):
        self.t = t

    def __call__(self):
        return self.t


def batch(rank, first, n=10, *, compute=0.5, comm=0.45, data=0.05, mem=None):
    return [StepStats(step=s, total_s=data + compute + comm, data_wait_s=data, forward_s=compute,
                      comm_wait_s=comm, memory_frac=mem, world_rank=rank).to_dict()
            for s in range(first, first + n)]


def coordinator(clock=None, **kw):
    # decision_interval_s=1e9: rounds only when the test calls decide()
    cfg = GuardConfig(decision_interval_s=1e9, **kw)
    return Coordinator("run1", cfg, clock=clock or Clock(), wall_clock=lambda: 1000.0)


def sample(node, seq, *, epoch="e1", mem_frac=None):
    gpus = () if mem_frac is None else (GpuSample(0, int(mem_frac * 100), 100),)
    return NodeSample(node, seq, epoch, 0.0, HostSample(64 * GiB, 32 * GiB), gpus).to_dict()


REJECTED = [
    # name, arguments of report_steps after a first good batch of steps 1-10 from rank 0
    ("duplicate", (0, "n0", 0, batch(0, 1))),
    ("out_of_order", (0, "n0", 0, batch(0, 5))),                 # steps 5-14 overlap 1-10
    ("stale", (0, "n0", -1, batch(0, 11))),                      # attempt -1 < 0
    ("malformed", (0, "n0", 0, [{"step": 11}])),                 # no total_s
    ("malformed", (0, "n0", 0, [{"step": 11, "total_s": float("nan")}])),
    ("malformed", (0, "n0", 0, batch(0, 11, mem="high"))),
    ("malformed", (0, "n0", 0, batch(0, 11, data=True))),        # a bool is no figure
    ("malformed", (0, "n0", 0, batch(0, 11, comm=float("inf")))),
    ("malformed", (0, "n0", 0, batch(0, 11, compute=-0.1))),
    ("malformed", (0, "n0", 0, batch(0, 11)[::-1])),             # steps decreasing
    ("malformed", ("zero", "n0", 0, batch(0, 11))),
    ("malformed", (0, "", 0, batch(0, 11))),
    ("malformed", (0, "n0", 0, [])),
    ("malformed", (0, "n0", 0, "not a list of dicts")),
    ("malformed", (0, "n0", 0, batch(0, 11), {"micro_batch": 0})),
]


@pytest.mark.parametrize("reason,args", REJECTED, ids=[f"{r}-{i}" for i, (r, _) in
                                                       enumerate(REJECTED)])
def test_bad_reports_are_counted_and_ignored(reason, args):
    c = coordinator()
    c.report_steps(0, "n0", 0, batch(0, 1))
    c.report_steps(*args)
    st = c.status()
    assert st["ignored"] == {"stale": 0, "duplicate": 0, "out_of_order": 0, "malformed": 0,
                             reason: 1}
    assert st["ranks"][0]["step"] == 10 and st["num_reports"] == 1
    c.report_steps(0, "n0", 0, batch(0, 11))      # the next good batch is still accepted
    assert c.status()["ranks"][0]["step"] == 20


def test_newer_attempt_clears_ranks_and_older_is_stale():
    c = coordinator()
    c.report_steps(0, "n0", 0, batch(0, 1))
    c.report_steps(1, "n0", 0, batch(1, 1))
    c.report_steps(0, "n0", 1, batch(0, 1))       # the run restarted from step 1
    st = c.status()
    assert st["attempt"] == 1 and list(st["ranks"]) == [0]
    c.report_steps(1, "n0", 0, batch(1, 11))      # rank 1 of the old attempt: stale
    assert c.status()["ignored"]["stale"] == 1


def test_names_the_straggler_rank_from_step_stats():
    c = coordinator()
    for first in (1, 11):
        c.report_steps(0, "n0", 0, batch(0, first))
        c.report_steps(1, "n0", 0, batch(1, first))
        c.report_steps(2, "n1", 0, batch(2, first))
        c.report_steps(3, "n1", 0, batch(3, first, compute=0.9, comm=0.05))   # slow compute
    (d,) = c.decide()
    # rank 3 adds (0.9 - 0.5) / 1.0 = 40 % of a step; latest 20 -> applies at 40
    assert (d["action"], d["scope"], d["cause"], d["step"]) == \
        ("flag_straggler", "node:n1", "compute", 40)
    assert d["params"]["world_ranks"] == [3] and d["decision_id"] == 1000 * 10**6 + 1
    # rank 2 shares n1 and is healthy: the rank is named, not its node (issue 11)
    assert d["params"]["target"] == "rank" and d["params"]["recommendation"] == "check_gpu"
    st = c.status()
    assert st["straggler_ranks"] == [3] and st["straggler_nodes"] == []
    assert st["ranks"][3]["straggler_score"] == 0.4 and st["ranks"][3]["straggler_cause"] == \
        "compute"
    assert st["ranks"][0]["straggler_score"] == 0.0
    assert c.decide() == []                        # flagged once


def test_memory_pressure_from_reports_and_nvml_samples():
    c = coordinator()
    c.report_steps(0, "n0", 0, batch(0, 1, mem=0.5))
    c.report_node(sample("n0", 1, mem_frac=0.93))
    (d,) = c.decide(next_apply_step=30)
    assert (d["action"], d["step"], d["scope"]) == ("release_cache", 30, "cluster")
    assert "node n0 GPU 0 at 93%" in d["reason"]
    assert c.status()["nodes"]["n0"]["gpus"][0]["memory_frac"] == 0.93


def test_decisions_since_and_ids_that_grow_across_restarts():
    c = coordinator()
    c.report_steps(0, "n0", 0, batch(0, 1, mem=0.89))
    first = c.decide()
    assert [d["action"] for d in first] == ["release_cache"]
    cursor = first[0]["decision_id"]
    assert c.decisions_since(0) == first and c.decisions_since(cursor) == []
    # a restarted coordinator (later wall clock) rebuilds from new reports; its ids are larger
    again = Coordinator("run1", GuardConfig(decision_interval_s=1e9), clock=Clock(),
                        wall_clock=lambda: 1001.0)
    again.report_steps(0, "n0", 0, batch(0, 11, mem=0.89))
    (d,) = again.decide()
    assert d["decision_id"] > cursor and again.decisions_since(cursor) == [d]


def test_node_samples_duplicate_out_of_order_new_epoch_and_ageing():
    clock = Clock()
    c = coordinator(clock)
    c.report_node(sample("n0", 5))
    c.report_node(sample("n0", 5))                  # duplicate
    c.report_node(sample("n0", 4))                  # out of order
    c.report_node(sample("n0", 1, epoch="e2"))      # a restarted monitor: accepted
    c.report_node({"node_id": "n0"})                # malformed
    c.report_node(sample("n1", 1, mem_frac=0.93))
    assert c.status()["ignored"] == {"stale": 0, "duplicate": 1, "out_of_order": 1,
                                     "malformed": 1}
    assert c.status()["num_node_samples"] == 3
    c.report_steps(0, "n1", 0, batch(0, 1))         # n1 runs a rank: its GPUs count
    # n1's sample is 10 monitor intervals old: it no longer drives decisions
    clock.t = 10.5
    assert c.decide(next_apply_step=10) == []
    clock.t = 0.0
    assert [d["action"] for d in c.decide(next_apply_step=10)] == ["release_cache"]


def host_sample(node, seq, time_s, used_frac, *, epoch="e1"):
    total = 64 * GiB
    return NodeSample(node, seq, epoch, time_s,
                      HostSample(total, round((1 - used_frac) * total))).to_dict()


def test_a_nodes_host_leak_across_samples_stops_the_run_before_the_line():
    c = coordinator()
    for r in (0, 1):
        c.report_steps(r, "n1", 0, batch(r, 1))          # 1.0 s steps, latest 10
    # a monitor restart: its readings start over, so 0.30 at t=50 is no part of the line
    c.report_node(host_sample("n1", 7, 50.0, 0.30, epoch="e0"))
    c.report_node(host_sample("n1", 1, 100.0, 0.88))
    c.report_node(host_sample("n1", 2, 101.0, 0.90))
    assert c.decide(next_apply_step=30) == []           # two readings: no trend yet
    c.report_node(host_sample("n1", 3, 102.0, 0.92))
    # 2 % a second past the watermark; a stop decided next round lands within 1 + 1 +
    # (30 - 10) x 1.0 s = 22 s, and 93 % is 0.5 s away
    (d,) = c.decide(next_apply_step=30)
    assert (d["action"], d["cause"], d["step"]) == ("checkpoint_and_stop", "host_memory", 30)
    assert d["params"]["rise_per_s"] == pytest.approx(0.02) and "in 0.5 s" in d["reason"]


def test_rounds_run_by_themselves_at_the_decision_interval():
    clock = Clock(100.0)
    c = Coordinator("run1", GuardConfig(decision_interval_s=1.0), clock=clock)
    c.report_steps(0, "n0", 0, batch(0, 1))
    assert c.status()["num_rounds"] == 0           # within one interval of the start
    clock.t = 101.0
    c.report_steps(0, "n0", 0, batch(0, 11))
    assert c.status()["num_rounds"] == 1           # one interval later: a round
    c.report_steps(0, "n0", 0, batch(0, 21, mem=0.9))
    assert c.status()["num_rounds"] == 1           # same instant: no new round
    clock.t = 102.0
    c.report_node(sample("n0", 1))                 # node samples trigger rounds too
    assert c.status()["num_rounds"] == 2
    assert [d["action"] for d in c.decisions_since(0)] == ["release_cache"]


def test_a_failing_policy_round_does_not_stop_reports(caplog):
    def broken_rule(latest, config):
        raise RuntimeError("bug in the apply-step rule")
    clock = Clock()
    c = Coordinator("run1", GuardConfig(decision_interval_s=0.0), apply_step_rule=broken_rule,
                    clock=clock)
    clock.t = 1.0
    with caplog.at_level(logging.WARNING):
        for first in (1, 11, 21):
            c.report_steps(0, "n0", 0, batch(0, first))
    assert c.status()["ranks"][0]["step"] == 30
    assert sum("policy round failed" in r.getMessage() for r in caplog.records) == 1


def test_status_figures():
    c = coordinator()
    # rank 0: 1.0 s steps; rank 1: steps 1..10 take 1.0 s except step 10 takes 3.0 s
    c.report_steps(0, "n0", 0, batch(0, 1, mem=0.5))
    slow = batch(1, 1, mem=0.6)
    slow[-1]["total_s"] = 3.0
    c.report_steps(1, "n1", 0, slow, {"micro_batch": 8, "grad_accum": 1, "prefetch_factor": 2})
    c.report_node(sample("n1", 1))
    st = c.status()
    # 20 totals: 19 x 1.0 and 1 x 3.0 -> nearest-rank p50 = 10th = 1.0, p99 = 20th = 3.0
    assert (st["step_p50_s"], st["step_p99_s"]) == (1.0, 3.0)
    assert st["latest_step"] == 10 and st["run_id"] == "run1"
    assert st["ranks"][1] == {"world_rank": 1, "node_id": "n1", "step": 10, "step_p50_s": 1.0,
                              "step_p99_s": 3.0, "memory_frac": 0.6, "straggler_score": None,
                              "straggler_cause": None}
    assert st["nodes"]["n1"]["host"]["memory_used_frac"] == 0.5
    assert st["nodes"]["n1"]["throttled"] is False
    assert set(st) >= {"nodes", "ranks", "straggler_scores", "active_decisions", "ignored"}


def test_window_memory_is_bounded():
    c = coordinator(step_window=20)
    for first in range(1, 1001, 10):
        c.report_steps(0, "n0", 0, batch(0, first))
    assert len(c._ranks[0].columns) == 20 and len(c._ranks[0].batches) <= 8


def test_attempts_are_issued_without_clocks_and_adopted_after_a_restart():
    c = coordinator()
    assert c.next_attempt() == 1                   # rank 0 of the first group asks
    c.report_steps(0, "n0", 1, batch(0, 1))
    assert c.next_attempt() == 2                   # the group restarted: rank state cleared
    assert c.status()["ranks"] == {}
    c.report_steps(0, "n0", 1, batch(0, 11))       # a late report of the dead group: stale
    c.report_steps(0, "n0", 2, batch(0, 1))
    assert c.status()["ignored"]["stale"] == 1 and list(c.status()["ranks"]) == [0]
    # the coordinator restarts (persists nothing): it adopts the attempt the reports carry...
    again = coordinator()
    again.report_steps(0, "n0", 2, batch(0, 11))
    assert again.status()["attempt"] == 2 and again.status()["ignored"]["stale"] == 0
    # ...and the next group gets a larger number than any seen, whatever the clocks say
    assert again.next_attempt() == 3
    # once it issued one, a larger attempt it did not issue is from before its restart: stale
    again.report_steps(0, "n0", 7, batch(0, 21))
    again.report_steps(0, "n0", 3, batch(0, 1))
    st = again.status()
    assert st["attempt"] == 3 and st["ignored"]["stale"] == 1 and st["ranks"][0]["step"] == 10


def test_reports_as_rows_in_step_field_order():
    from raytrain_guard.coordination.client import STEP_FIELDS, step_row
    s = StepStats(step=4, total_s=1.0, data_wait_s=0.1, forward_s=0.2, backward_s=0.3,
                  comm_wait_s=0.15, optimizer_s=0.05, memory_frac=0.5, world_rank=1)
    assert step_row(s) == tuple(getattr(s, f) for f in STEP_FIELDS)   # the client's row order
    c = coordinator()
    c.report_steps(1, "n0", 0, [step_row(s)])
    c.report_steps(1, "n0", 0, [(5, 1.0)])                         # a short row: malformed
    st = c.status()
    assert st["ranks"][1]["step"] == 4 and st["ranks"][1]["memory_frac"] == 0.5
    assert st["ignored"]["malformed"] == 1


def test_a_restarted_coordinator_with_a_clock_behind_still_makes_newer_decision_ids():
    c = coordinator()                              # wall clock 1000 s
    c.report_steps(0, "n0", 0, batch(0, 1, mem=0.89))
    (first,) = c.decide()
    cursor = first["decision_id"]
    # restarted on a node whose clock is an hour behind: ids would start far below the cursor
    again = Coordinator("run1", GuardConfig(decision_interval_s=1e9), clock=Clock(),
                        wall_clock=lambda: 1000.0 - 3600)
    again.report_steps(0, "n0", 0, batch(0, 11, mem=0.89), None, cursor)
    (d,) = again.decide()
    assert d["decision_id"] == cursor + 1 and again.decisions_since(cursor) == [d]


# -- effects: measured after the apply step, escalation when an action missed (issue 11) --------

CARD = 80 * GiB


def setup_with_cache(mem, cached_gib, mb=2, ga=1):
    reserved = int(mem * CARD)
    return {"micro_batch": mb, "grad_accum": ga, "prefetch_factor": 2, "device": "cuda",
            "allocated_bytes": reserved - int(cached_gib * GiB), "reserved_bytes": reserved,
            "device_total_bytes": CARD}


def report(c, first, mem, cached_gib=8.0, applied=None):
    """Steps first..first+9 of both ranks; ``applied``: (step, decision id) their lockstep
    applied since the last report."""
    c.report_steps(0, "n0", 0, batch(0, first, mem=0.5), setup_with_cache(0.5, 1.0),
                   applied=applied)
    c.report_steps(1, "n0", 0, batch(1, first, mem=mem), setup_with_cache(mem, cached_gib),
                   applied=applied)


def test_a_release_that_missed_is_measured_stored_and_not_repeated():
    c = coordinator()
    report(c, 1, 0.89)
    (d,) = c.decide(next_apply_step=20)
    # 8 GiB cached of 80: predicted 0.89 -> 0.79
    assert d["action"] == "release_cache" and d["predicted"]["delta_frac"] == -0.1
    assert d["measured"] is None
    for first in (11, 21, 31):                      # the reading stays at 0.89 (steady)
        report(c, first, 0.89, applied=[(20, d["decision_id"])] if first == 21 else None)
    assert c.decide(next_apply_step=60) == []       # measured over steps 21-40: missed
    (m,) = c.decisions_since(0)
    assert m["measured"]["verdict"] == "miss"
    assert m["measured"]["memory_frac_before"] == 0.89 and m["measured"]["delta_frac"] == 0.0
    assert m["measured"]["num_steps_after"] == 40   # 2 ranks x steps 21..40
    st = c.status()
    assert st["missed"] == ["release_cache:device_memory"] and st["effects"] == [m]
    # at critical, the policy escalates past the release: without a plan, today's ladder
    # (an unpriced shrink, the release having been judged)
    report(c, 41, 0.91)
    (shrink,) = c.decide(next_apply_step=70)
    assert shrink["action"] == "shrink_micro_batch" and shrink["predicted"] is None
    assert "unpriced" in shrink["reason"]


def test_a_release_that_worked_may_be_decided_again():
    c = coordinator()
    report(c, 1, 0.89)
    (d,) = c.decide(next_apply_step=20)
    report(c, 11, 0.89)
    for first in (21, 31):                          # fell 0.09 of a predicted 0.10
        report(c, first, 0.80, applied=[(20, d["decision_id"])] if first == 21 else None)
    assert c.decide(next_apply_step=60) == []
    (m,) = c.decisions_since(0)
    assert m["measured"]["verdict"] == "hit" and m["measured"]["delta_frac"] == -0.09
    report(c, 41, 0.89)                             # climbed back, cache to free again
    assert [d["action"] for d in c.decide(next_apply_step=70)] == ["release_cache"]


def test_an_effect_is_measured_from_the_step_the_ranks_applied_it_at():
    # decided for step 20, delivered late: the lockstep applied it at the agreement at 30.
    # Measured from 20 it would read steps 21-40, half of them before it took effect
    c = coordinator()
    report(c, 1, 0.89)
    (d,) = c.decide(next_apply_step=20)
    report(c, 11, 0.89)
    report(c, 21, 0.89)                              # not applied yet: nothing measured
    assert c.decide(next_apply_step=60) == [] and c.decisions_since(0)[0]["measured"] is None
    report(c, 31, 0.80, applied=[(30, d["decision_id"])])
    # the cooldown counts from 30 too: at latest step 40 the release is still cooling
    assert c._state.last_release_step == 30
    report(c, 41, 0.80)
    assert c.decide(next_apply_step=60) == []
    (m,) = c.decisions_since(0)
    assert m["measured"]["applied_at"] == 30 and m["measured"]["verdict"] == "hit"
    assert m["measured"]["delta_frac"] == pytest.approx(-0.09)
    assert m["measured"]["num_steps_after"] == 40    # 2 ranks x steps 31..50


def test_a_release_without_prediction_is_not_judged_and_does_not_rearm():
    # no allocator figures reported: the release is unpriced, once until memory falls under
    # the re-arm line. Measured, it is neither a hit nor a miss, and re-arms nothing
    c = coordinator()
    cuda = {"micro_batch": 2, "grad_accum": 1, "device": "cuda"}

    def unpriced_report(first, applied=None):
        for rank in (0, 1):
            c.report_steps(rank, "n0", 0, batch(rank, first, mem=0.89), cuda, applied=applied)

    unpriced_report(1)
    (d,) = c.decide(next_apply_step=20)
    assert d["action"] == "release_cache" and d["predicted"] is None
    for first in (11, 21, 31):                      # fell 0.09, with nothing to hold it to
        unpriced_report(first, applied=[(20, d["decision_id"])] if first == 21 else None)
    assert c.decide(next_apply_step=60) == []
    (m,) = c.decisions_since(0)
    assert m["measured"]["verdict"] == "not_judged" and "missed" not in m["measured"]
    assert c.status()["missed"] == [] and c._state.release_armed is False
    unpriced_report(41)                             # still over the re-arm line: not again
    assert c.decide(next_apply_step=70) == []


def test_a_decision_no_rank_applied_is_never_measured_nor_judged_missed():
    c = coordinator()
    report(c, 1, 0.89)
    c.decide(next_apply_step=20)
    for first in (11, 21, 31, 41):
        report(c, first, 0.89, applied=[(20, 12345), ("x", 1)] if first == 21 else None)
    assert c.decide(next_apply_step=60) == []
    assert c.decisions_since(0)[0]["measured"] is None and c.status()["missed"] == []
    assert c.ignored["malformed"] == 2                  # ("x", 1) from each rank


def test_escalation_to_a_priced_shrink_after_a_missed_release():
    from test_effects import plan

    from raytrain_guard.planner.memory_model import GradSync
    c = coordinator()
    assert c.set_plan(plan("fsdp-full", GradSync.EVERY_MICRO_BATCH).to_dict())
    report(c, 1, 0.89)
    (release,) = c.decide(next_apply_step=20)
    for first in (11, 21, 31):
        report(c, first, 0.91, applied=[(20, release["decision_id"])] if first == 21 else None)
    (d,) = c.decide(next_apply_step=60)
    assert d["action"] == "shrink_micro_batch" and d["predicted"]["memory_frac_after"] < 0.85
    assert c.status()["plan"] is True


def test_a_malformed_plan_is_refused_and_the_policy_goes_on_unpriced(caplog):
    c = coordinator()
    with caplog.at_level(logging.WARNING):
        assert c.set_plan({"model": {}}) is False
    assert "memory actions are unpriced" in caplog.text and c.status()["plan"] is False
    c.report_steps(0, "n0", 0, batch(0, 1, mem=0.89))
    (d,) = c.decide()
    assert d["action"] == "release_cache" and d["predicted"] is None


def test_no_release_on_cpu_ranks():
    c = coordinator()
    c.report_steps(0, "n0", 0, batch(0, 1, mem=0.89), {"micro_batch": 8, "grad_accum": 1,
                                                        "device": "cpu"})
    assert c.decide() == []
    assert "no cache release: the run is on CPU" in c.status()["notes"][0]


def test_a_restarted_group_gets_no_decision_of_the_attempt_before():
    # a stop decided in attempt 0 for a later step must not stop attempt 1 (which resumed from
    # the checkpoint that stop wrote): measured, a guard restart at 170 was followed by another
    # at 190 from the first attempt's decision
    c = coordinator()
    for first in (1, 11):
        for rank in range(4):
            c.report_steps(rank, f"n{rank // 2}", 0, batch(rank, first, compute=0.9 if rank == 3
                                                         else 0.5, comm=0.05))
    (old,) = c.decide()
    assert [d["decision_id"] for d in c.decisions_since(0)] == [old["decision_id"]]
    c.report_steps(0, "n0", 1, batch(0, 21))                 # the group restarted
    assert c.decisions_since(0) == []
    assert c.status()["attempt"] == 1
