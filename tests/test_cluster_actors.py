"""Monitors and coordinator as real Ray actors on a 3-node cluster on this machine.

One ``ray.cluster_utils.Cluster`` (3 nodes of num_cpus=1, all on the same IP) for the module.
"""

from __future__ import annotations

import os
import time
import urllib.request

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from raytrain_guard.cluster.actors import (  # noqa: E402
    MONITOR_PREFIX,
    coordinator_name,
    monitor_name,
    start_coordinator,
    start_monitors,
    stop_all,
)
from raytrain_guard.cluster.monitor.probes import ScriptedProbeFactory  # noqa: E402
from raytrain_guard.config import GuardConfig  # noqa: E402
from raytrain_guard.coordination.link import register_worker_with_monitor  # noqa: E402
from raytrain_guard.core.node_samples import GpuSample  # noqa: E402
from raytrain_guard.core.steps import StepStats  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

NS = "rtg_test_cluster_actors"
RUN = "run-a"
CFG = GuardConfig(monitor_interval_s=0.2, decision_interval_s=1e9)


# One fake 80 GiB GPU per node at 50 %, holding the node's registered workers; real psutil
# host probe.
scripted_probes = ScriptedProbeFactory([[GpuSample(0, 40 * 2**30, 80 * 2**30, 0.9, 60.0, 300.0)]],
                                       worker_gpus=(0,))


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, namespace=NS)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def actors(cluster):
    coord = start_coordinator(NS, RUN, CFG)
    monitors = start_monitors(NS, RUN, CFG, probe_factory=scripted_probes)
    yield coord, monitors
    stop_all(NS, RUN)


def wait_for(predicate, timeout_s=60.0, every_s=0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError("condition not met in time")


def alive_nodes():
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def test_exactly_one_monitor_per_node_named_and_placed(actors):
    _, monitors = actors
    nodes = alive_nodes()
    assert len(nodes) == 3 and set(monitors) == nodes
    named = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == NS and a["name"].startswith(MONITOR_PREFIX)}
    assert named == {monitor_name(RUN, n) for n in nodes}
    for node_id, handle in monitors.items():
        assert ray.get(handle.where.remote()) == node_id      # node affinity held
    again = start_monitors(NS, RUN, CFG, probe_factory=scripted_probes)   # idempotent
    assert {n: h._actor_id for n, h in again.items()} == \
        {n: h._actor_id for n, h in monitors.items()}


def test_monitors_sample_and_reach_the_coordinator(actors):
    coord, _ = actors
    status = wait_for(lambda: (lambda s: s if set(s["nodes"]) == alive_nodes() else None)(
        ray.get(coord.status.remote())))
    for node_id, node in status["nodes"].items():
        assert node["gpus"][0]["memory_frac"] == 0.5 and node["host"]["memory_total_bytes"] > 0
        assert node["gpu_error"] is None and node["seq"] >= 1


def _scrape(port):
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return ""


def _gauge_lines(body, name, node_id):
    return [line for line in body.splitlines()
            if line.startswith(name + "{") and f'node_id="{node_id}"' in line]


def test_metrics_on_each_nodes_ray_metrics_endpoint(actors):
    """Each node's Prometheus endpoint (Ray's metrics agent) shows its monitor's gauges,
    prefixed ray_raytrain_guard_, tagged with the node id and the GPU index."""
    for n in ray.nodes():
        if not n["Alive"]:
            continue
        node_id, port = n["NodeID"], n["MetricsExportPort"]
        # one scrape that shows the GPU gauge (a scrape can time out on a loaded box: retried)
        body = wait_for(lambda: (lambda b: b if _gauge_lines(
            b, "ray_raytrain_guard_gpu_memory_frac", node_id) else None)(_scrape(port)),
            timeout_s=60, every_s=1.0)
        lines = _gauge_lines(body, "ray_raytrain_guard_gpu_memory_frac", node_id)
        assert 'gpu="0"' in lines[0] and lines[0].rsplit(" ", 1)[1] == "0.5"
        assert _gauge_lines(body, "ray_raytrain_guard_host_memory_used_frac", node_id)
        assert _gauge_lines(body, "ray_raytrain_guard_gpu_throttled", node_id)


