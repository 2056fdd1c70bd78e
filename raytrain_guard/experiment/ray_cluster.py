"""The Ray cluster the experiment runs on: the one this process already initialized, the one at
``--address`` (or ``RAY_ADDRESS``), or a local one it starts and stops: one node, or several
on this machine (``ray.cluster_utils.Cluster``). docs/experiment.md ("Which Ray cluster")."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from raytrain_guard.errors import InputError

#: Ray's own variable for the cluster to join; ``--address`` wins over it
RAY_ADDRESS_ENV = "RAY_ADDRESS"
#: addresses that mean "start a local cluster" (Ray's own word for it, and nothing)
LOCAL_ADDRESSES = ("", "local")


def cluster_address(address: str | None = None) -> str | None:
    """The cluster to join: ``address`` (``--address``), else ``RAY_ADDRESS``; None where
    the one given names none (empty or ``local``) or neither is given: the experiment starts a
    local cluster."""
    for given in (address, os.environ.get(RAY_ADDRESS_ENV)):
        if given is not None:
            return None if given.strip() in LOCAL_ADDRESSES else given.strip()
    return None


@contextlib.contextmanager
def experiment_ray(setup: Any, namespace: str, address: str | None = None
                   ) -> Iterator[tuple[list[str], dict[str, Any]]]:
    """Ray for the experiment; yields its nodes' ids, node 0 first, and the result's
    ``cluster`` (where it ran, the ids of its alive nodes). Ray already initialized by the
    caller: its nodes, the driver's first. Else the cluster at :func:`cluster_address`
    (``ray.init(address=...)``: its own resources, none declared here; it lives on after).
    Otherwise a local cluster, stopped when the block ends: one node (as ``ray.init()``), or
    with ``setup.nodes`` > 1 that many Ray nodes on this machine (``ray.cluster_utils.Cluster``:
    the head and ``nodes - 1`` workers, each with its own node id, raylet and CPUs for its
    share of the workers plus one)."""
    import ray

    options = {"namespace": namespace, "log_to_driver": False, "logging_level": "error"}
    joined = cluster_address(address)
    if ray.is_initialized():
        yield _ordered_node_ids(setup.nodes), _cluster("this process's Ray")
        return
    if joined is not None or setup.nodes == 1:
        if joined is not None:
            ray.init(address=joined, **options)
        else:
            ray.init(address="local", num_cpus=max(4, setup.num_workers + 2),
                     include_dashboard=False, **options)
        try:
            yield _ordered_node_ids(setup.nodes), _cluster(joined or "local")
        finally:
            ray.shutdown()
        return
    from ray.cluster_utils import Cluster

    cpus = -(-setup.num_workers // setup.nodes) + 1
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": cpus, "include_dashboard": False})
    try:
        nodes = [cluster.head_node] + [cluster.add_node(num_cpus=cpus)
                                       for _ in range(setup.nodes - 1)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, **options)
        try:
            yield [n.node_id for n in nodes], _cluster(f"local, {setup.nodes} nodes")
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()


def _cluster(where: str) -> dict[str, Any]:
    import ray
    return {"address": where,
            "node_ids": sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))}


def _ordered_node_ids(wanted: int) -> list[str]:
    """The alive nodes of the cluster, the driver's first; InputError when there are fewer
    than ``wanted``."""
    import ray
    own = ray.get_runtime_context().get_node_id()
    alive = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    ordered = [own] + [n for n in alive if n != own]
    if len(ordered) < wanted:
        raise InputError("--nodes", f"the Ray cluster found has {len(ordered)} alive node(s)",
                         value=wanted, fix=f"use --nodes {len(ordered)} or fewer, or add nodes")
    return ordered
