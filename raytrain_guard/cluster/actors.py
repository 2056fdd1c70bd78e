"""Turning the monitor and the coordinator into Ray actors (the only module here that starts them).

:func:`start_monitors` puts one :class:`~raytrain_guard.cluster.monitor.NodeMonitor` of the run
on each alive node (``num_cpus=0``, pinned to the node, sampling every ``monitor_interval_s``
and sending to its run's coordinator, fire-and-forget); :func:`start_coordinator` starts the
run's :class:`~raytrain_guard.cluster.coordinator.Coordinator`; :func:`stop_all` kills a run's
actors; :func:`register_worker_with_monitor` asks a train worker's node monitor to sample it.
Actors are named per run in the namespace, so two runs keep apart. What runs where:
docs/cluster.md.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from raytrain_guard.cluster.client import COORDINATOR_PREFIX, coordinator_name
from raytrain_guard.cluster.coordinator import Coordinator
from raytrain_guard.cluster.monitor import NodeMonitor
from raytrain_guard.config import GuardConfig

logger = logging.getLogger(__name__)

MONITOR_PREFIX = "raytrain_guard:monitor:"
MAX_INFLIGHT_SAMPLES = 8
"""Samples a monitor lets go unanswered before it drops new ones (a slow coordinator). Not a
user knob: 8 samples are 8 monitor intervals of slack, far beyond a healthy round trip."""

ProbeFactory = Callable[[str], "tuple[Any, Any]"]
"""``probe_factory(node_id) -> (gpu_probe, host_probe)``; None in a slot builds the real probe.
It is pickled to every monitor, so define it at module level (scripted probes are fine)."""

__all__ = [
    "COORDINATOR_PREFIX",
    "MONITOR_PREFIX",
    "CoordinatorSink",
    "alive_node_ids",
    "coordinator_name",
    "monitor_name",
    "register_worker_with_monitor",
    "start_coordinator",
    "start_monitors",
    "stop_all",
]


def monitor_name(run_id: str, node_id: str) -> str:
    """``raytrain_guard:monitor:<run id>:<node id>``."""
    return f"{MONITOR_PREFIX}{run_id}:{node_id}"


def alive_node_ids() -> list[str]:
    import ray
    return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]


class CoordinatorSink:
    """Sends a monitor's samples to the run's coordinator, fire-and-forget, never raising.

    The handle is looked up by name lazily (again at most every ``retry_after_s`` after a
    failure, default ``GuardConfig.coordinator_retry_s``); at most ``MAX_INFLIGHT_SAMPLES``
    calls stay unanswered, beyond that a sample is dropped and counted.
    """

    def __init__(self, namespace: str, run_id: str, *, retry_after_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.namespace, self.name = namespace, coordinator_name(run_id)
        self.retry_after_s = (GuardConfig().coordinator_retry_s if retry_after_s is None
                              else retry_after_s)
        self._clock = clock
        self._handle: Any = None
        self._next_lookup = -float("inf")
        self._inflight: list[Any] = []
        self.num_sent = 0
        self.num_dropped = 0

    def __call__(self, sample: dict) -> None:
        try:
            self._collect()
        except Exception:  # noqa: BLE001 - the coordinator died or restarts: look it up again
            self._handle, self._inflight = None, []
            self._next_lookup = self._clock() + self.retry_after_s
        if self._handle is None:
            if self._clock() < self._next_lookup:
                self.num_dropped += 1
                return
            self._next_lookup = self._clock() + self.retry_after_s
            import ray
            try:
                self._handle = ray.get_actor(self.name, namespace=self.namespace)
            except ValueError:
                self.num_dropped += 1
                return
        if len(self._inflight) >= MAX_INFLIGHT_SAMPLES:
            self.num_dropped += 1
            return
        self._inflight.append(self._handle.report_node.remote(sample))
        self.num_sent += 1

    def _collect(self) -> None:
        """The one method that touches ``ray.wait``/``ray.get``, with timeout 0: finished calls
        are collected and their errors raised (a dead coordinator)."""
        if not self._inflight:
            return
        import ray
        done, self._inflight = ray.wait(self._inflight, num_returns=len(self._inflight),
                                        timeout=0)
        if done:
            ray.get(done, timeout=0)


class _MonitorActor(NodeMonitor):
    """NodeMonitor with what only exists inside the actor: Ray metrics and the coordinator sink."""

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
        super().__init__(node_id, config, gpu_probe=gpu_probe, host_probe=host_probe,
                         sink=CoordinatorSink(namespace, run_id,
                                              retry_after_s=config.coordinator_retry_s),
                         metrics=metrics,
                         autostart=True)

    def where(self) -> str:
        """The Ray node id this actor actually runs on (to check the affinity)."""
        import ray
        return ray.get_runtime_context().get_node_id()


class _CoordinatorActor(Coordinator):
    """Coordinator with its Ray metrics created inside the actor, and what a driver, the train
    workers and Ray Train's controller hand it besides step reports (the drop-in's channel,
    :mod:`raytrain_guard.train`):

    * ``request_stop(reason) -> dict``: a ``checkpoint_and_stop`` decision for every rank (scope
      ``cluster``), delivered like any other and applied in lockstep;
    * ``report_summary(world_rank, summary)`` / ``summaries() -> {rank: summary}``: each rank's
      end-of-run figures (the latest per rank);
    * ``record_train_event(event)`` / ``train_events() -> list``: reports and worker exceptions
      as Ray Train's controller saw them (a ``UserCallback``): attempts and restarts.
    """

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

    def request_stop(self, reason: str) -> dict:
        """A ``checkpoint_and_stop`` for every rank, applied at the next agreement step."""
        from raytrain_guard.core.decisions import Action, Cause, Decision
        self._next_id += 1
        decision = Decision(Action.CHECKPOINT_AND_STOP, f"stop requested: {reason}",
                            cause=Cause.UNKNOWN, scope="cluster", decision_id=self._next_id)
        self._decisions.append(decision)
        logger.warning("[run %s] decision #%d %s", self.run_id, decision.decision_id, decision)
        if self._metrics is not None:
            self._safe_metrics(lambda: self._metrics.record_decision(decision))
        return decision.to_dict()

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
    """One monitor of ``run_id`` per alive node; returns ``{node_id: handle}``. Idempotent:
    named :func:`monitor_name` with ``get_if_exists``, so calling it again adds monitors to new
    nodes only. Each is pinned with ``NodeAffinitySchedulingStrategy(node_id, soft=False)`` and
    keyed on Ray's node id, never on an IP-based node rank (nodes may share an IP); it has
    NodeMonitor's methods plus ``where()``.

    With ``ready_timeout_s`` it waits for every monitor to answer a ping (a monitor that does
    not is logged and still returned: monitoring fails open).
    """
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
        refs = {h.ping.remote(): n for n, h in handles.items()}
        _ready, missing = ray.wait(list(refs), num_returns=len(refs), timeout=ready_timeout_s)
        for ref in missing:
            logger.warning("monitor on node %s did not answer within %.0f s", refs[ref],
                           ready_timeout_s)
    return handles


def start_coordinator(namespace: str, run_id: str, config: GuardConfig | None = None, *,
                      attempt: int = 0, max_restarts: int = -1,
                      run_name: str | None = None) -> Any:
    """The run's coordinator actor (``raytrain_guard:coordinator:<run id>``). Idempotent.
    ``run_name``: Ray Train's run name, the ``ray_train_run_name`` label of its metrics
    (default: the run id)."""
    import ray
    return ray.remote(_CoordinatorActor).options(
        name=coordinator_name(run_id), namespace=namespace, get_if_exists=True, num_cpus=0,
        max_restarts=max_restarts,
    ).remote(run_id, config or GuardConfig(), attempt, run_name)


def stop_all(namespace: str, run_id: str | None = None) -> list[str]:
    """Kill the monitors and the coordinator of ``run_id`` in ``namespace`` (every run's when
    None), without restart; another run's actors are left alone. Returns the names killed."""
    import ray
    killed = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry.get("name", "")
        if entry.get("namespace") != namespace:
            continue
        if run_id is None:
            wanted = name.startswith((MONITOR_PREFIX, COORDINATOR_PREFIX))
        else:
            wanted = name == coordinator_name(run_id) or (
                name.startswith(monitor_name(run_id, "")))
        if not wanted:
            continue
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
            killed.append(name)
        except ValueError:
            pass   # gone already
    return killed


def register_worker_with_monitor(namespace: str, run_id: str, world_rank: int | None = None,
                                 pid: int | None = None) -> bool:
    """From a train worker: ask its run's monitor on this node to sample this process
    (fire-and-forget). Returns False (and training goes on) when there is no such monitor.
    """
    import ray
    node_id = ray.get_runtime_context().get_node_id()
    try:
        handle = ray.get_actor(monitor_name(run_id, node_id), namespace=namespace)
        handle.register_worker.remote(os.getpid() if pid is None else pid, world_rank)
        return True
    except Exception as exc:  # noqa: BLE001 - fail open
        logger.warning("rank %s: no monitor on node %s (%s); host memory of this worker is not "
                       "sampled", world_rank, node_id[:12], exc)
        return False
