"""Ray metrics of the node monitors and the coordinator (``ray.util.metrics``), created in the
actor that records them: the monitor once per sample, the coordinator once per policy round.
Every metric is named ``raytrain_guard_<what>_<unit>``; :data:`EXPORTED` lists every metric the
package exports, these and the ranks'.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from raytrain_guard.core.decisions import Decision
from raytrain_guard.core.node_samples import NodeSample
from raytrain_guard.core.straggler import StragglerScore
from raytrain_guard.runtime.guard.metrics import (
    EXPORTED,  # noqa: F401 - re-exported: the catalog, with this module's declarations
    RUN_NAME_TAG,
    WORLD_RANK_TAG,
    counter,
    declare,
    gauge,
)

_GPU = ("node_id", "gpu")
_RUN = ("run_id", RUN_NAME_TAG)
_WORKER = ("node_id", "pid", "world_rank")

# node monitors
GPU_GAUGES = {   # GpuSample field -> metric name
    "memory_used_bytes": declare("gpu_memory_used_bytes", "gauge", *_GPU),
    "memory_total_bytes": declare("gpu_memory_total_bytes", "gauge", *_GPU),
    "memory_frac": declare("gpu_memory_frac", "gauge", *_GPU),
    "utilization_frac": declare("gpu_utilization_frac", "gauge", *_GPU),
    "temperature_c": declare("gpu_temperature_celsius", "gauge", *_GPU),
    "power_w": declare("gpu_power_watts", "gauge", *_GPU),
}
GPU_THROTTLED = declare("gpu_throttled", "gauge", *_GPU, "reason")
GPU_MONITORING = declare("gpu_monitoring", "gauge", "node_id")
HOST_GAUGES = {  # HostSample field -> metric name
    "memory_available_bytes": declare("host_memory_available_bytes", "gauge", "node_id"),
    "memory_used_frac": declare("host_memory_used_frac", "gauge", "node_id"),
    "swap_used_bytes": declare("host_swap_used_bytes", "gauge", "node_id"),
    "cpu_frac": declare("host_cpu_frac", "gauge", "node_id"),
}
WORKER_PRIVATE = declare("worker_private_bytes", "gauge", *_WORKER)
LOADER_PRIVATE = declare("loader_private_bytes", "gauge", *_WORKER)
# the coordinator
STRAGGLER_EXCESS = declare("straggler_excess_frac", "gauge", *_RUN, WORLD_RANK_TAG, "node_id")
STRAGGLER_CAUSE = declare("straggler_cause", "gauge", *_RUN, WORLD_RANK_TAG, "node_id", "cause")
STRAGGLER_NODE = declare("straggler_node", "gauge", *_RUN, "node_id")
STEP_TIME = declare("step_time_seconds", "gauge", *_RUN, "quantile")
DECISIONS = declare("decisions_total", "counter", *_RUN, "action")
IGNORED = declare("ignored_reports_total", "counter", *_RUN, "reason")
HANGS = declare("hangs_total", "counter", *_RUN, WORLD_RANK_TAG, "node_id", "phase", "basis")


class NodeMetrics:
    """Gauges for one node monitor's samples, tagged with node id (and GPU index, pid)."""

    def __init__(self) -> None:
        self._gpu = {key: gauge(name, f"GPU {key} (NVML)") for key, name in GPU_GAUGES.items()}
        self._throttled = gauge(GPU_THROTTLED, "1 while clocks are throttled for the reason")
        self._host = {key: gauge(name, f"host {key}") for key, name in HOST_GAUGES.items()}
        self._gpu_ok = gauge(GPU_MONITORING, "1 with NVML readings, 0 in host-only mode")
        self._worker = gauge(WORKER_PRIVATE, "train worker private memory (USS)")
        self._loader = gauge(LOADER_PRIVATE, "its DataLoader workers' private memory")

    def record(self, sample: NodeSample) -> None:
        """Set every gauge from one sample."""
        node = sample.node_id
        for g in sample.gpus:
            tags = {"node_id": node, "gpu": str(g.index)}
            for key in GPU_GAUGES:
                value = getattr(g, key)
                if value is not None:
                    self._gpu[key].set(float(value), tags=tags)
            for reason in ("thermal", "power", "slowdown"):
                self._throttled.set(float(reason in g.throttle_reasons),
                                    tags={**tags, "reason": reason})
        self._gpu_ok.set(0.0 if sample.gpu_error else 1.0, tags={"node_id": node})
        h = sample.host
        if h is not None:
            for key in HOST_GAUGES:
                value = getattr(h, key)
                if value is not None:
                    self._host[key].set(float(value), tags={"node_id": node})
            for w in h.workers:
                tags = {"node_id": node, "pid": str(w.pid),
                        "world_rank": "" if w.world_rank is None else str(w.world_rank)}
                self._worker.set(float(w.private_bytes), tags=tags)
                self._loader.set(float(w.loader_private_bytes), tags=tags)


