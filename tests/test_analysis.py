"""The experiment's analysis, from hand-written trace and audit records (no Ray, no workers).

The arms here have 2 ranks, micro-batch 4, no accumulation: a step consumes 8 samples, rank
``r`` taking positions ``p + r, p + r + 2, ...`` of its epoch's order from the epoch's
position ``p``. ``ORDER`` stands in for the sampler's permutation of each epoch.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from raytrain_guard.experiment import analysis
from raytrain_guard.experiment.audit import audit_arm
from raytrain_guard.experiment.faults import parse_fault
from raytrain_guard.experiment.report import format_text

WORLD, MICRO = 2, 4
STEP = WORLD * MICRO          # samples a step, both ranks


def order(epoch: int, n: int = 16) -> list[int]:
    ids = list(range(n))
    random.Random(epoch).shuffle(ids)
    return ids


def expected(step_in_epoch: int, rank: int, epoch: int = 0, n: int = 16) -> list[int]:
    """The ids the sampler gives ``rank`` at that step of the epoch."""
    p = step_in_epoch * STEP
    return [order(epoch, n)[p + rank + WORLD * i] for i in range(MICRO)]


def write_arm(root, *, audits, steps_done=None, attempts=("a",), total_steps=4,
              ranks=range(WORLD), decisions=(), error_step=None):
    """Traces and audits of one arm: ``audits`` = {rank: [(step, epoch, ids, attempt)]}; every
    attempt starts on every rank; the last one ends at ``steps_done`` (or fails at
    ``error_step``)."""
    (root / "trace").mkdir(parents=True, exist_ok=True)
    (root / "audit").mkdir(parents=True, exist_ok=True)
    for rank in ranks:
        trace = [{"t": "start", "attempt": a, "wall": 100.0 + i, "world_size": WORLD,
                  "micro_batch": MICRO, "grad_accum": 1, "total_steps": total_steps}
                 for i, a in enumerate(attempts)]
        finished = steps_done if steps_done is not None else error_step
        trace += [{"t": "step", "attempt": attempts[-1], "wall": 105.0, "step": s,
                   "total_s": 0.01, "data_wait_s": 0.0, "memory_frac": None,
                   "micro_batch": MICRO, "grad_accum": 1} for s in range(finished or 0)]
        trace += [{"t": "decision", "attempt": attempts[-1], "wall": 110.0, "world_rank": rank,
                   **d} for d in decisions]
        if steps_done is not None:
            trace.append({"t": "end", "attempt": attempts[-1], "wall": 120.0,
                          "step": steps_done})
        if error_step is not None:
            trace.append({"t": "error", "attempt": attempts[-1], "wall": 120.0,
                          "error": "OutOfMemoryError", "step": error_step})
        (root / "trace" / f"rank{rank}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in trace))
    for rank, records in audits.items():
        (root / "audit" / f"rank{rank}.jsonl").write_text("".join(
            json.dumps({"step": s, "epoch": e, "ids": ids, "attempt": a}) + "\n"
            for s, e, ids, a in records))
    return root


def clean_audits(steps, *, attempt="a", epoch_of=lambda s: s // 2):
    return {r: [(s, epoch_of(s), expected(s % 2, r, epoch_of(s)), attempt) for s in steps]
            for r in range(WORLD)}


def analyze(root, faults=(), **kw):
    kw.setdefault("epoch_order", order)
    return analysis.analyze_arm(str(root), list(faults), num_samples=16, launch_error=None,
                                wall_s=1.0, num_workers=WORLD, **kw)


def audit_figures(arm):
    return {k: arm[k] for k in ("samples_audited", "samples_lost", "samples_repeated",
                                "samples_misplaced", "global_batch", "global_batch_min",
                                "global_batch_max")}


def test_a_clean_arm_audits_every_position_of_every_step(tmp_path):
    arm = analyze(write_arm(tmp_path, audits=clean_audits(range(4)), steps_done=4))
    assert audit_figures(arm) == {"samples_audited": 32, "samples_lost": 0,
                                  "samples_repeated": 0, "samples_misplaced": 0,
                                  "global_batch": 8, "global_batch_min": 8,
                                  "global_batch_max": 8}
    assert arm["lost_steps"] == 0 and arm["steps"] == 4


def test_a_dropped_id_is_lost(tmp_path):
    audits = clean_audits(range(4))
    step, epoch, ids, attempt = audits[1][2]
    audits[1][2] = (step, epoch, ids[:-1], attempt)          # rank 1 skipped one at step 2
    arm = analyze(write_arm(tmp_path, audits=audits, steps_done=4))
    assert (arm["samples_lost"], arm["samples_repeated"], arm["samples_misplaced"]) == (1, 0, 0)
    assert (arm["global_batch"], arm["global_batch_min"], arm["global_batch_max"]) == (8, 7, 8)


def test_a_duplicated_id_is_repeated_and_the_one_it_displaced_lost(tmp_path):
    audits = clean_audits(range(4))
    step, epoch, ids, attempt = audits[0][1]
    audits[0][1] = (step, epoch, [ids[0], *ids[:-1]], attempt)   # reads ids[0] twice
    arm = analyze(write_arm(tmp_path, audits=audits, steps_done=4))
    assert (arm["samples_lost"], arm["samples_repeated"], arm["samples_misplaced"]) == (1, 1, 0)


def test_ids_swapped_between_ranks_are_misplaced_not_lost(tmp_path):
    audits = clean_audits(range(4))
    (s, e, a0, at), (_, _, a1, _) = audits[0][3], audits[1][3]
    audits[0][3], audits[1][3] = (s, e, [a1[0], *a0[1:]], at), (s, e, [a0[0], *a1[1:]], at)
    arm = analyze(write_arm(tmp_path, audits=audits, steps_done=4))
    assert (arm["samples_lost"], arm["samples_repeated"], arm["samples_misplaced"]) == (0, 0, 2)


def test_a_restarted_lineage_counts_the_recomputed_steps_of_the_later_attempt(tmp_path):
    # attempt a ran steps 0-2, step 2 wrongly (it read step 3's ids), then failed; attempt b
    # resumed at step 1 and ran steps 1-3 right: its steps override a's
    audits = clean_audits(range(3), attempt="a")
    for r in range(WORLD):
        audits[r][2] = (2, 1, expected(1, r, 1), "a")
        audits[r] += [(s, s // 2, expected(s % 2, r, s // 2), "b") for s in range(1, 4)]
    arm = analyze(write_arm(tmp_path, audits=audits, steps_done=4, attempts=("a", "b")))
    assert (arm["samples_lost"], arm["samples_repeated"], arm["samples_misplaced"]) == (0, 0, 0)
    assert arm["lost_steps"] == 2 and arm["attempts"] == 2          # steps 1 and 2 again
    # the same records with the attempts' order reversed: a's wrong step 2 is the lineage's
    rev = analyze(write_arm(tmp_path / "rev", audits=audits, steps_done=4,
                            attempts=("b", "a")))
    assert rev["samples_lost"] == 8 and rev["samples_repeated"] == 8


def test_a_rank_that_trained_without_an_audit_makes_the_arm_not_audited(tmp_path):
    audits = clean_audits(range(4))
    del audits[1]
    root = write_arm(tmp_path, audits=audits, steps_done=4)
    arm = analyze(root)
    figures = audit_figures(arm)
    assert set(figures.values()) == {None} and arm["lost_steps"] is None
    assert arm["audit"].startswith("not audited: rank 1 trained but recorded no sample ids")
    assert str(root / "audit" / "rank1.jsonl") in arm["audit"]
    # an empty file is no audit either
    (root / "audit" / "rank1.jsonl").write_text("")
    assert analyze(root)["samples_lost"] is None
    table = format_text({"arms": {"act": arm}})
    assert "| samples lost | not audited |" in table
    assert "| global batch | not audited |" in table


def test_a_partial_epoch_is_audited_position_by_position(tmp_path):
    # 24 samples: 3 steps an epoch; the run stopped after 2 (16 of the epoch's positions)
    def audits_of(drop):
        out = {r: [(s, 0, expected(s, r, 0, n=24), "a") for s in range(2)] for r in range(WORLD)}
        if drop:
            s, e, ids, a = out[0][1]
            out[0][1] = (s, e, ids[1:], a)
        return out
    for drop, lost in ((False, 0), (True, 1)):
        root = write_arm(tmp_path / str(drop), audits=audits_of(drop), steps_done=2,
                         total_steps=2)
        arm = analysis.analyze_arm(str(root), [], num_samples=24, launch_error=None, wall_s=1.0,
                                   num_workers=WORLD, epoch_order=lambda e: order(e, 24))
        assert (arm["samples_audited"], arm["samples_lost"], arm["samples_repeated"]) == \
            (16, lost, 0)


def test_without_the_samplers_order_counts_and_repeats_are_checked(tmp_path):
    audits = clean_audits(range(4))
    assert analyze(write_arm(tmp_path / "clean", audits=audits, steps_done=4),
                   epoch_order=None)["samples_lost"] == 0
    s, e, ids, a = audits[1][0]
    audits[1][0] = (s, e, [audits[0][0][2][0], *ids[1:]], a)     # rank 0's first id, again
    arm = analyze(write_arm(tmp_path / "dup", audits=audits, steps_done=4), epoch_order=None)
    assert (arm["samples_lost"], arm["samples_repeated"], arm["samples_misplaced"]) == \
        (1, 1, None)
    # a partial epoch: a short rank's missing sample and an id read twice
    part = clean_audits(range(1))
    s, e, ids, a = part[0][0]
    part[0][0] = (s, e, [ids[0], ids[0], *ids[2:]], a)
    arm = analyze(write_arm(tmp_path / "part", audits=part, steps_done=1), epoch_order=None)
    assert (arm["samples_audited"], arm["samples_lost"], arm["samples_repeated"]) == (8, 0, 1)
    part[1][0] = (s, e, part[1][0][2][:-1], a)
    arm = analyze(write_arm(tmp_path / "short", audits=part, steps_done=1), epoch_order=None)
    assert arm["samples_lost"] == 1


def test_a_step_no_rank_recorded_is_a_gap_of_lost_samples(tmp_path):
    audits = {r: [rec for rec in recs if rec[0] != 1] for r, recs in clean_audits(range(4)).items()}
    arm = analyze(write_arm(tmp_path, audits=audits, steps_done=4))
    assert (arm["samples_audited"], arm["samples_lost"], arm["samples_repeated"]) == (32, 8, 0)


def test_a_failed_arm_audits_the_steps_its_last_attempt_finished(tmp_path):
    # ids of step 3 were recorded, then its forward ran out of memory: steps 0-2 finished
    arm = analyze(write_arm(tmp_path, audits=clean_audits(range(4)), error_step=3))
    assert not arm["completed"] and arm["steps"] == 3 and arm["samples_audited"] == 24


def test_an_arm_without_traces_is_an_error_naming_the_folder(tmp_path):
    with pytest.raises(analysis.ArmTracesError, match=re.escape(str(tmp_path / "none" /
                                                                    "trace"))):
        analyze(tmp_path / "none")
    root = write_arm(tmp_path / "one", audits=clean_audits(range(4)), steps_done=4, ranks=[0])
    with pytest.raises(analysis.ArmTracesError,
                       match=r"traces of 1 of 2 ranks in .*one/trace: rank 1 wrote none"):
        analyze(root)


def _sampler_audits(num_samples, world, micro, seed, attempts):
    """Audit records from the loop's real sampler: ``attempts`` = [(attempt, epoch, start
    position, first step, steps)]: each attempt reads from ``start`` of ``epoch`` on."""
    from raytrain_guard.runtime.data.sampler import ResumableDistributedSampler

    audits = {r: [] for r in range(world)}
    for attempt, epoch, start, first, steps in attempts:
        for rank in range(world):
            sampler = ResumableDistributedSampler(range(num_samples), num_replicas=world,
                                                  rank=rank, seed=seed)
            sampler.set_epoch(epoch)
            sampler.set_start(start)
            ids = list(sampler)
            audits[rank] += [{"step": first + i, "epoch": epoch, "attempt": attempt,
                              "ids": ids[micro * i:micro * (i + 1)]} for i in range(steps)]
    return audits


@pytest.mark.parametrize("resume_at, lost, misplaced", [(16, 0, 0), (0, 16, 16)])
def test_the_loops_sampler_gives_each_rank_the_ids_the_audit_expects(resume_at, lost,
                                                                     misplaced):
    """The built-in job's order (the runner's) against the loop's real sampler: 2 ranks,
    micro-batch 8; attempt b resumes at step 1, from position 16 (right) or 0 (the epoch read
    again from its start: positions 0-15 twice, 16-31 a step late, 32-47 never)."""
    from raytrain_guard.experiment.model import NUM_SAMPLES
    from raytrain_guard.experiment.runner import ExperimentSetup, _epoch_order

    audits = _sampler_audits(NUM_SAMPLES, 2, 8, 5, [("a", 0, 0, 0, 3),
                                                    ("b", 0, resume_at, 1, 2)])
    result = audit_arm(audits, {0: ["a", "b"], 1: ["a", "b"]}, world_size=2, steps_done=3,
                       num_samples=NUM_SAMPLES, step_samples={s: 8 for s in range(3)},
                       epoch_order=_epoch_order(ExperimentSetup(faults=(), seed=5)))
    assert (result.samples_audited, result.samples_lost, result.samples_repeated,
            result.samples_misplaced) == (48, lost, lost, misplaced)


def test_the_samplers_padding_is_where_the_audit_expects_it():
    """10 samples on 3 ranks (padded to 12 with the epoch's head), micro-batch 2; attempt b
    resumes mid-epoch 1 at position 6, whose padding is the head again."""
    from raytrain_guard.runtime.data.sampler import ResumableDistributedSampler

    audits = _sampler_audits(10, 3, 2, 5, [("a", 0, 0, 0, 2), ("a", 1, 0, 2, 1),
                                           ("b", 1, 6, 3, 1)])
    sampler = ResumableDistributedSampler(range(10), num_replicas=1, rank=0, seed=5)

    def epoch_order(epoch):
        sampler.set_epoch(epoch)
        return sampler.epoch_permutation()
    result = audit_arm(audits, {r: ["a", "b"] for r in range(3)}, world_size=3, steps_done=4,
                       num_samples=10, step_samples={s: 2 for s in range(4)},
                       epoch_order=epoch_order)
    assert (result.samples_audited, result.samples_lost, result.samples_repeated,
            result.samples_misplaced) == (24, 0, 0, 0)
    assert (result.global_batch_min, result.global_batch_max) == (6, 6)


# -- detections: one dating rule, a bound on lateness ---------------------------------------

def _decision(action, applied_at, **kw):
    return {"action": action, "applied_at": applied_at, "cause": "compute", "scope": "rank",
            "reason": action, **kw}


def test_slow_steps_and_stragglers_recorded_at_one_boundary_have_one_date(tmp_path):
    decisions = [_decision("slow_step", 18),
                 _decision("flag_straggler", 18, scope="cluster", decision_id=7,
                           params={"world_ranks": [1]})]
    root = write_arm(tmp_path, audits=clean_audits(range(4)), steps_done=4,
                     decisions=decisions)
    fault = parse_fault("slow_compute:rank=1,start=15,stop=25,factor=3")
    arm = analyze(root, [fault])
    dated = {(d["kind"], d["rank"]): d["step"] for d in arm["detections"]}
    assert dated[("slow_step (compute)", 1)] == dated[("straggler", 1)] == 17
    assert arm["fault_detection"][0]["named_at_step"] == 17


def test_a_straggler_flag_names_the_flagged_rank_not_the_ranks_that_applied_it(tmp_path):
    # the coordinator flags rank 1 (params world_ranks, as core.policy writes it); both ranks
    # record the flag: it names rank 1 only, and in the observe arm (applied nowhere) too
    flag = {"scope": "cluster", "decision_id": 7, "params": {"world_ranks": [1]}}
    decisions = [_decision("flag_straggler", 18, world_rank=0, applied=False, **flag),
                 _decision("flag_straggler", 18, world_rank=1, applied=False, **flag)]
    root = write_arm(tmp_path, audits=clean_audits(range(4)), steps_done=4,
                     decisions=decisions)
    fault = parse_fault("slow_compute:rank=1,start=15,stop=25,factor=3")
    arm = analyze(root, [fault])
    assert [(d["kind"], d["rank"]) for d in arm["detections"]] == [("straggler", 1)]
    assert arm["fault_detection"][0]["named_at_step"] == 17


@pytest.mark.parametrize("action, applied_at, named", [
    ("slow_step", 28, 27), ("slow_step", 29, None),             # the gate's bound: 3
    ("flag_straggler", 45, 44), ("flag_straggler", 46, None),   # the coordinator's: 20
])
def test_a_detection_past_the_faults_end_plus_its_bound_does_not_name_it(tmp_path, action,
                                                                         applied_at, named):
    # the fault's last step is 24; a detection dated applied_at - 1
    decision = _decision(action, applied_at, scope="cluster", decision_id=3,
                         params={"world_ranks": [1]}) if action == "flag_straggler" else \
        _decision(action, applied_at)
    root = write_arm(tmp_path, audits=clean_audits(range(4)), steps_done=4,
                     decisions=[decision])
    fault = parse_fault("slow_compute:rank=1,start=15,stop=25,factor=3")
    arm = analyze(root, [fault], lateness=analysis.Lateness(rank_steps=3, cluster_steps=20))
    assert arm["fault_detection"][0]["named_at_step"] == named
    on_rank1 = [d for d in arm["detections"] if d["rank"] == 1]
    assert on_rank1[0]["fault"] == (None if named is None else "slow_compute")


def test_the_lateness_bound_ends_at_a_spikes_last_step():
    spike = parse_fault("activation_spike:rank=1,start=40,factor=8,steps=3")
    assert spike.last_step == 42
    assert analysis.can_name(spike, 1, 52, late_steps=10)
    assert not analysis.can_name(spike, 1, 53, late_steps=10)
    assert not analysis.can_name(spike, 0, 41, late_steps=10)      # another rank
    assert analysis.can_name(parse_fault("slow_compute:rank=1,start=5,factor=2"), 1, 10**6,
                             late_steps=0)                    # no end: no bound


def test_a_slow_link_is_named_by_any_rank_that_waits_on_it_in_communication():
    # rank 1's link is slow: every rank's allreduce waits for it, so rank 0's communication
    # event names it (not a false event); rank 0's compute event does not, and a slow device
    # on rank 1 is named on rank 1 only
    link = parse_fault("comm_delay:rank=1,start=20,seconds=0.036")
    assert analysis.can_name(link, 0, 23, late_steps=3, cause="communication")
    assert not analysis.can_name(link, 0, 23, late_steps=3, cause="compute")
    assert not analysis.can_name(link, 0, 19, late_steps=3, cause="communication")
    slow = parse_fault("slow_compute:rank=1,start=20,factor=2")
    assert not analysis.can_name(slow, 0, 23, late_steps=3, cause="communication")
    waits = [{"kind": "slow_step (communication)", "rank": 0, "cause": "communication",
              "step": 23, "source": "rank"}]
    (matched,) = analysis.match_detections([link], waits)
    assert matched["fault"] == "comm_delay" and matched["right_cause"]
    (outcome,) = analysis.fault_outcomes([link], waits)
    assert (outcome["named_at_step"], outcome["in_time"]) == (23, True)
    assert analysis.match_detections([slow], waits)[0]["fault"] is None


def _on_nodes(root, node_of):
    """Give each rank's start records the Ray node id ``node_of[rank]``."""
    for rank, node in node_of.items():
        path = root / "trace" / f"rank{rank}.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({**r, "node_id": node} if r["t"] == "start" else r)
                                + "\n" for r in records))


