"""The launcher's own plan on a real two-node Ray cluster of different sizes: it plans for the
nodes the workers will run on (Ray's node resources, workers packed as Ray places them), not
for the driver's machine.

``ray.cluster_utils.Cluster``: a head of 3 CPUs and 3 GiB of Ray memory, a worker node of 1 CPU
and 512 MiB. 4 CPU workers: 3 on the head (1 GiB a rank), 1 on the small node (512 MiB a rank):
the plan is for 3 ranks per node of 3 CPUs and 3 x 512 MiB.
"""

from __future__ import annotations

import functools

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster

from examples import toy
from raytrain_guard.cluster.planning import cluster_nodes, plan_machine, traced_plan

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
MiB = 2**20


@pytest.fixture(scope="module")
def two_nodes():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "memory": 3 * 1024 * MiB,
                                                      "include_dashboard": False})
    c.add_node(num_cpus=1, memory=512 * MiB)
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="rtg_test_placement")
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def test_plan_is_for_the_tightest_node_the_workers_use(two_nodes):
    nodes = cluster_nodes()
    assert sorted((n.num_cpus, n.memory_bytes) for n in nodes) == [
        (1.0, 512 * MiB), (3.0, 3 * 1024 * MiB)]
    machine = plan_machine(num_workers=4, use_gpu=False)
    assert sorted(machine.workers_per_node.values()) == [1, 3]
    assert (machine.gpus_per_node, machine.cpus_per_node) == (3, 3)
    assert machine.memory_per_worker_bytes == 512 * MiB
    assert machine.host_memory_bytes == 3 * 512 * MiB

    config = {"model_factory": toy.make_model,
              "dataset_factory": functools.partial(toy.make_dataset, 64),
              "optimizer_factory": toy.make_optimizer, "loss_fn": toy.loss_fn,
              "micro_batch": 8, "epochs": 1, "num_workers": 0}
    plan, _ = traced_plan(config, num_workers=4)
    # the CPU "device" is the tightest node's RAM per rank, not the driver's RAM / 4
    assert plan.device_memory_bytes == 512 * MiB
    assert any("4 workers packed over 2 of 2 nodes" in n for n in plan.notes)


def test_traced_plan_carries_the_runs_precision_and_gradient_sync(two_nodes):
    config = {"model_factory": toy.make_model,
              "dataset_factory": functools.partial(toy.make_dataset, 64),
              "optimizer_factory": toy.make_optimizer, "loss_fn": toy.loss_fn,
              "micro_batch": 4, "grad_accum": 2, "epochs": 1, "num_workers": 0,
              "strategy": "fsdp-full", "precision": "bf16-master",
              "fsdp_grad_sync": "every_micro_batch"}
    plan, run_plan = traced_plan(config, num_workers=2)
    assert plan.setup.precision.value == "bf16-master"
    assert plan.fsdp_grad_sync == "every_micro_batch" == run_plan.grad_sync.value
    assert {o["fsdp_grad_sync"] for o in plan.grad_sync_options} == {
        "every_micro_batch", "last_micro_batch"}
    auto, auto_run = traced_plan({**config, "fsdp_grad_sync": "auto"}, num_workers=2)
    assert auto.fsdp_grad_sync in ("every_micro_batch", "last_micro_batch")
    assert auto_run.grad_sync.value == auto.fsdp_grad_sync == auto.setup.fsdp_grad_sync.value
