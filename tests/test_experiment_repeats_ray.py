"""``raytrain-guard experiment --repeat 2 --address ...`` on a Ray cluster it joins, as a user
runs it against their own cluster.

The module starts one head (``ray start --head --block``, free ports, its own temp dir) and
stops it by ending that process (never ``ray stop``, which would stop every Ray on the
machine), with no drain on SIGTERM (``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0``). Auth is not what it is about: ``RAY_AUTH_MODE=disabled`` is set only in the head's and
the experiments' environments, which are child processes: Ray keeps a process's first auth mode.

Two pairs of 6 steps, observe and act, under a compute slowdown on rank 1: the arms run
interleaved, each in its own folder; pair 1 runs at seed 1 in both arms (its audit against the
sampler's order at that seed finds nothing misplaced); the JSON keeps the first repeat's
figures and gains every repeat and the intervals; the experiment ran on the head's node, not on
a local cluster of its own.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from ray_head import RAY_CLI, free_ports

pytest.importorskip("ray")
pytest.importorskip("matplotlib")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

FAULT = "slow_compute:rank=1,start=2,factor=2"




@pytest.fixture(scope="module")
def head():
    gcs, metrics, agent, agent_grpc, runtime_env, client = free_ports(6)
    temp = tempfile.mkdtemp(prefix="rtg", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_AUTH_MODE"] = "disabled"
    head_env = {**env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    cmd = RAY_CLI + [
        "start", "--head", "--block", f"--port={gcs}", f"--metrics-export-port={metrics}",
        "--include-dashboard=false", f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={runtime_env}",
        f"--ray-client-server-port={client}", "--num-cpus=4", f"--temp-dir={temp}",
        "--disable-usage-stats"]
    log = open(os.path.join(temp, "ray_start.log"), "w")   # noqa: SIM115 - the head's lifetime
    proc = subprocess.Popen(cmd, env=head_env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    raylet = Path(temp, "session_latest", "logs", "raylet.out")
    try:
        deadline = time.monotonic() + 120
        node_id = None
        while node_id is None:
            assert proc.poll() is None, Path(log.name).read_text()[-3000:]
            assert time.monotonic() < deadline, Path(log.name).read_text()[-3000:]
            time.sleep(1)
            found = re.search(r"Setting node ID node_id=([0-9a-f]+)",
                              raylet.read_text() if raylet.exists() else "")
            node_id = found and found.group(1)
        yield {"address": f"127.0.0.1:{gcs}", "node_id": node_id, "env": env}
    finally:
        proc.send_signal(signal.SIGTERM)          # --block: ends the processes it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _experiment(cwd: Path, env: dict, *args: str) -> dict:
    """``raytrain-guard experiment ... --out report --json`` in a fresh process in ``cwd``."""
    proc = subprocess.run([sys.executable, "-m", "raytrain_guard.cli", "experiment", *args,
                           "--out", "report", "--json"], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _first_start_and_end(arm_dir: Path) -> tuple[float, float]:
    """Wall times of rank 0's first record and its ``end`` record."""
    records = [json.loads(line) for line in (arm_dir / "trace" / "rank0.jsonl").open()]
    return records[0]["wall"], next(r["wall"] for r in records if r["t"] == "end")


def test_two_interleaved_pairs_on_the_cluster_at_address(head, tmp_path):
    result = _experiment(tmp_path, head["env"], "--address", head["address"], "--repeat", "2",
                         "--steps", "6", "--fault", FAULT)
    assert result["cluster"] == {"address": head["address"], "node_ids": [head["node_id"]]}
    assert result["repeat"] == {"pairs": 2, "seeds": [0, 1]}

    out = tmp_path / "report"
    spans = [_first_start_and_end(out / f"repeat-{i}" / arm)
             for i in range(2) for arm in ("observe", "act")]
    # observe, act, observe, act: each arm began after the one before it ended
    assert all(end < start for (_, end), (start, _) in itertools.pairwise(spans)), spans
    assert not (out / "observe").exists() and not (out / "act").exists()

    for name in ("observe", "act"):
        arm = result["arms"][name]
        assert len(arm["repeats"]) == 2
        for repeat in arm["repeats"]:
            assert repeat["completed"] and repeat["steps"] == 6
            # each repeat audited against its own seed's order (pair 1: seed 1, both arms)
            assert (repeat["samples_audited"], repeat["samples_misplaced"]) == (96, 0)
        # the arm's own figures are its first repeat's
        assert arm["step_samples_per_s"] == arm["repeats"][0]["step_samples_per_s"]
        [named] = arm["fault_detection"]
        k, n = named["named_within_5"]
        assert n == 2 and 0 <= k <= 2 and named["fault"] == arm["repeats"][0][
            "fault_detection"][0]["fault"]
        stats = arm["stats"]
        assert {"samples_per_s", "step_samples_per_s", "data_wait_frac", "peak_memory_frac",
                "lost_steps", "samples_lost", "samples_repeated",
                "false_events_per_1000_clean_steps"} <= set(stats)
        throughput = stats["step_samples_per_s"]
        assert throughput["n"] == 2 and throughput["low"] <= throughput["median"] \
            <= throughput["high"]
        assert sorted(throughput["values"]) == sorted(r["step_samples_per_s"]
                                                      for r in arm["repeats"])
    assert result["arms"]["act"]["stats"]["act_observe_step_samples_per_s"]["n"] == 2

    report = (out / "report.md").read_text()
    assert "## Repeats" in report and "(repeat-0/timeline.png)" in report
    assert [Path(p).name for p in result["plots"]] == ["timeline.png", "repeats.png"]
    assert all(Path(p).exists() for p in result["plots"])