def test_worker_registration_reaches_its_nodes_monitor(actors):
    coord, _ = actors

    @ray.remote(num_cpus=0)
    class Worker:
        def register(self):
            return register_worker_with_monitor(NS, RUN, world_rank=7)

        def ids(self):
            return os.getpid(), ray.get_runtime_context().get_node_id()

    w = Worker.remote()
    assert ray.get(w.register.remote()) is True
    pid, node_id = ray.get(w.ids.remote())
    sample = wait_for(lambda: (lambda s: s if s and any(
        x["pid"] == pid for x in s["host"]["workers"]) else None)(
        ray.get(coord.status.remote())["nodes"].get(node_id)))
    (mine,) = [x for x in sample["host"]["workers"] if x["pid"] == pid]
    assert mine["world_rank"] == 7 and mine["private_bytes"] > 0
    assert pid in sample["gpus"][0]["process_pids"]     # the GPU holding it says so
    ray.kill(w)


def _report(coord, rank, node_id, first, *, slow=False, attempt=0):
    compute, comm = (0.9, 0.05) if slow else (0.5, 0.45)
    stats = [StepStats(s, 1.0, 0.05, compute, 0.0, comm, 0.0, 0.4, rank).to_dict()
             for s in range(first, first + 10)]
    return coord.report_steps.remote(rank, node_id, attempt, stats, {"micro_batch": 4,
                                                                      "grad_accum": 1})


def test_coordinator_names_the_straggler_node(actors):
    coord, _ = actors
    nodes = sorted(alive_nodes())
    slow_node = nodes[2]
    for first in (1, 11):
        for rank, node_id in enumerate(nodes):
            _report(coord, rank, node_id, first, slow=node_id == slow_node)
    decisions = ray.get(coord.decide.remote())
    flags = [d for d in decisions if d["action"] == "flag_straggler"]
    assert [d["params"]["node_id"] for d in flags] == [slow_node]
    assert flags[0]["params"]["world_ranks"] == [2] and flags[0]["cause"] == "compute"
    fetched = ray.get(coord.decisions_since.remote(0))
    assert flags[0] in fetched
    assert ray.get(coord.status.remote())["straggler_nodes"] == [slow_node]


def test_killed_coordinator_restarts_and_accepts_reports(actors):
    coord, _ = actors
    before = ray.get(coord.status.remote())
    assert before["num_reports"] > 0
    ray.kill(coord, no_restart=False)
    status = wait_for(lambda: (lambda s: s if s and s["incarnation"] != before["incarnation"]
                               else None)(_try_status(coord)), timeout_s=120)
    assert status["num_reports"] == 0                   # state rebuilt from new reports only
    node_id = sorted(alive_nodes())[0]
    ray.get(_report(coord, 0, node_id, 101))
    after = ray.get(coord.status.remote())
    assert after["num_reports"] == 1 and after["ranks"][0]["step"] == 110
    # the monitors found the restarted coordinator again (same handle, same name)
    wait_for(lambda: ray.get(coord.status.remote())["num_node_samples"] > 0, timeout_s=60)
    assert ray.get_actor(coordinator_name(RUN), namespace=NS)._actor_id == coord._actor_id


def test_killed_monitor_restarts_on_its_node(actors):
    coord, monitors = actors
    node_id, handle = sorted(monitors.items())[1]

    def epoch():
        status = _try_status(coord) or {}
        return status.get("nodes", {}).get(node_id, {}).get("monitor_epoch")
    before = wait_for(epoch)
    ray.kill(handle, no_restart=False)
    wait_for(lambda: epoch() not in (None, before), timeout_s=120)   # the new monitor's samples
    assert ray.get(handle.where.remote()) == node_id