def test_a_node_fault_is_named_by_its_node_as_a_node_not_by_its_rank(tmp_path):
    # rank 1 runs on node "nb", the experiment's node 1. The coordinator names rank 1 alone
    # first (a rank-scoped flag), then node nb as a node: only the latter names the node fault,
    # and it carries node_index 1 beside the Ray node id
    def flag(applied_at, target, did):
        return _decision("flag_straggler", applied_at, scope="node:nb", decision_id=did,
                         params={"world_ranks": [1], "node_id": "nb", "target": target})
    root = write_arm(tmp_path, audits=clean_audits(range(4)), steps_done=4,
                     decisions=[flag(12, "rank", 5), flag(16, "node", 6)])
    _on_nodes(root, {0: "na", 1: "nb"})
    fault = parse_fault("slow_compute:node=1,start=10,factor=3", num_nodes=2)
    arm = analyze(root, [fault], node_ids=["na", "nb"])
    assert arm["nodes"] == [{"node_index": 0, "node_id": "na", "ranks": [0]},
                            {"node_index": 1, "node_id": "nb", "ranks": [1]}]
    named = arm["fault_detection"][0]
    assert (named["named_at_step"], named["node_index"], named["node_id"], named["ranks"]) == \
        (15, 1, "nb", [1])
    assert [(d["target"], d["node_index"], d["fault"]) for d in arm["detections"]] == \
        [("rank", 1, "slow_compute"), ("node", 1, "slow_compute")]
    # the same flags, the fault on the other node: neither names it
    other = parse_fault("slow_compute:node=0,start=10,factor=3", num_nodes=2)
    assert analyze(root, [other], node_ids=["na", "nb"])["fault_detection"][0][
        "named_at_step"] is None


def test_a_node_fault_is_named_by_a_slow_step_its_gate_read_as_the_nodes(tmp_path):
    # every rank's gate records a compute slow step at 18 (dated 17); read as its node's
    # (node_wide: the node's other ranks slowed too) it names the rank's node as a node: rank 1's
    # names node nb, the fault's; without node_wide it names no node
    for node_wide, named_at in ((True, 17), (False, None)):
        folder = tmp_path / str(node_wide)
        folder.mkdir()
        root = write_arm(folder, audits=clean_audits(range(4)), steps_done=4, decisions=[
            _decision("slow_step", 18, params={"num_steps": 3, "first_step": 15,
                                               "node_wide": node_wide})])
        _on_nodes(root, {0: "na", 1: "nb"})
        fault = parse_fault("slow_compute:node=1,start=14,factor=3", num_nodes=2)
        arm = analyze(root, [fault], node_ids=["na", "nb"])
        named = arm["fault_detection"][0]
        assert named["named_at_step"] == named_at
        if node_wide:
            assert (named["node_index"], named["node_id"], named["delay_steps"]) == (1, "nb", 3)
            assert sorted((d["rank"], d["target"], d["node_index"])
                          for d in arm["detections"]) == [(0, "node", 0), (1, "node", 1)]
