"""``raytrain-guard demo``: its faults, what it holds itself to, and its exit codes.

The demo itself runs once, as a user runs it, in tests/test_demo_smoke.py. Here the experiment
under it is replaced by a result written by hand (what these tests check is the demo's verdict
on a result and the CLI's answer, not the experiment).
"""

from __future__ import annotations

import pytest

from raytrain_guard import cli
from raytrain_guard.experiment import analysis, demo, runner
from raytrain_guard.experiment.faults import parse_fault


def test_the_demo_faults_are_valid_specs_on_two_ranks():
    faults = [parse_fault(f, world_size=2) for f in demo.DEMO_FAULTS]
    assert {f.kind for f in faults} == {"slow_compute", "activation_spike"}
    assert all(f.start < demo.DEMO_STEPS for f in faults)


SETUP = runner.ExperimentSetup(faults=tuple(parse_fault(f) for f in demo.DEMO_FAULTS),
                               max_steps=demo.DEMO_STEPS)
SLOW = str(SETUP.faults[0])


def arm(**overrides):
    """An arm as the demo means it to end: completed, audited clean, the slowdown named."""
    base = {"completed": True, "error": None, "attempts": 1, "steps": 60, "total_steps": 60,
            "samples_audited": 960, "samples_lost": 0, "samples_repeated": 0,
            "samples_misplaced": 0, "global_batch": 16, "global_batch_min": 16,
            "global_batch_max": 16, "audit": "60 steps: ...", "detections": [],
            "decisions": [],
            "fault_detection": [{"fault": SLOW, "cause": "compute", "named_at_step": 17,
                                 "delay_steps": 2, "in_time": True}]}
    return {**base, **overrides}


UNNAMED = [{"fault": SLOW, "cause": "compute", "named_at_step": None, "delay_steps": None,
            "in_time": False}]
SHOWN = {"observe": arm(completed=False, steps=40, error="OutOfMemoryError on rank 1 at step "
                        "40"), "act": arm()}


@pytest.mark.parametrize("arms, says", [
    (SHOWN, []),
    ({**SHOWN, "act": arm(completed=False, steps=41)},
     ["act did not finish every step (41/60 steps)"]),
    ({**SHOWN, "observe": arm()}, ["observe finished: the spike did not overflow rank 1's card"]),
    ({**SHOWN, "act": arm(samples_audited=None, samples_lost=None, audit="not audited: x")},
     ["act's samples were not audited (not audited: x)"]),
    ({**SHOWN, "act": arm(samples_lost=3)}, ["act's audit found samples_lost 3"]),
    ({**SHOWN, "act": arm(global_batch_min=8)},
     ["act's global batch was not 16 at every step (8-16)"]),
    ({**SHOWN, "observe": arm(completed=False, steps=40, fault_detection=UNNAMED)},
     ["observe did not name the slowed rank 1 (compute)"]),
    ({"observe": arm(completed=False, steps=40, fault_detection=UNNAMED),
      "act": arm(fault_detection=UNNAMED)}, ["observe did not name the slowed rank 1 (compute)",
                                             "act did not name the slowed rank 1 (compute)"]),
])
def test_the_demo_says_which_part_of_its_outcome_did_not_happen(arms, says):
    assert demo.shortfalls({"arms": arms}, SETUP) == says


def _fake_experiment(monkeypatch, tmp_path, outcome):
    """The experiment under the demo replaced: ``outcome`` raised or returned as its result."""
    seen = {}

    def experiment(setup, out_dir, progress=None):
        seen["out_dir"] = out_dir
        if isinstance(outcome, Exception):
            raise outcome
        return {"arms": outcome, "report": f"{out_dir}/report.md", "plots": []}
    monkeypatch.setattr(runner, "run_experiment", experiment)
    monkeypatch.chdir(tmp_path)
    return seen


def test_a_demo_that_showed_its_outcome_exits_0_with_its_folder_absolute(monkeypatch, tmp_path,
                                                                        capsys):
    seen = _fake_experiment(monkeypatch, tmp_path, SHOWN)
    assert cli.main(["demo", "--out", "rel"]) == 0
    assert seen["out_dir"] == str(tmp_path / "rel")
    assert f"report: {tmp_path / 'rel' / 'report.md'}" in capsys.readouterr().out


def test_a_demo_that_did_not_show_it_says_which_part_and_exits_1(monkeypatch, tmp_path, capsys):
    _fake_experiment(monkeypatch, tmp_path, {**SHOWN, "observe": arm()})
    assert cli.main(["demo"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [("raytrain-guard demo: failed: observe finished: the spike did not overflow "
                    "rank 1's card")]


def test_a_demo_whose_arm_left_no_traces_exits_1_in_one_line_naming_the_folder(
        monkeypatch, tmp_path, capsys):
    _fake_experiment(monkeypatch, tmp_path, analysis.ArmTracesError(
        "arm observe: no trace records in /x/observe/trace: the arm's workers wrote none there"))
    assert cli.main(["demo"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [("raytrain-guard demo: could not run: ArmTracesError: arm observe: no trace "
                    "records in /x/observe/trace: the arm's workers wrote none there")]
