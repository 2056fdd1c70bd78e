"""The README's main job, as a user runs it: ``raytrain-guard demo`` in a fresh process.

It starts its own embedded Ray cluster and runs the default experiment: the same 2-worker
training twice under the same faults, the guard observing and the guard acting, then prints the
side-by-side table and the report's path. Slow (about a minute): one run (marked ``ray``).
"""

import re
import subprocess
import sys

import pytest

from raytrain_guard.cluster import demo
from raytrain_guard.core.faults import parse_fault


def test_the_demo_faults_are_valid_specs_on_two_ranks():
    faults = [parse_fault(f, world_size=2) for f in demo.DEMO_FAULTS]
    assert {f.kind for f in faults} == {"slow_compute", "activation_spike"}
    assert all(f.start < demo.DEMO_STEPS for f in faults)


@pytest.mark.ray
def test_demo_shows_observe_failing_where_act_finishes(tmp_path):
    env = {"RAY_AUTH_MODE": "disabled", "PATH": "/usr/bin:/bin"}
    import os
    env = {**os.environ, **env}
    proc = subprocess.run([sys.executable, "-m", "raytrain_guard.cli", "demo", "--out",
                           str(tmp_path / "demo")], capture_output=True, text=True, timeout=600,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "arm observe: did not complete" in out and "arm act: completed" in out
    assert re.search(r"\| completed \| \*\*no\*\* \| yes \|", out)
    assert re.search(r"\| error \| OutOfMemoryError on rank 1 at step 40 \| - \|", out)
    assert "split_micro_batch at step 40 on ranks [1]" in out
    assert f"report: {tmp_path / 'demo' / 'report.md'}" in out
    assert (tmp_path / "demo" / "timeline.png").stat().st_size > 10_000
