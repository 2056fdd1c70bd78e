"""An elastic run that loses a worker finishes on the one left, with the same global batch and
every sample of every epoch consumed exactly once (real TorchTrainer, gloo, CPU).

``ray.cluster_utils.Cluster``: a head for the controller and two 1-CPU nodes with one
``elastic_slot`` each, so a worker runs on each and ``ScalingConfig(num_workers=(1, 2))`` starts
at 2. Once Ray Train has a checkpoint (a controller callback drops a marker), the driver removes
one slot node: its worker dies, the group fails (``FailureConfig`` retries it; the resize
monitor only resizes a healthy group), and Ray restarts it from the latest checkpoint at the size
the cluster still holds (1: Ray Train counts workers from the alive nodes' resources,
``ray/train/v2/_internal/execution/scaling_policy/elastic.py``).

64 samples, global batch 8: micro-batch 2 x accumulation 2 x 2 workers, then 2 x 4 x 1; 8 steps
an epoch, 2 epochs. Rank 1's samples sleep 0.2 s each, so the world-2 part outlasts the node
removal and the world-1 part (no rank 1) is quick. About 70 s on 2 cores, most of it Ray
starting worker processes.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster

from examples import toy
from raytrain_guard.runtime.loop.train_loop import train_loop_per_worker

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
SAMPLES, GLOBAL_BATCH, STEPS_PER_EPOCH, EPOCHS = 64, 8, 8, 2
# a group Ray sized from a stale view of the cluster waits this long for its placement group,
# then is sized again (default 60 s)
ENV = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "4"}


@pytest.fixture(scope="module")
def cluster():
    from ray import cloudpickle

    old = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    cloudpickle.register_pickle_by_value(toy)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    slots = [c.add_node(num_cpus=1, resources={"elastic_slot": 1}) for _ in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level="warning", log_to_driver=False)
    try:
        yield c, slots
    finally:
        ray.shutdown()
        c.shutdown()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _checkpoint_marker(path: str, at_step: int):
    """A controller callback that writes ``path`` once Ray Train holds a checkpoint of a step
    at or after ``at_step`` (the checkpoint manager takes a report before user callbacks)."""

    class CheckpointMarker(ray.train.UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            if checkpoint is not None and metrics and metrics[0].get("step", 0) >= at_step:
                Path(path).touch()

    return CheckpointMarker()


def _remove_node(c: Cluster, node) -> None:
    """Remove ``node`` and wait until Ray counts it dead; then have Ray Train's autoscaling
    coordinator re-read the nodes now instead of at its next 20 s tick (a private actor: if it is
    not there, the tick comes anyway and the run only takes longer)."""
    c.remove_node(node)
    for _ in range(300):
        if not any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()):
            break
        threading.Event().wait(0.1)
    try:
        coordinator = ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator")
        ray.get(coordinator.get_reserved_resources.remote("rtg-test", recompute=True), timeout=10)
    except Exception:                # a nudge only: Ray's own tick follows within 20 s
        logging.getLogger(__name__).info("coordinator not nudged", exc_info=True)


def _lineage(audit: Path) -> dict[int, list[dict]]:
    """{step: audit records} of the lineage that finished. A group resumed from a later
    checkpoint supersedes the steps an earlier group ran past it (``resumed_from``: the same for
    every rank of a group; None before any checkpoint)."""
    by_step: dict[int, dict[int, list[dict]]] = {}
    for path in sorted(audit.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            group = -1 if rec["resumed_from"] is None else rec["resumed_from"]
            by_step.setdefault(rec["step"], {}).setdefault(group, []).append(
                {**rec, "rank": int(path.stem[4:])})
    return {step: groups[max(groups)] for step, groups in by_step.items()}


def test_an_elastic_run_that_loses_a_worker_finishes_on_one(cluster, tmp_path):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    c, slots = cluster
    marker = tmp_path / "checkpointed"
    config = {"model_factory": toy.make_model, "optimizer_factory": toy.make_optimizer,
              "dataset_factory": functools.partial(toy.make_dataset, SAMPLES, delay_s=0.2,
                                                   delay_rank=1),
              "loss_fn": toy.loss_fn, "micro_batch": 2, "grad_accum": 2, "epochs": EPOCHS,
              "checkpoint_every_steps": 4, "num_workers": 0, "seed": 3,
              "measure_bandwidth": False, "audit_dir": str(tmp_path / "audit"),
              "trace_dir": str(tmp_path / "trace")}
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config=config,
        # the monitor resizes a healthy group at most every 5 s; a lost worker is a failure
        scaling_config=ScalingConfig(num_workers=(1, 2), elastic_resize_monitor_interval_s=5,
                                     resources_per_worker={"CPU": 1, "elastic_slot": 1}),
        run_config=RunConfig(name="elastic", storage_path=str(tmp_path / "storage"),
                             failure_config=FailureConfig(max_failures=2),
                             callbacks=[_checkpoint_marker(str(marker), at_step=4)]))

    removed = threading.Event()

    def lose_a_node() -> None:
        for _ in range(1200):            # 120 s at most, then the run goes on at 2
            if marker.exists():
                _remove_node(c, slots[1])
                removed.set()
                return
            threading.Event().wait(0.1)

    killer = threading.Thread(target=lose_a_node, daemon=True)
    killer.start()
    result = trainer.fit()
    killer.join(timeout=30)
    assert removed.is_set(), "no checkpoint was reported, so no node was removed"

    starts = sorted((json.loads(line) for path in (tmp_path / "trace").glob("rank*.jsonl")
                     for line in path.read_text().splitlines()
                     if json.loads(line)["t"] == "start"), key=lambda r: r["wall"])
    results = json.loads(result.metrics["results"])
    resumed = results["resumed_from"]
    # the attempts that trained, in order (one start per rank): 2 ranks, then 1 from a checkpoint
    assert [(r["world_size"], r["resumed_from"]) for r in starts] == [
        (2, None), (2, None), (1, resumed)]
    assert results["step"] == results["total_steps"] == STEPS_PER_EPOCH * EPOCHS
    assert results["world_size"] == 1 and resumed >= 4
    assert (results["micro_batch"], results["grad_accum"]) == (2, 4)
    change = [ch for ch in results["batch_changes"] if ch.get("kind") == "world_size"]
    assert len(change) == 1, results["batch_changes"]
    assert (change[0]["from_world_size"], change[0]["world_size"]) == (2, 1)
    assert change[0]["global_batch"] == GLOBAL_BATCH

    lineage = _lineage(tmp_path / "audit")
    assert sorted(lineage) == list(range(STEPS_PER_EPOCH * EPOCHS))
    for step, recs in lineage.items():
        # every step of the lineage is the global batch, read by the world of its group
        assert sum(len(r["ids"]) for r in recs) == GLOBAL_BATCH, f"step {step}"
        assert {r["rank"] for r in recs} == ({0} if step >= resumed else {0, 1}), f"step {step}"
    by_epoch: dict[int, list[int]] = {}
    for step, recs in lineage.items():
        assert {r["epoch"] for r in recs} == {step // STEPS_PER_EPOCH}
        by_epoch.setdefault(step // STEPS_PER_EPOCH, []).extend(i for r in recs for i in r["ids"])
    for epoch, ids in by_epoch.items():
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {epoch}"
