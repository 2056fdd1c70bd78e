"""The Grafana dashboard against a real Prometheus scraping a guarded 2-rank run.

Debian's Prometheus (``apt-get install prometheus``) scrapes, every 2 s, a Ray node this module
starts (its dashboard on, so Ray writes the ``prom_metrics_service_discovery.json`` that the
scrape config reads, as in Ray's own metrics setup; Ray exports every 2 s). On it runs one
guarded run built as the launcher builds it (a node monitor, the coordinator, two gloo ranks of
``train_loop_per_worker`` reporting to it), on CPU:

* rank 1's forward is delayed 30 ms up to step ``SWITCH``, rank 0's from there on: each is the
  compute straggler in turn, rank 0's cause changes, and each rank's score must stay one line;
* rank 1's forward takes 0.4 s at 4 steps: slow-step decisions on the ranks;
* the driver requests a stop twice: 2 cluster decisions of one action (``checkpoint_and_stop``);
* after the run, both ranks' hang records reach the coordinator as their watchdogs send them:
  one hang verdict.

The module holds the actors until Prometheus has scraped the last counters (the launcher would
tear them down at once), then evaluates every panel's, annotation's and variable's query
through Prometheus's HTTP API over the run, with ``$run`` and ``$node`` as Grafana substitutes
them (a range query, as a panel makes). Every target of every panel returns data but the
:data:`~raytrain_guard.cluster.grafana.GPU_PANELS`, which return none (no GPU here), and the
Decisions panel reads the 2 stop requests as 2.

Without a ``prometheus`` binary the module skips, naming the install line; where ``CI`` or
``RAYTRAIN_GUARD_REQUIRE_PROMETHEUS`` is set it fails instead.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from examples import toy
from raytrain_guard.cluster.grafana import GPU_PANELS, dashboard

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

NS = "rtg_test_prometheus"
RUN_ID = "prom"
RUN_NAME = f"raytrain_guard_{RUN_ID}"      # the launcher's Ray Train run name for RUN_ID
INSTALL = "apt-get update && apt-get install -y prometheus"
SCRAPE_S = 2
SWITCH = 100            # the step the 30 ms forward delay moves from rank 1 to rank 0
SPIKE = 40              # rank 1's forward takes 0.4 s at steps SPIKE..SPIKE+3
STOPS = 2               # stop requests: cluster decisions of one action


def _required() -> bool:
    return any(os.environ.get(name, "").lower() not in ("", "0", "false")
               for name in ("CI", "RAYTRAIN_GUARD_REQUIRE_PROMETHEUS"))


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _until(what: str, check, timeout_s: float, every_s: float = 1.0):
    """Call ``check`` until it returns something truthy; fail naming ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


