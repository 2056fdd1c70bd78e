"""The before/after experiment end to end: ``raytrain-guard experiment`` on a local Ray cluster.

One activation spike on rank 1 that overflows its simulated card. Observing only, every
attempt fails with ``OutOfMemoryError`` and the run does not finish; acting, the guard prices
the long batches before their forward, runs them in pieces, and finishes with the same global
batch, every sample of the epoch once and no step computed twice. The report and its plot are
written and read back. A hang on rank 1 ends the attempt within seconds, the coordinator names
rank 1 from every rank's watchdog record, and the run resumes from its checkpoint. Both run
from a temporary working directory with a relative ``--out``, as a user would: the workers,
which run in Ray's session folder, must still write their traces and audits there.
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
    return result


def test_observe_fails_on_every_attempt_where_act_finishes_exactly_once(tmp_path):
    out = tmp_path / "report"
    # one attempt each (the demo's smoke test sees observe fail three times): 30 steps
    result = _experiment(tmp_path, "--fault", "activation_spike:rank=1,start=12,factor=8,steps=2",
                         "--steps", "30", "--max-failures", "0")
    observe, act = result["arms"]["observe"], result["arms"]["act"]

    assert not observe["completed"] and observe["attempts"] == 1, observe["error"]
    assert observe["error"] == "OutOfMemoryError on rank 1 at step 12"
    assert observe["attempt_errors"] == ["OutOfMemoryError on rank 1 at step 12"]

    assert act["completed"] and act["attempts"] == 1 and act["error"] is None
    assert (act["steps"], act["total_steps"]) == (30, 30)
    assert act["lost_steps"] == act["samples_lost"] == act["samples_repeated"] == 0
    # every step's ids on both ranks against the sampler's order: 16 a step, a partial epoch
    assert (act["samples_audited"], act["samples_misplaced"]) == (480, 0), act["audit"]
    # observe: the 12 steps the attempt finished before the spike
    assert (observe["steps"], observe["samples_audited"], observe["samples_lost"]) == (12, 192, 0)
    # the steps' own pace beats the pace over the whole attempt (start-up, checkpoints)
    assert act["step_samples_per_s"] > act["samples_per_s"] > 0
    assert act["global_batch"] == observe["global_batch"] == 16 and not act["batch_changes"]
    assert act["global_batch_min"] == act["global_batch_max"] == 16
    splits = [d for d in act["decisions"] if d["action"] == "split_micro_batch"]
    assert [(d["step"], d["ranks"]) for d in splits] == [(12, [1]), (13, [1])]
    assert all(d["measured"]["peak_frac"] < 0.88 for d in splits)
    assert act["peak_memory_frac"] < 0.88

    report = (out / "report.md").read_text()
    assert "| completed | **no** | yes |" in report and "activation_spike" in report
    import matplotlib.image
    image = matplotlib.image.imread(result["plots"][0])
    assert image.shape[0] > 400 and image.shape[1] > 600 and image.std() > 0.01


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
