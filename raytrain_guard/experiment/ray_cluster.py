"""The Ray cluster the experiment runs on: the one this process already initialized, the one at
``--address`` (or ``RAY_ADDRESS``), or a local one it starts and stops: one node, or several
on this machine (``ray.cluster_utils.Cluster``). docs/experiment.md ("Which Ray cluster")."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from raytrain_guard.errors import InputError
from raytrain_guard.experiment.node_memory import NodeCgroups

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
    share of the workers plus one); with ``setup.node_memory_bytes``, each in its own memory
    cgroup of that size (:mod:`.node_memory`), the result's ``cluster["node_memory"]``."""
    import ray

    options = {"namespace": namespace, "log_to_driver": False, "logging_level": "error"}
    joined = cluster_address(address)
    node_memory = getattr(setup, "node_memory_bytes", None)
    check_node_memory(node_memory, address)
    if ray.is_initialized():
        yield _ordered_node_ids(setup.nodes), _cluster("this process's Ray")
        return
    if joined is not None or (setup.nodes == 1 and node_memory is None):
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

    cgroups = NodeCgroups(node_memory) if node_memory is not None else None
    cpus = -(-setup.num_workers // setup.nodes) + 1
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": cpus, "include_dashboard": False})
    try:
        nodes = [cluster.head_node] + [cluster.add_node(num_cpus=cpus)
                                       for _ in range(setup.nodes - 1)]
        cluster.wait_for_nodes()
        if cgroups is not None:
            for index, node in enumerate(nodes):
                cgroups.confine(index, _raylet_pid(node))
        ray.init(address=cluster.address, **options)
        try:
            where = _cluster(f"local, {setup.nodes} node{'s' if setup.nodes > 1 else ''}")
            if cgroups is not None:
                where["node_memory"] = {"limit_bytes": cgroups.limit_bytes,
                                        "cgroups": list(cgroups.paths)}
            yield [n.node_id for n in nodes], where
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()
        if cgroups is not None:
            cgroups.close()


def _raylet_pid(node: Any) -> int:
    """The pid of a ``ray.cluster_utils.Cluster`` node's raylet, from the processes the node
    started (``Node.all_processes``, keyed by Ray's process type, ``"raylet"``). Not a public
    Ray API: a Ray that no longer lists it gets a clear error, not a KeyError."""
    try:
        return int(node.all_processes["raylet"][0].process.pid)
    except (AttributeError, KeyError, IndexError, TypeError):
        raise RuntimeError("--node-memory: this Ray's local cluster does not list its raylet "
                           "process (ray.cluster_utils node.all_processes['raylet']), so its "
                           "node cannot be put in a cgroup; run without --node-memory"
                           ) from None


def check_node_memory(node_memory: int | None, address: str | None) -> None:
    """InputError where ``--node-memory`` is given for a cluster the experiment does not start."""
    import ray

    if node_memory is not None and (ray.is_initialized() or cluster_address(address)):
        raise InputError("--node-memory", "gives the nodes of a local cluster the experiment "
                         "starts their own memory; this run joins a running cluster",
                         value=node_memory, fix="leave --node-memory out with --address, "
                         "RAY_ADDRESS or your own ray.init (its nodes have their own RAM)")


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