class Prometheus:
    """Debian's ``prometheus`` on 127.0.0.1, scraping the targets of Ray's service discovery
    file; ended with :meth:`stop`."""

    def __init__(self, binary: str, sd_file: str, workdir: str) -> None:
        (port,) = _free_ports(1)
        self.base = f"http://127.0.0.1:{port}"
        config = Path(workdir, "prometheus.yml")
        config.write_text(
            f"global:\n  scrape_interval: {SCRAPE_S}s\n  scrape_timeout: {SCRAPE_S}s\n"
            f"scrape_configs:\n  - job_name: ray\n    file_sd_configs:\n"
            f"      - files: ['{sd_file}']\n        refresh_interval: 5s\n")
        self.log = open(Path(workdir, "prometheus.log"), "w")   # noqa: SIM115 - its lifetime
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir}/tsdb",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        _until("prometheus to be ready", self._ready, 60)

    def _ready(self) -> bool:
        assert self.proc.poll() is None, Path(self.log.name).read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"{self.base}/-/ready", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def api(self, path: str, **params) -> object:
        url = f"{self.base}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=60) as r:
                body = json.load(r)
        except urllib.error.HTTPError as err:      # a query Prometheus refuses: say which
            pytest.fail(f"{path} {params}: HTTP {err.code} {err.read().decode()[:500]}")
        assert body["status"] == "success", body
        return body["data"]

    def range(self, expr: str, start: float, end: float) -> list[dict]:
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}",
                        step=SCRAPE_S)["result"]

    def now(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def prometheus_and_ray():
    binary = shutil.which("prometheus")
    if binary is None:
        message = f"needs Debian's Prometheus: `{INSTALL}` (as root)"
        if _required():
            pytest.fail(message + " (CI / RAYTRAIN_GUARD_REQUIRE_PROMETHEUS is set)")
        pytest.skip(message)
    from ray import cloudpickle
    cloudpickle.register_pickle_by_value(toy)

    temp = tempfile.mkdtemp(prefix="rtgp", dir="/tmp")     # short: Unix socket paths
    metrics_port, dashboard_port = _free_ports(2)
    old = os.environ.get("RAY_metrics_report_interval_ms")
    os.environ["RAY_metrics_report_interval_ms"] = "2000"   # Ray's default is 10 s
    prometheus = None
    try:
        ray.init(address="local", namespace=NS, num_cpus=4, include_dashboard=True,
                 dashboard_port=dashboard_port, _metrics_export_port=metrics_port,
                 _temp_dir=temp, logging_level="warning", log_to_driver=False)
        sd_file = os.path.join(temp, "prom_metrics_service_discovery.json")
        _until("Ray's service discovery file to list the metrics port",
               lambda: os.path.exists(sd_file) and f":{metrics_port}" in Path(sd_file).read_text(),
               60)
        prometheus = Prometheus(binary, sd_file, temp)
        yield prometheus
    finally:
        if prometheus is not None:
            prometheus.stop()
        ray.shutdown()
        if old is None:
            os.environ.pop("RAY_metrics_report_interval_ms", None)
        else:
            os.environ["RAY_metrics_report_interval_ms"] = old
        shutil.rmtree(temp, ignore_errors=True)


def _loop_config(guard, source) -> dict:
    delay = functools.partial(dict, phase="forward")
    return {"model_factory": toy.make_model,
            "dataset_factory": functools.partial(toy.make_dataset, 256),
            "optimizer_factory": toy.make_optimizer, "loss_fn": toy.loss_fn,
            "micro_batch": 8, "epochs": 100, "num_workers": 0, "measure_bandwidth": False,
            "checkpoint_every_steps": 10_000, "guard": guard, "decision_source": source,
            "rehearsal": "raytrain_guard.experiment.rehearsal:build_rehearsal",
            "faults": {"delay": [delay(seconds=0.03, ranks=[1], steps=[0, SWITCH]),
                                 delay(seconds=0.03, ranks=[0], steps=[SWITCH, 10**6]),
                                 delay(seconds=0.4, ranks=[1], steps=[SPIKE, SPIKE + 4])]}}


def _hang_record(rank: int, phase: str, progress_s: float, node_id: str) -> dict:
    """What a rank's watchdog sends (runtime.guard.watchdog): stuck 10 s into step 150."""
    return {"world_rank": rank, "node_id": node_id, "step": 150, "world_size": 2,
            "phase": phase, "phase_for_s": 10.0 - progress_s, "step_for_s": 10.0,
            "last_progress_wall": time.time() - 10.0 + progress_s, "in_collective": False,
            "where": "threading.py:355 wait"}


@pytest.fixture(scope="module")
def scraped_run(prometheus_and_ray, tmp_path_factory):
    """The guarded run, scraped; returns (prometheus, start, end, node id)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytrain_guard.cluster.actors import start_coordinator, start_monitors, stop_all
    from raytrain_guard.config import GuardConfig
    from raytrain_guard.coordination.client import ClusterDecisionSource
    from raytrain_guard.runtime.loop.train_loop import train_loop_per_worker

    prom = prometheus_and_ray
    guard = GuardConfig()
    start = time.time()
    outcome: dict = {}
    try:
        # the launcher's building blocks, without its teardown right after fit()
        monitors = start_monitors(NS, RUN_ID, guard)
        coordinator = start_coordinator(NS, RUN_ID, guard, run_name=RUN_NAME)
        (node_id,) = monitors
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config=_loop_config(guard, ClusterDecisionSource(RUN_ID, NS, guard)),
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name=RUN_NAME,
                                 storage_path=str(tmp_path_factory.mktemp("storage"))))

        def fit() -> None:
            try:
                outcome["result"] = trainer.fit()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
                outcome["error"] = exc

        fitting = threading.Thread(target=fit, daemon=True)
        fitting.start()
        # until Prometheus holds rank 0's turn as the compute straggler (after SWITCH)
        cause = f'ray_raytrain_guard_straggler_cause{{ray_train_run_name="{RUN_NAME}"}} == 1'
        _until("rank 0 scored the compute straggler in Prometheus", lambda: "error" in outcome
               or any(s["metric"].get("ray_train_worker_world_rank") == "0"
                      and s["metric"].get("cause") == "compute" for s in prom.now(cause)), 300)
        for i in range(STOPS):
            ray.get(coordinator.request_stop.remote(f"dashboard test, request {i + 1}"))
        fitting.join(timeout=300)
        assert not fitting.is_alive(), "the run did not stop"
        if "error" in outcome:
            raise outcome["error"]
        attempt = ray.get(coordinator.status.remote())["attempt"]
        for rank, phase, progress_s in ((0, "backward", 0.03), (1, "forward", 0.002)):
            ray.get(coordinator.report_hang.remote(rank, node_id, attempt,
                                                   _hang_record(rank, phase, progress_s, node_id)))
        # the coordinator's last counters, scraped before its actor goes
        _until("the stop requests and the hang counted in Prometheus", lambda: (
            prom.now(f'sum(ray_raytrain_guard_decisions_total{{action="checkpoint_and_stop",'
                     f'ray_train_run_name="{RUN_NAME}"}}) == {STOPS}')
            and prom.now("ray_raytrain_guard_hangs_total")), 60)
        time.sleep(2 * SCRAPE_S)
        yield prom, start, time.time(), node_id
    finally:
        stop_all(NS, RUN_ID)


def _grafana(expr: str, node: str = ".*") -> str:
    """``expr`` as Grafana sends it with ``run`` set to the run and ``node`` to All (its
    allValue) or one node."""
    return expr.replace("$run", re.escape(RUN_NAME)).replace("$node", node)


def _panels():
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def test_every_panel_returns_data_but_the_gpu_panels(scraped_run):
    prom, start, end, node_id = scraped_run
    empty, full = [], []
    for panel in _panels():
        for target in panel["targets"]:
            found = prom.range(_grafana(target["expr"]), start, end)
            (full if found else empty).append((panel["title"], target["refId"]))
            if panel["title"] in GPU_PANELS:
                continue
            # a node panel on one node, as with $node set to it
            if "$node" in target["expr"]:
                assert prom.range(_grafana(target["expr"], re.escape(node_id)), start, end), \
                    (panel["title"], target["expr"])
    gpu = {(p["title"], t["refId"]) for p in _panels() if p["title"] in GPU_PANELS
           for t in p["targets"]}
    assert set(empty) == gpu, ("empty", sorted(empty))
    assert gpu and not gpu & set(full)


def test_every_variable_has_values_on_a_cpu_run(scraped_run):
    prom, start, end, node_id = scraped_run
    values = {}
    for variable in dashboard()["templating"]["list"]:
        if "definition" not in variable:
            continue
        metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)",
                                     variable["definition"]).groups()
        values[variable["name"]] = prom.api(f"label/{label}/values", **{"match[]": metric},
                                            start=f"{start:.3f}", end=f"{end:.3f}")
    assert RUN_NAME in values["run"], values
    assert node_id in values["node"], values          # no GPU on this node


def test_two_decisions_of_one_action_read_as_two(scraped_run):
    prom, start, end, _ = scraped_run
    decisions = next(p for p in _panels() if p["title"] == "Decisions")
    cluster = prom.range(_grafana(decisions["targets"][0]["expr"]), start, end)
    stops = [s for s in cluster if s["metric"].get("action") == "checkpoint_and_stop"]
    assert len(stops) == 1, cluster
    assert max(float(v) for _, v in stops[0]["values"]) == STOPS, stops
    ranks = prom.range(_grafana(decisions["targets"][1]["expr"]), start, end)
    assert {s["metric"]["ray_train_worker_world_rank"] for s in ranks} == {"0", "1"}, ranks
    for annotation in dashboard()["annotations"]["list"]:      # each decision kind marked
        assert prom.range(_grafana(annotation["expr"]), start, end), annotation["name"]


def test_a_rank_is_one_straggler_line_whatever_its_cause(scraped_run):
    prom, start, end, _ = scraped_run
    panels = {p["title"]: p for p in _panels()}
    scores = prom.range(_grafana(panels["Straggler scores"]["targets"][0]["expr"]), start, end)
    assert sorted(s["metric"]["ray_train_worker_world_rank"] for s in scores) == ["0", "1"], \
        [s["metric"] for s in scores]
    causes = prom.range(_grafana(panels["Straggler cause"]["targets"][0]["expr"]), start, end)
    seen = {(s["metric"]["ray_train_worker_world_rank"], s["metric"]["cause"]) for s in causes}
    # the delay moved from rank 1 to rank 0: each was the compute straggler, and rank 0 had
    # another cause before (unknown, or data where its data wait ran over rank 1's)
    assert {("0", "compute"), ("1", "compute")} <= seen, seen
    assert len({cause for rank, cause in seen if rank == "0"}) >= 2, seen


def test_the_hang_is_on_its_panel(scraped_run):
    prom, start, end, node_id = scraped_run
    hangs = next(p for p in _panels() if p["title"] == "Hangs")
    found = prom.range(_grafana(hangs["targets"][0]["expr"]), start, end)
    assert [(s["metric"]["ray_train_worker_world_rank"], s["metric"]["phase"],
             s["metric"]["node_id"]) for s in found] == [("1", "forward", node_id)], found
