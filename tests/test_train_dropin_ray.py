"""The drop-in on a real TorchTrainer run (gloo, 2 workers, CPU): a plain Ray Train script,
converted by changing its imports and wrapping its optimizer, runs guarded.

One Ray instance (with its dashboard: the state API lists the actors) and one run carry the
checks:

* the conversion is exactly the import line, the optimizer line and the two lines that honour
  a stop (a textual diff of the two scripts);
* rank 1 is slow in compute (its model sleeps in forward): the guard names it the compute
  straggler;
* the DataLoader's ``num_workers=1, prefetch_factor=4, persistent_workers=True`` survive (Ray's
  own ``prepare_data_loader`` gives back ``prefetch_factor`` 2);
* a stop requested from the driver while the run is live is honoured by both ranks at the same
  step, a lockstep agreement step;
* the guard's named actors are listed by Ray's state API while the run is live, and are gone
  after it;
* rank 1 fails once early on (``FailureConfig(max_failures=1)``): Ray Train's controller
  callback (``UserCallback.after_exception``) reports the failure, the coordinator counts two
  attempts, and its report rounds (``after_report``) are counted.
"""

from __future__ import annotations

import difflib
import os
import re
import threading
import time
import types

import pytest

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

NS = "rtg_test_dropin"
RUN_NAME = "dropin_test"

# The plain script, as a Ray Train user writes it (the issue's), with a toy model and data and
# one slow rank: the environment the guard must see through.
PLAIN = '''\
import os
import time

import ray
import ray.train
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, prepare_model, prepare_data_loader
from torch.utils.data import DataLoader, TensorDataset


class Batches(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 32, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


FAIL_ONCE = None            # a path: rank 1's first attempt fails there once


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 1))

    def forward(self, x):
        if ray.train.get_context().get_world_rank() == 1:
            time.sleep(0.02)                  # rank 1 is slow in compute
            if FAIL_ONCE and not os.path.exists(FAIL_ONCE):
                open(FAIL_ONCE, "w").close()
                raise RuntimeError("rank 1 fails once")
        return self.net(x)


def make_model():
    torch.manual_seed(0)
    return Model()


ds = Batches(1024)
loss_fn = torch.nn.functional.mse_loss


def train_func(config):
    model = prepare_model(make_model())
    loader = prepare_data_loader(DataLoader(ds, batch_size=8, shuffle=True, num_workers=1,
                                            prefetch_factor=4, persistent_workers=True))
    opt = torch.optim.AdamW(model.parameters())
    for epoch in range(config["epochs"]):
        if ray.train.get_context().get_world_size() > 1:
            loader.sampler.set_epoch(epoch)
        for batch in loader:
            loss = loss_fn(model(batch["x"]), batch["y"]); loss.backward(); opt.step(); opt.zero_grad()
        ray.train.report({"loss": loss.item()})
'''

IMPORT = "from ray.train.torch import TorchTrainer, prepare_model, prepare_data_loader"
GUARD_IMPORT = ("from raytrain_guard.train import TorchTrainer, get_guard, prepare_data_loader, "
                "prepare_model, prepare_optimizer")
OPT = "    opt = torch.optim.AdamW(model.parameters())"
GUARD_OPT = "    opt = prepare_optimizer(torch.optim.AdamW(model.parameters()))"
STEP = ("            loss = loss_fn(model(batch[\"x\"]), batch[\"y\"]); loss.backward(); "
        "opt.step(); opt.zero_grad()")
REPORT = '        ray.train.report({"loss": loss.item()})'
STOP_IN_EPOCH = "            if get_guard().should_stop(): break"
STOP_AFTER_REPORT = "        if get_guard().should_stop(): break"


def convert(plain: str) -> str:
    """The conversion the README shows: the import, the optimizer, and honouring a stop."""
    lines = plain.splitlines()
    out = []
    for line in lines:
        if line == IMPORT:
            out.append(GUARD_IMPORT)
        elif line == OPT:
            out.append(GUARD_OPT)
        else:
            out.append(line)
        if line == STEP:
            out.append(STOP_IN_EPOCH)
        if line == REPORT:
            out.append(STOP_AFTER_REPORT)
    return "\n".join(out) + "\n"


