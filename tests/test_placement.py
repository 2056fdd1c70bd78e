"""Where a run's workers sit and the machine the plan is for (pure: no Ray)."""

from __future__ import annotations

import pytest

from raytrain_guard.errors import PlanInputError
from raytrain_guard.planner.placement import NodeResources, place_workers

GiB = 2**30
BIG = NodeResources("big-node", num_cpus=8, num_gpus=4, memory_bytes=64 * GiB)
SMALL = NodeResources("small-node", num_cpus=2, num_gpus=0, memory_bytes=8 * GiB)


def test_pack_fills_the_largest_node_first():
    # 6 CPU workers of 1 CPU: all fit the 8-CPU node; the plan is that node's
    m = place_workers([SMALL, BIG], num_workers=6, use_gpu=False)
    assert dict(m.workers_per_node) == {"big-node": 6}
    assert (m.gpus_per_node, m.cpus_per_node, m.host_memory_bytes) == (6, 8, 64 * GiB)
    assert not m.warnings


def test_spill_plans_for_the_tightest_node():
    # 10 workers: 8 on the big node (8 GiB and 1 CPU a rank), 2 on the small one (4 GiB and
    # 1 CPU a rank): 8 ranks per node, 8 x 4 GiB = 32 GiB, 8 x 1 CPU
    m = place_workers([BIG, SMALL], num_workers=10, use_gpu=False)
    assert dict(m.workers_per_node) == {"big-node": 8, "small-node": 2}
    assert (m.gpus_per_node, m.cpus_per_node, m.host_memory_bytes) == (8, 8, 32 * GiB)
    assert m.memory_per_worker_bytes == 4 * GiB
    assert "small-no" in m.reason


def test_gpu_workers_follow_the_gpus():
    # use_gpu: 1 GPU and 1 CPU a worker; the small node has no GPU. 4 workers on the big node
    gpu2 = NodeResources("gpu2", num_cpus=4, num_gpus=2, memory_bytes=16 * GiB)
    m = place_workers([BIG, SMALL, gpu2], num_workers=6, use_gpu=True)
    assert dict(m.workers_per_node) == {"big-node": 4, "gpu2": 2}
    # per rank: big 16 GiB, 2 CPUs; gpu2 8 GiB, 2 CPUs -> 4 ranks x 8 GiB, 4 x 2 CPUs
    assert (m.gpus_per_node, m.cpus_per_node, m.host_memory_bytes) == (4, 8, 32 * GiB)


def test_more_workers_than_the_nodes_hold_is_said():
    m = place_workers([SMALL], num_workers=3, use_gpu=False)
    assert dict(m.workers_per_node) == {"small-node": 3}
    assert m.warnings and "only 2 of 3 workers" in m.warnings[0]


def test_from_ray_node_entry():
    node = {"NodeID": "abc", "Alive": True,
            "Resources": {"CPU": 4.0, "GPU": 1.0, "memory": 3 * GiB, "node:1.2.3.4": 1.0}}
    assert NodeResources.from_ray(node) == NodeResources("abc", 4.0, 1.0, 3 * GiB)


@pytest.mark.parametrize("kwargs,field", [
    ({"nodes": [], "num_workers": 1}, "nodes"),
    ({"nodes": [SMALL], "num_workers": 0}, "num_workers"),
])
def test_bad_inputs_name_the_field(kwargs, field):
    with pytest.raises(PlanInputError, match=field):
        place_workers(use_gpu=False, **kwargs)
