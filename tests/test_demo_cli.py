"""The README's main job, as a user runs it: `raytrain-guard demo` in a fresh process.

It starts its own embedded Ray cluster, trains 2 gloo workers with the guard, rehearses a GPU
at 89 % memory and a straggler on rank 1, and prints a summary. Slow (~1 min): one run.
"""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray


def test_demo_trains_applies_a_release_on_both_ranks_and_names_the_straggler(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "raytrain_guard.cli", "demo", "--epochs", "8"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert re.search(r"run \w+: 128/128 steps on 2 ranks", out), out[-3000:]
    # the scripted 89 % GPU becomes one cluster decision applied at one step on both ranks
    assert re.search(r"release_cache at step \d+ on ranks \[0, 1\]", out), out[-3000:]
    # the injected 30 ms compute delay on rank 1 is named, and rank 0 is seen waiting on it
    assert "rank 1: compute" in out and "waiting on rank 1" in out, out[-3000:]
    assert "Traceback" not in proc.stderr