def test_two_runs_in_one_namespace_keep_their_own_monitors(actors):
    """A second run (run-b, its GPUs scripted at 70 %) beside run-a: its own monitors, named
    per run, feed its own coordinator; stopping run-b leaves run-a's actors alive."""
    coord_a, monitors_a = actors
    coord_b = start_coordinator(NS, "run-b", CFG)
    monitors_b = start_monitors(NS, "run-b", CFG, probe_factory=ScriptedProbeFactory(
        [[GpuSample(0, 56 * 2**30, 80 * 2**30)]]))
    assert {h._actor_id for h in monitors_b.values()}.isdisjoint(
        h._actor_id for h in monitors_a.values())
    status_b = wait_for(lambda: (lambda s: s if set(s["nodes"]) == alive_nodes() else None)(
        ray.get(coord_b.status.remote())))
    assert {n["gpus"][0]["memory_frac"] for n in status_b["nodes"].values()} == {0.7}
    time.sleep(3 * CFG.monitor_interval_s)       # run-a's coordinator still sees only run-a's
    assert {n["gpus"][0]["memory_frac"] for n in ray.get(coord_a.status.remote())[
        "nodes"].values()} == {0.5}
    killed = stop_all(NS, "run-b")
    assert sorted(killed) == sorted([coordinator_name("run-b")] +
                                    [monitor_name("run-b", n) for n in monitors_b])
    left = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NS}
    assert {monitor_name(RUN, n) for n in monitors_a} | {coordinator_name(RUN)} <= left
    assert not any(n.startswith(monitor_name("run-b", "")) for n in left)
    assert ray.get([h.where.remote() for h in monitors_a.values()])  # run-a's still answer


def test_client_asks_for_an_attempt_and_the_step_path_calls_no_ray(cluster, monkeypatch):
    """A rank's real client and lockstep source against a real coordinator (run-d): rank 0's
    attempt comes from the coordinator; over 40 steps at K=N=10 the training thread makes no
    Ray call (the link's thread sends, fetches and waits), and the reports arrive."""
    import threading

    from raytrain_guard.coordination.client import (
        CoordinatorClient,
        LockstepDecisionSource,
        fetch_attempt,
    )
    from raytrain_guard.coordination.lockstep import Lockstep
    coord = start_coordinator(NS, "run-d", CFG)
    try:
        attempt = fetch_attempt(coordinator_name("run-d"), NS)
        assert attempt == 1 and fetch_attempt(coordinator_name("run-d"), NS) == 2
        client = CoordinatorClient(coordinator_name("run-d"), namespace=NS, world_rank=0,
                                   node_id="n0", report_every_steps=10, attempt=2)
        wait_for(lambda: client.connected)          # the lookup runs on the link's thread
        calls = []
        for name in ("get", "wait", "get_actor"):
            real = getattr(ray, name)
            monkeypatch.setattr(ray, name, lambda *a, _real=real, _name=name, **k: calls.append(
                (_name, threading.current_thread() is threading.main_thread())) or
                _real(*a, **k))
        source = LockstepDecisionSource(Lockstep(every_steps=10), client)
        for step in range(1, 41):
            source.poll(step, [StepStats(step - 1, 0.1, memory_frac=0.5)])
        client.flush()
        assert calls and not any(main for _, main in calls), calls
        monkeypatch.undo()
        status = wait_for(lambda: (lambda s: s if s["num_reports"] == 4 else None)(
            ray.get(coord.status.remote())))
        assert status["attempt"] == 2 and status["ranks"][0]["step"] == 39
        assert status["ignored"]["malformed"] == 0 and client.num_reports_dropped == 0
    finally:
        stop_all(NS, "run-d")


def _try(fn):
    try:
        return fn()
    except Exception:  # noqa: BLE001 - restarting
        return None


def _try_status(coord):
    return _try(lambda: ray.get(coord.status.remote(), timeout=5))