def load(source: str, name: str) -> types.ModuleType:
    """The script as a module that is not importable, so Ray pickles its functions by value."""
    module = types.ModuleType(name)
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)   # noqa: S102 - our own text
    return module


def test_the_conversion_is_the_imports_the_optimizer_and_the_stop_lines():
    diff = [line for line in difflib.unified_diff(PLAIN.splitlines(), convert(PLAIN)
                                                  .splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert diff == ["-" + IMPORT, "+" + GUARD_IMPORT, "-" + OPT, "+" + GUARD_OPT,
                    "+" + STOP_IN_EPOCH, "+" + STOP_AFTER_REPORT]


@pytest.fixture(scope="module")
def ray_with_dashboard():
    context = ray.init(address="local", namespace=NS, num_cpus=4, include_dashboard=True,
                       logging_level="warning", log_to_driver=False)
    try:
        # the state API's address: other Ray instances may run on this machine
        yield "http://" + context.dashboard_url
    finally:
        ray.shutdown()


def _scrape() -> str:
    import urllib.request
    port = next(n["MetricsExportPort"] for n in ray.nodes() if n["Alive"])
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read() \
            .decode()
    except OSError:
        return ""


def _labelled(body: str, metric: str, run_name: str) -> set[str]:
    """The world ranks of ``metric``'s series labelled with ``run_name``."""
    ranks = set()
    for line in body.splitlines():
        if line.startswith(metric + "{") and f'ray_train_run_name="{run_name}"' in line:
            found = re.search(r'ray_train_worker_world_rank="(\d+)"', line)
            if found:
                ranks.add(found.group(1))
    return ranks


class Watcher(threading.Thread):
    """While the run is live: lists the guard's actors through Ray's state API, scrapes the
    node's metrics endpoint until both ranks' step gauges are there, and once Ray Train's
    controller has seen a report round, asks the run to stop."""

    def __init__(self, trainer, state_address: str) -> None:
        super().__init__(daemon=True)
        self.trainer = trainer
        self.state_address = state_address
        self.metrics = ""
        self.actor_names: set[str] = set()
        self.stop_requested_at_step = None
        self.error = None
        self.done = threading.Event()

    def run(self) -> None:
        from ray.util.state import list_actors

        from raytrain_guard.coordination.client import coordinator_name
        try:
            deadline = time.monotonic() + 300
            coordinator = None
            while time.monotonic() < deadline and not self.done.is_set():
                time.sleep(0.5)
                if coordinator is None:
                    try:
                        coordinator = ray.get_actor(coordinator_name(self.trainer.run_id),
                                                    namespace=NS)
                    except ValueError:
                        continue
                if coordinator_name(self.trainer.run_id) not in self.actor_names:
                    # the state API follows the GCS with a lag: list until it shows both kinds
                    self.actor_names = {a.name for a in list_actors(
                        address=self.state_address, filters=[("state", "=", "ALIVE")],
                        limit=1000) if a.name}
                    continue
                if _labelled(self.metrics, "ray_raytrain_guard_rank_step_seconds",
                             RUN_NAME) != {"0", "1"}:
                    self.metrics = _scrape()     # gauges are exported every ~10 s
                    continue
                events = ray.get(coordinator.train_events.remote(), timeout=10)
                if any(e["kind"] == "report" for e in events):
                    status = ray.get(coordinator.status.remote(), timeout=10)
                    self.stop_requested_at_step = status["latest_step"]
                    self.trainer.request_stop("the test asks")
                    return
        except Exception as exc:  # noqa: BLE001 - surfaced by the test
            self.error = exc


def test_converted_script_runs_guarded(ray_with_dashboard):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.util.state import list_actors

    from raytrain_guard.cluster.actors import MONITOR_PREFIX
    from raytrain_guard.config import GuardConfig
    from raytrain_guard.coordination.client import coordinator_name

    script = load(convert(PLAIN), "converted_script")
    tmp = _tmp()
    script.FAIL_ONCE = os.path.join(tmp, "failed_once")
    trainer = script.TorchTrainer(
        script.train_func, train_loop_config={"epochs": 30},     # the stop ends it
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=RUN_NAME, storage_path=tmp,
                             failure_config=FailureConfig(max_failures=1)),
        guard={"namespace": NS, "decision_interval_s": 1e9})     # no policy decisions: only ours
    watcher = Watcher(trainer, ray_with_dashboard)
    watcher.start()
    try:
        result = trainer.fit()
    finally:
        watcher.done.set()
        watcher.join(timeout=30)
    report = result.guard
    print(report.format())
    assert watcher.error is None, watcher.error
    assert result.error is None

    # the actors were listed by name while the run was live, and are gone now
    assert coordinator_name(trainer.run_id) in watcher.actor_names
    monitors = {n for n in watcher.actor_names
                if n.startswith(f"{MONITOR_PREFIX}{trainer.run_id}:")}
    assert len(monitors) == 1                       # one node, one monitor
    alive = {a.name for a in list_actors(address=ray_with_dashboard,
                                         filters=[("state", "=", "ALIVE")], limit=1000)}
    assert not alive & ({coordinator_name(trainer.run_id)} | monitors)

    # a stop requested from the driver: every rank stopped at the same agreement step
    ranks = {r["world_rank"]: r for r in report.ranks}
    assert sorted(ranks) == [0, 1]
    stopped = {r: s["stopped_at"] for r, s in ranks.items()}
    k = GuardConfig().lockstep_every_steps
    assert stopped[0] == stopped[1] and stopped[0] % k == 0, stopped
    assert stopped[0] > watcher.stop_requested_at_step, (stopped, watcher.stop_requested_at_step)
    assert ranks[0]["step"] == ranks[1]["step"] == stopped[0]
    assert report.run.stopped_early and "the test asks" in report.run.stop_reason
    assert report.run.steps == stopped[0] < 30 * 64

    # per-rank metrics with Ray Train's labels, the same values as Ray Train's own series
    for metric in ("ray_raytrain_guard_rank_step_seconds", "ray_raytrain_guard_rank_phase_seconds",
                   "ray_raytrain_guard_rank_memory_frac"):
        assert _labelled(watcher.metrics, metric, RUN_NAME) == {"0", "1"}, metric
    ray_own = _labelled(watcher.metrics, "ray_train_report_total_blocked_time_s", RUN_NAME)
    # Ray Train's own series, where it had exported them when the watcher scraped (a rank's
    # may come a report later), carry the same labels: they join
    assert ray_own <= {"0", "1"}
    print("Ray Train's own series with the same labels:", sorted(ray_own))

    # the slow rank is attributed, with its reason
    roles = {a["world_rank"]: a for a in report.attribution}
    assert roles[1]["role"] == "straggler_compute", roles
    assert roles[0]["role"] != "straggler_compute", roles
    assert "rank 1: compute" in roles[1]["reason"]

    # the DataLoader settings survive (Ray's prepare_data_loader gives prefetch_factor 2)
    for loader in report.loaders:
        assert (loader["num_workers"], loader["prefetch_factor"], loader["persistent_workers"],
                loader["batch_size"]) == (1, 4, True, 8), loader
        assert loader["lowered"] == []
        assert loader["data_wait_frac"] is not None

    # DDP got the planned bucket cap
    model = ranks[0]["model"]
    assert model["wrapped"] == "DistributedDataParallel"
    assert model["bucket_cap_bytes"] == int(model["bucket_cap_mb"] * 2**20)

    # Ray Train's controller callback: rank 1's failure, then a second attempt that reported
    assert os.path.exists(script.FAIL_ONCE)
    assert [f["ranks"] for f in report.worker_failures] == [[1]], report.worker_failures
    assert "rank 1 fails once" in report.worker_failures[0]["errors"]["1"]
    assert report.attempts == 2
    assert report.num_reports >= 1


def _tmp():
    import tempfile
    return tempfile.mkdtemp(prefix="rtg-dropin-")
