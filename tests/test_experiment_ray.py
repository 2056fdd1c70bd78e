"""The before/after experiment end to end: ``raytrain-guard experiment`` on a local Ray cluster.

A hang on rank 1 ends the attempt within seconds, the coordinator names rank 1 from every
rank's watchdog record, and the run resumes from its checkpoint. It runs from a temporary
working directory with a relative ``--out``, as a user would: the workers, which run in Ray's
session folder, must still write their traces and audits there. (The activation spike that
fails every observe attempt where act finishes exactly once is the demo's: test_demo_smoke.)
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray")
pytest.importorskip("matplotlib")

pytestmark = pytest.mark.ray


def _experiment(cwd, *args: str) -> dict:
    """``raytrain-guard experiment ... --out report --json`` in a fresh process in ``cwd``, as a
    user runs it."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}       # auth is not what this tests
    proc = subprocess.run([sys.executable, "-m", "raytrain_guard.cli", "experiment", *args,
                           "--out", "report", "--json"], capture_output=True, text=True,
                          timeout=600, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["report"] == str(cwd / "report" / "report.md")
    assert json.loads((cwd / "report" / "result.json").read_text()) == result
    return result


def test_act_ends_a_hung_attempt_within_15_s_and_resumes_from_its_checkpoint(tmp_path):
    act = _experiment(tmp_path, "--fault", "hang:rank=1,start=40", "--arms", "act", "--steps",
                      "60")["arms"]["act"]
    hangs = [d for d in act["detections"] if d["kind"] == "hang"]
    assert hangs and hangs[0]["rank"] == 1 and hangs[0]["phase"] == "forward"
    assert hangs[0]["step"] == 40 and hangs[0]["seconds_to_detect"] < 15
    # the restart is Ray's: a new worker group (fresh processes importing torch, 10 s on a
    # quiet 2-core box, 20 s on a busy one) restores the checkpoint; the bound is a minute
    assert hangs[0]["seconds_to_detect"] < hangs[0]["seconds_to_restart"] < 60
    # the coordinator named it live, from both ranks' watchdog records: rank 1 stopped in its
    # forward, rank 0 went on to its backward and waits there in DDP's all-reduce
    named = act["coordinator_hangs"]
    assert [(h["attempt"], h["world_rank"], h["phase"], h["step"], h["basis"], h["settled"])
            for h in named] == [(1, 1, "forward", 40, "earliest_phase", True)], named
    assert named[0]["reported"] == [0, 1]
    assert {r["world_rank"]: r["phase"] for r in named[0]["records"]} == {0: "backward",
                                                                          1: "forward"}
    assert act["completed"] and act["attempts"] == 2
    # checkpoints every 25 steps: the restarted group computes steps 25-40 again (40 began
    # before it hung), and every sample of the epoch is consumed once by the finished lineage
    assert act["lost_steps"] == 16
    assert act["samples_lost"] == act["samples_repeated"] == act["samples_misplaced"] == 0
    assert act["samples_audited"] == 60 * 16
