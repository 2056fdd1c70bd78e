"""The examples a user copies from run as documented (each starts its own embedded Ray).

Slow (~45 s each): they are what the README points to, so they must not rot.
"""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, tmp_path, *args):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_own_loop_guarded_by_a_few_lines_trains(tmp_path):
    assert "done: trained 2 epochs with the guard" in _run("own_loop.py", tmp_path)


def test_template_example_reports_curve_buckets_and_attribution(tmp_path):
    out = _run("guarded_train.py", tmp_path)
    assert "trained 16 of 16 steps" in out
    assert "allreduce bandwidth (GB/s) by message size" in out
    assert "bucket plan: bucket_cap_mb=" in out
    assert "rank 0 " in out and "rank 1 " in out   # per-rank attribution lines