class CoordinatorMetrics:
    """Gauges and counters of one run's coordinator, tagged with the run id and the Ray Train
    run name (``run_name``; the run id when None)."""

    def __init__(self, run_id: str, run_name: str | None = None) -> None:
        self._run = {"run_id": str(run_id), RUN_NAME_TAG: str(run_name or run_id)}
        self._excess = gauge(STRAGGLER_EXCESS,
                              "fraction of a step a rank adds over the reference rank")
        self._cause = gauge(STRAGGLER_CAUSE, "1 while the rank's score names the cause")
        self._cause_tags: dict[int, dict[str, str]] = {}   # rank -> tags of its last cause
        self._flagged = gauge(STRAGGLER_NODE, "1 while the node is flagged a straggler")
        self._step = gauge(STEP_TIME, "step time across ranks")
        self._decisions = counter(DECISIONS, "cluster decisions made")
        self._ignored = counter(IGNORED, "reports counted and ignored")
        self._hangs = counter(HANGS, "hung attempts, labelled with the rank the coordinator "
                                      "named (empty when it could not tell)")

    def record_round(self, scores: Mapping[int, StragglerScore], nodes_of: Mapping[int, str],
                     flagged: set[str] | frozenset[str], all_nodes: set[str],
                     p50_s: float | None, p99_s: float | None) -> None:
        for rank, s in scores.items():
            tags = {**self._run, WORLD_RANK_TAG: str(rank), "node_id": nodes_of.get(rank, "")}
            # one excess series per rank whatever its cause; the cause in a series of its own,
            # the previous one set to 0 once when it changes
            self._excess.set(s.excess_frac, tags=tags)
            cause_tags = {**tags, "cause": s.cause.value}
            previous = self._cause_tags.get(rank)
            if previous is not None and previous != cause_tags:
                self._cause.set(0.0, tags=previous)
            self._cause.set(1.0, tags=cause_tags)
            self._cause_tags[rank] = cause_tags
        for node in all_nodes | set(flagged):
            self._flagged.set(float(node in flagged), tags={**self._run, "node_id": node})
        for q, v in (("p50", p50_s), ("p99", p99_s)):
            if v is not None:
                self._step.set(v, tags={**self._run, "quantile": q})

    def record_decision(self, decision: Decision) -> None:
        self._decisions.inc(1.0, tags={**self._run, "action": decision.action.value})

    def record_ignored(self, reason: str) -> None:
        self._ignored.inc(1.0, tags={**self._run, "reason": reason})

    def record_hang(self, verdict: Any) -> None:
        """One attempt's settled hang verdict (``core.hang.HungRank``)."""
        rank = "" if verdict.world_rank is None else str(verdict.world_rank)
        self._hangs.inc(1.0, tags={**self._run, WORLD_RANK_TAG: rank,
                                   "node_id": verdict.node_id or "", "phase": verdict.phase or "",
                                   "basis": verdict.basis})
