"""The dashboard's metrics on the metrics endpoint of a real ``ray start --head``.

The test starts its own head (``ray start --head --block --metrics-export-port=PORT``, free
ports, its own temp dir) and stops it by ending that process (never ``ray stop``, which would
stop every Ray on the machine). Auth is not what it is about: ``RAY_AUTH_MODE=disabled``, set
only in the head's and the driver's environments: the driver runs in a child process (this
file, run as a script), since Ray keeps a process's first auth mode and every later local
cluster of the suite uses token auth. Ports come from below the kernel's ephemeral range, so
no outgoing connection takes one between the pick and the head's bind.

On that head the package's own code records every metric the dashboard queries: the node
monitors (a scripted GPU at 50 %, throttled for power; the private memory of the rank actor,
registered as a train worker), the coordinator (two ranks' reports, policy rounds, a stop
request, both ranks' hang records) and a rank's :class:`RankMetrics` in an actor. Then the endpoint
is scraped until every name the dashboard queries is there, per-rank ones with Ray Train's
labels. Ray drops a gauge that was not set again for two export intervals (its OpenTelemetry
recorder's TTL), so, as in a live run, the rank and the coordinator record again between
scrapes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from ray_head import RAY_CLI, free_ports

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

NS = "rtg_test_grafana"
RUN = "grafana-run"
RUN_NAME = "grafana_test_run"




@pytest.fixture(scope="module")
def head():
    gcs, metrics_port, dashboard, agent, agent_grpc, runtime_env, client = free_ports(7)
    temp = tempfile.mkdtemp(prefix="rtg", dir="/tmp")
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    cmd = RAY_CLI + [
        "start", "--head", "--block", f"--port={gcs}", f"--metrics-export-port={metrics_port}",
        f"--dashboard-port={dashboard}", f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={runtime_env}",
        f"--ray-client-server-port={client}", "--num-cpus=2", f"--temp-dir={temp}",
        "--disable-usage-stats"]
    log = open(os.path.join(temp, "ray_start.log"), "w")   # noqa: SIM115 - the head's lifetime
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _scrape(metrics_port):
            assert proc.poll() is None, Path(log.name).read_text()[-3000:]
            assert time.monotonic() < deadline, Path(log.name).read_text()[-3000:]
            time.sleep(2)
        yield {"gcs": gcs, "metrics": metrics_port, "env": env}
    finally:
        proc.send_signal(signal.SIGTERM)          # --block: ends the processes it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _record_everything():
    """Every metric the dashboard queries, recorded by the package's own code on the head."""
    from raytrain_guard.cluster.actors import start_coordinator, start_monitors
    from raytrain_guard.cluster.monitor.probes import ScriptedProbeFactory
    from raytrain_guard.config import GuardConfig
    from raytrain_guard.core.node_samples import GpuSample

    cfg = GuardConfig(monitor_interval_s=0.5, decision_interval_s=1e9, straggler_min_steps=1)
    probes = ScriptedProbeFactory([[GpuSample(0, 40 * 2**30, 80 * 2**30, 0.9, 71.0, 300.0,
                                              ("power",))]], worker_gpus=(0,))
    monitors = start_monitors(NS, RUN, cfg, probe_factory=probes)
    coordinator = start_coordinator(NS, RUN, cfg, run_name=RUN_NAME)
    node_id = next(iter(monitors))
    attempt = ray.get(coordinator.next_attempt.remote())
    for rank, compute in ((0, 0.01), (1, 0.03)):            # rank 1 slow in compute
        rows = [{"step": s, "total_s": 0.05, "data_wait_s": 0.001, "forward_s": compute,
                 "backward_s": compute, "comm_wait_s": 0.04 - 2 * compute + 0.02,
                 "optimizer_s": 0.001, "memory_frac": 0.5, "world_rank": rank}
                for s in range(20)]
        ray.get(coordinator.report_steps.remote(rank, node_id, attempt, rows))
    ray.get(coordinator.request_stop.remote("scrape test"))
    for rank, phase in ((0, "backward"), (1, "forward")):     # rank 1 stopped earliest
        ray.get(coordinator.report_hang.remote(rank, node_id, attempt, {
            "step": 20, "phase": phase, "phase_for_s": 9.0, "step_for_s": 10.0,
            "last_progress_wall": time.time() - 10.0 + rank, "world_size": 2,
            "in_collective": False}))

    @ray.remote(num_cpus=0)
    class Rank:
        def record(self, run_name, world_rank):
            from raytrain_guard.core.decisions import Action, Decision
            from raytrain_guard.core.steps import StepStats
            from raytrain_guard.runtime.guard.metrics import RankMetrics
            if not hasattr(self, "metrics"):
                self.metrics = RankMetrics(run_name, world_rank, watermark_frac=0.88,
                                           critical_frac=0.95)
                self.metrics.record_loader(1, 4)
            self.metrics.record([StepStats(s, 0.05, 0.002, 0.01, 0.02, 0.01, 0.005, 0.4,
                                           world_rank) for s in range(10)])
            self.metrics.record_decision(Decision(Action.RELEASE_CACHE, "scrape test"))
            return True

        def pid(self):
            return os.getpid()

    rank = Rank.remote()
    monitors[node_id].register_worker.remote(ray.get(rank.pid.remote()), 1)

    def again() -> None:
        """What a live run does between scrapes: a policy round, a rank's batch of steps."""
        ray.get([coordinator.decide.remote(30), rank.record.remote(RUN_NAME, 1)])

    again()
    return again, (monitors, coordinator, rank)


