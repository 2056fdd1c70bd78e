"""The monitor and the coordinator as Ray actors (the only module that starts them), named per
run in the namespace, so two runs keep apart (docs/cluster.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from raytrain_guard.cluster.coordinator.coordinator import Coordinator
from raytrain_guard.cluster.monitor.monitor import NodeMonitor
from raytrain_guard.config import GuardConfig
from raytrain_guard.coordination.link import (
    COORDINATOR_PREFIX,
    MONITOR_PREFIX,
    CoordinatorLink,
    coordinator_name,
    monitor_name,
    wait_for,
)

logger = logging.getLogger(__name__)

MAX_QUEUED_SAMPLES = 8      # samples a monitor holds while the coordinator is slow

ProbeFactory = Callable[[str], "tuple[Any, Any]"]
"""``probe_factory(node_id) -> (gpu_probe, host_probe)``; None in a slot builds the real probe.
It is pickled to every monitor, so define it at module level (scripted probes are fine)."""

def alive_node_ids() -> list[str]:
    import ray
    return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]


class _MonitorActor(NodeMonitor):
    """NodeMonitor with what only exists inside the actor: Ray metrics and the link."""

    def __init__(self, node_id: str, config: GuardConfig, namespace: str, run_id: str,
                 probe_factory: ProbeFactory | None) -> None:
        from raytrain_guard.cluster.metrics import NodeMetrics
        gpu_probe, host_probe = None, None
        if probe_factory is not None:
            try:
                gpu_probe, host_probe = probe_factory(node_id)
            except Exception as exc:  # noqa: BLE001 - fail open: the real probes instead
                logger.warning("[node %s] probe_factory failed (%r); using the real probes",
                               node_id[:12], exc)
        try:
            metrics = NodeMetrics()
        except Exception as exc:  # noqa: BLE001 - fail open: monitor without metrics
            logger.warning("[node %s] Ray metrics unavailable (%r)", node_id[:12], exc)
            metrics = None
        link = CoordinatorLink(coordinator_name(run_id), namespace, max_queued=MAX_QUEUED_SAMPLES,
                               retry_after_s=config.coordinator_retry_s,
                               who=f"node {node_id[:12]}")
        super().__init__(node_id, config, gpu_probe=gpu_probe, host_probe=host_probe,
                         sink=lambda sample: link.submit(
                             lambda handle: wait_for([handle.report_node.remote(sample)])),
                         metrics=metrics, autostart=True)

    def where(self) -> str:
        """The Ray node id this actor actually runs on (to check the affinity)."""
        import ray
        return ray.get_runtime_context().get_node_id()


class _CoordinatorActor(Coordinator):
    """Coordinator with its Ray metrics created inside the actor, and the drop-in's channel
    (:mod:`raytrain_guard.train`): each rank's end-of-run summary, and the reports and worker
    exceptions Ray Train's controller saw (``record_train_event``)."""

    def __init__(self, run_id: str, config: GuardConfig, attempt: int,
                 run_name: str | None = None) -> None:
        from raytrain_guard.cluster.metrics import CoordinatorMetrics
        try:
            metrics = CoordinatorMetrics(run_id, run_name)
        except Exception as exc:  # noqa: BLE001
            logger.warning("[run %s] Ray metrics unavailable (%r)", run_id, exc)
            metrics = None
        super().__init__(run_id, config, attempt=attempt, metrics=metrics)
        self._summaries: dict[int, dict] = {}
        self._train_events: list[dict] = []

    def report_summary(self, world_rank: int, summary: dict) -> None:
        self._summaries[int(world_rank)] = dict(summary)

    def summaries(self) -> dict[int, dict]:
        return dict(self._summaries)

    def record_train_event(self, event: dict) -> None:
        self._train_events.append(dict(event))
        del self._train_events[:-1000]          # bounded: a long run reports often

    def train_events(self) -> list[dict]:
        return list(self._train_events)


def start_monitors(namespace: str, run_id: str, config: GuardConfig | None = None,
                   probe_factory: ProbeFactory | None = None, *, max_restarts: int = -1,
                   ready_timeout_s: float | None = 60.0) -> dict[str, Any]:
    """One monitor of ``run_id`` per alive node, pinned to it and keyed on Ray's node id (nodes
    may share an IP); returns ``{node_id: handle}``. Idempotent: calling it again adds monitors
    to new nodes only. With ``ready_timeout_s`` it warns of a monitor that does not answer or
    runs on another node (monitoring fails open)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    config = config or GuardConfig()
    cls = ray.remote(_MonitorActor)
    handles = {}
    for node_id in alive_node_ids():
        handles[node_id] = cls.options(
            name=monitor_name(run_id, node_id), namespace=namespace, get_if_exists=True, num_cpus=0,
            max_restarts=max_restarts,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(node_id, config, namespace, run_id, probe_factory)
    if ready_timeout_s is not None and handles:
        refs = {h.where.remote(): n for n, h in handles.items()}
        ready, missing = ray.wait(list(refs), num_returns=len(refs), timeout=ready_timeout_s)
        for ref in missing:
            logger.warning("monitor on node %s did not answer within %.0f s", refs[ref],
                           ready_timeout_s)
        for ref, where in zip(ready, ray.get(ready)):
            if where != refs[ref]:
                logger.warning("the monitor of node %s runs on node %s: its samples are that "
                               "node's", refs[ref], where)
    return handles


def start_coordinator(namespace: str, run_id: str, config: GuardConfig | None = None, *,
                      attempt: int = 0, max_restarts: int = -1,
                      run_name: str | None = None) -> Any:
    """The run's coordinator actor. Idempotent. ``run_name``: the ``ray_train_run_name`` label of
    its metrics (default: the run id)."""
    import ray
    return ray.remote(_CoordinatorActor).options(
        name=coordinator_name(run_id), namespace=namespace, get_if_exists=True, num_cpus=0,
        max_restarts=max_restarts,
    ).remote(run_id, config or GuardConfig(), attempt, run_name)


def stop_all(namespace: str, run_id: str | None = None) -> list[str]:
    """Kill the monitors and the coordinator of ``run_id`` (every run's when None) in
    ``namespace``, without restart. Returns the names killed."""
    import ray
    killed = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry.get("name", "")
        if run_id is None:
            wanted = name.startswith((MONITOR_PREFIX, COORDINATOR_PREFIX))
        else:
            wanted = name == coordinator_name(run_id) or name.startswith(monitor_name(run_id, ""))
        if entry.get("namespace") != namespace or not wanted:
            continue
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
            killed.append(name)
        except ValueError:
            pass   # gone already
    return killed
