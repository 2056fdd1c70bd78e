"""Where the workers of a run will sit, and the machine the plan is for (pure).

The planner sizes host-side things per node (DataLoader workers from a node's CPUs, the prefetch
budget from its RAM, both shared by the ranks on that node), so it needs the nodes the workers
will run on, not the driver's machine. :func:`place_workers` takes the cluster's nodes (Ray's
``ray.nodes()`` resources, or the driver's machine when Ray is not running) and spreads the
workers the way Ray's default placement does for a Train run (``placement_strategy="PACK"``:
fill a node before the next, the largest first), then returns the machine of the *tightest*
node: the ranks that share a node with the least RAM and the fewest CPUs per rank.

Worked example: nodes of 8 CPUs / 64 GiB and 2 CPUs / 8 GiB, 6 CPU workers of 1 CPU each: PACK
puts 6 on the large node (it holds 8), none on the small one: 6 ranks per node, 8 CPUs, 64 GiB.
10 workers: 8 on the large node, 2 on the small one; per rank 8 GiB and 1 CPU on the large
node, 4 GiB and 1 CPU on the small one: the plan is for 8 ranks per node with 8 CPUs and
8 x 4 GiB = 32 GiB (the small node's shares, scaled to the most ranks one node holds).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from raytrain_guard.errors import PlanInputError, check_int

#: Ray Train's default CPUs per worker (``ScalingConfig``); and 1 GPU with ``use_gpu=True``
CPUS_PER_WORKER = 1.0


@dataclass(frozen=True)
class NodeResources:
    """One node's schedulable resources (Ray's ``Resources`` of ``ray.nodes()``)."""

    node_id: str
    num_cpus: float
    num_gpus: float
    memory_bytes: int

    @classmethod
    def from_ray(cls, node: Mapping[str, Any]) -> NodeResources:
        """From one entry of ``ray.nodes()`` (``NodeID``, ``Resources``: CPU, GPU, memory)."""
        res = node.get("Resources") or {}
        return cls(node_id=str(node.get("NodeID", "")), num_cpus=float(res.get("CPU", 0)),
                   num_gpus=float(res.get("GPU", 0)), memory_bytes=int(res.get("memory", 0)))


@dataclass(frozen=True)
class PlanMachine:
    """The node the plan is made for: ranks on it, its CPUs and RAM (the tightest node's
    shares per rank, scaled to the most ranks one node holds), and how the workers sit."""

    gpus_per_node: int                   # ranks on the fullest node
    cpus_per_node: int
    host_memory_bytes: int
    memory_per_worker_bytes: int         # the tightest node's RAM per rank
    workers_per_node: Mapping[str, int]  # node id -> ranks placed there
    reason: str
    warnings: tuple[str, ...] = ()


def place_workers(nodes: Sequence[NodeResources], *, num_workers: int, use_gpu: bool,
                  cpus_per_worker: float = CPUS_PER_WORKER) -> PlanMachine:
    """Spread ``num_workers`` over ``nodes`` as Ray's PACK placement would and return the
    tightest node's machine (see the module docstring). Workers that fit nowhere are counted
    on the node with the most room, with a warning (Ray would wait for resources)."""
    check_int("num_workers", num_workers, at_least=1, error=PlanInputError,
              fix="pass the run's number of workers")
    if not nodes:
        raise PlanInputError("nodes", "no alive node to place workers on", value=0,
                             fix="start the cluster's nodes, or plan without Ray")

    def capacity(node: NodeResources) -> int:
        by_cpu = math.floor(node.num_cpus / cpus_per_worker) if cpus_per_worker > 0 else \
            num_workers
        return min(by_cpu, math.floor(node.num_gpus)) if use_gpu else by_cpu

    order = sorted(nodes, key=lambda n: (-capacity(n), -n.memory_bytes, n.node_id))
    placed: dict[str, int] = {}
    left = num_workers
    for node in order:
        take = min(left, capacity(node))
        if take > 0:
            placed[node.node_id] = take
            left -= take
    warnings: list[str] = []
    if left:
        first = order[0]
        placed[first.node_id] = placed.get(first.node_id, 0) + left
        unit = "GPU" if use_gpu else "CPU"
        warnings.append(f"only {num_workers - left} of {num_workers} workers fit the alive "
                        f"nodes' {unit}s; the plan counts the other {left} on node "
                        f"{first.node_id[:8]} (Ray waits until resources free up)")
    by_id = {n.node_id: n for n in nodes}
    used = [(by_id[i], w) for i, w in placed.items()]
    most = max(w for _, w in used)
    mem_node, mem_w = min(used, key=lambda nw: nw[0].memory_bytes / nw[1])
    cpu_node, cpu_w = min(used, key=lambda nw: nw[0].num_cpus / nw[1])
    per_worker_mem = mem_node.memory_bytes // mem_w
    cpus = max(1, math.floor(cpu_node.num_cpus / cpu_w * most))
    layout = ", ".join(f"{i[:8]}: {w}" for i, w in placed.items())
    reason = (f"{num_workers} workers packed over {len(used)} of {len(nodes)} nodes ({layout}); "
              f"per rank the tightest RAM is node {mem_node.node_id[:8]} "
              f"({per_worker_mem / 2**30:.1f} GiB) and the fewest CPUs node "
              f"{cpu_node.node_id[:8]} ({cpu_node.num_cpus / cpu_w:g}), planned as {most} "
              f"ranks per node")
    return PlanMachine(gpus_per_node=most, cpus_per_node=cpus,
                       host_memory_bytes=mem_node.memory_bytes * most // mem_w,
                       memory_per_worker_bytes=per_worker_mem, workers_per_node=placed,
                       reason=reason, warnings=tuple(warnings))