def _scrape(port: int) -> str:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read() \
            .decode()
    except OSError:
        return ""


def _drive(gcs: int, metrics_port: int) -> dict:
    """In the child: record everything, scrape until every queried name is there."""
    from grafana_queries import queried_metrics

    from raytrain_guard.cluster.actors import stop_all
    from raytrain_guard.cluster.grafana import dashboard

    ray.init(address=f"127.0.0.1:{gcs}", namespace=NS, log_to_driver=False,
             logging_level="warning")
    wanted = queried_metrics(dashboard())
    again, handles = _record_everything()
    try:
        deadline = time.monotonic() + 180
        missing, body = wanted, ""
        while time.monotonic() < deadline:
            again()
            body = _scrape(metrics_port)
            missing = wanted - set(re.findall(r"^(ray_raytrain_guard_\w+)\{", body,
                                              re.MULTILINE))
            if not missing:
                break
            time.sleep(3)
        return {"missing": sorted(missing), "body": body}
    finally:
        del handles
        stop_all(NS, RUN)
        ray.shutdown()


def test_every_dashboard_metric_is_on_the_heads_metrics_endpoint(head):
    out = subprocess.run([sys.executable, __file__, str(head["gcs"]), str(head["metrics"])],
                         env=head["env"], cwd=Path(__file__).parent, capture_output=True,
                         text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    body = result["body"]
    assert not result["missing"], (result["missing"], sorted(set(re.findall(
        r"^(ray_raytrain_guard_\w+)\{", body, re.MULTILINE))))
    # per-rank metrics carry Ray Train's labels; node metrics the node and the GPU
    step = [line for line in body.splitlines()
            if line.startswith("ray_raytrain_guard_rank_step_seconds{")]
    assert any(f'ray_train_run_name="{RUN_NAME}"' in line
               and 'ray_train_worker_world_rank="1"' in line for line in step), step
    gpu = [line for line in body.splitlines()
           if line.startswith("ray_raytrain_guard_gpu_memory_frac{")]
    assert any('gpu="0"' in line and "node_id=" in line for line in gpu), gpu
    throttled = [line for line in body.splitlines()
                 if line.startswith("ray_raytrain_guard_gpu_throttled{")
                 and 'reason="power"' in line]
    assert throttled and throttled[0].rsplit(" ", 1)[1] in ("1", "1.0"), throttled
    excess = [line for line in body.splitlines()
              if line.startswith("ray_raytrain_guard_straggler_excess_frac{")]
    assert any(f'ray_train_run_name="{RUN_NAME}"' in line for line in excess), excess


if __name__ == "__main__":
    print(json.dumps(_drive(int(sys.argv[1]), int(sys.argv[2]))))
