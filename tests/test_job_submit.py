"""``ray job submit --working-dir . -- python examples/job_submit.py`` on a real ``ray start`` head.

The test starts its own head (its own temp dir and ports, token authentication on with a fresh
token, the metrics export port fixed), submits the example, watches the head's Prometheus
endpoint while the job runs, and checks that the job succeeded and that the guard's metrics
(``ray_raytrain_guard_...``) were exported. ``ray job submit`` runs without ``RAY_AUTH_MODE``
until :func:`enable_token_auth_if_token_exists` sets it, as the status CLI does for a user.

The head is always stopped, also on failure. Not with a bare ``ray stop``: that stops every Ray
process of the machine, including other test sessions'. The test ends only the processes of
its own head, found by its temp dir in their command line.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from ray_head import RAY_CLI, TRAIN_POLL_ENV, free_ports

from raytrain_guard.cluster.status import enable_token_auth_if_token_exists

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.ray




def _metrics(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _stop_head(temp_dir: str) -> None:
    """End the processes of this head only (found by its temp dir), TERM then KILL."""
    import psutil
    mine = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(temp_dir in part for part in proc.info["cmdline"] or ()):
                mine.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for proc in mine:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(mine, timeout=3)    # some linger past 15 s: kill them
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.fixture(scope="module")
def head():
    temp_dir = tempfile.mkdtemp(prefix="rtgj")          # short: Unix socket paths are limited
    (gcs, dashboard, metrics, client, agent_http, agent_grpc, runtime_env, node_manager,
     object_manager) = free_ports(9)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
               RAY_metrics_report_interval_ms="2000", **TRAIN_POLL_ENV)
    cmd = RAY_CLI + ["start", "--head", f"--port={gcs}", f"--temp-dir={temp_dir}", "--num-cpus=4",
           "--include-dashboard=true", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dashboard}", f"--metrics-export-port={metrics}",
           f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent_http}",
           f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={runtime_env}",
           f"--node-manager-port={node_manager}", f"--object-manager-port={object_manager}",
           "--disable-usage-stats"]
    try:
        started = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        yield {"dashboard": dashboard, "metrics": metrics, "token": env["RAY_AUTH_TOKEN"],
               "temp_dir": temp_dir}
    finally:
        _stop_head(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_job_submit_runs_a_guarded_training_and_exports_guard_metrics(head):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_AUTH_TOKEN"] = head["token"]
    assert enable_token_auth_if_token_exists(env) and env["RAY_AUTH_MODE"] == "token"
    submission = f"rtg-{secrets.token_hex(4)}"
    job = subprocess.Popen(
        RAY_CLI + ["job", "submit", "--address", f"http://127.0.0.1:{head['dashboard']}",
         "--submission-id", submission, "--working-dir", str(ROOT), "--",
         "python", "examples/job_submit.py", "--epochs", "10"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    guard_lines: list[str] = []
    deadline = time.monotonic() + 600
    try:
        while job.poll() is None and time.monotonic() < deadline:
            text = _metrics(head["metrics"])
            guard_lines = guard_lines or [ln for ln in text.splitlines()
                                          if ln.startswith("ray_raytrain_guard_")]
            time.sleep(2)
        out = job.communicate(timeout=60)[0] if job.poll() is not None else ""
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out[-4000:]
    assert "succeeded" in out, out[-4000:]
    assert "steps on 2 ranks" in out                        # the launcher's summary
    assert guard_lines, "no ray_raytrain_guard_ metric on the metrics endpoint"
    assert any(ln.startswith("ray_raytrain_guard_host_memory_used_frac") for ln in guard_lines)
