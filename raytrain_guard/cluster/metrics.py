"""Ray metrics of the node monitors and the coordinator (``ray.util.metrics``).

Every metric is named ``raytrain_guard_<what>_<unit>``; Ray's Prometheus export adds its own
``ray_`` prefix, so Grafana sees ``ray_raytrain_guard_gpu_memory_used_bytes{node_id, gpu}``.
Tag values are always strings (Ray rejects anything else). Create these objects inside the
process that records them (the actor), never in the driver, and record off the training hot
path: the monitor records once per sample, the coordinator once per policy round.
"""

from __future__ import annotations

from typing import Mapping

from raytrain_guard.core.decisions import Decision
from raytrain_guard.core.node_samples import NodeSample
from raytrain_guard.core.straggler import StragglerScore

PREFIX = "raytrain_guard_"


class NodeMetrics:
    """Gauges for one node monitor's samples, tagged with node id (and GPU index, pid)."""

    def __init__(self) -> None:
        from ray.util.metrics import Gauge

        def gauge(name: str, text: str, *tags: str) -> Gauge:
            return Gauge(PREFIX + name, text, tag_keys=tags)

        gpu_tags = ("node_id", "gpu")
        self._gpu = {
            "memory_used_bytes": gauge("gpu_memory_used_bytes", "NVML memory used", *gpu_tags),
            "memory_total_bytes": gauge("gpu_memory_total_bytes", "NVML memory total", *gpu_tags),
            "memory_frac": gauge("gpu_memory_frac", "NVML memory used / total", *gpu_tags),
            "utilization_frac": gauge("gpu_utilization_frac", "GPU utilization", *gpu_tags),
            "temperature_c": gauge("gpu_temperature_celsius", "GPU temperature", *gpu_tags),
            "power_w": gauge("gpu_power_watts", "GPU power draw", *gpu_tags),
        }
        self._throttled = gauge("gpu_throttled", "1 while clocks are throttled for the reason",
                                "node_id", "gpu", "reason")
        self._host = {
            "memory_available_bytes": gauge("host_memory_available_bytes", "available memory",
                                            "node_id"),
            "memory_used_frac": gauge("host_memory_used_frac", "1 - available / total",
                                      "node_id"),
            "swap_used_bytes": gauge("host_swap_used_bytes", "swap used", "node_id"),
            "cpu_frac": gauge("host_cpu_frac", "CPU utilization", "node_id"),
        }
        self._gpu_ok = gauge("gpu_monitoring", "1 with NVML readings, 0 in host-only mode",
                             "node_id")
        worker_tags = ("node_id", "pid", "world_rank")
        self._worker = gauge("worker_private_bytes", "train worker private memory (USS)",
                             *worker_tags)
        self._loader = gauge("loader_private_bytes", "its DataLoader workers' private memory",
                             *worker_tags)

    def record(self, sample: NodeSample) -> int:
        """Set every gauge from one sample; returns how many values were set."""
        node = sample.node_id
        n = 0
        for g in sample.gpus:
            tags = {"node_id": node, "gpu": str(g.index)}
            values = {"memory_used_bytes": g.memory_used_bytes,
                      "memory_total_bytes": g.memory_total_bytes, "memory_frac": g.memory_frac,
                      "utilization_frac": g.utilization_frac, "temperature_c": g.temperature_c,
                      "power_w": g.power_w}
            for key, value in values.items():
                if value is not None:
                    self._gpu[key].set(float(value), tags=tags)
                    n += 1
            for reason in ("thermal", "power", "slowdown"):
                self._throttled.set(float(reason in g.throttle_reasons),
                                    tags={**tags, "reason": reason})
                n += 1
        self._gpu_ok.set(0.0 if sample.gpu_error else 1.0, tags={"node_id": node})
        n += 1
        h = sample.host
        if h is not None:
            host_values = {"memory_available_bytes": h.memory_available_bytes,
                           "memory_used_frac": h.memory_used_frac,
                           "swap_used_bytes": h.swap_used_bytes, "cpu_frac": h.cpu_frac}
            for key, value in host_values.items():
                if value is not None:
                    self._host[key].set(float(value), tags={"node_id": node})
                    n += 1
            for w in h.workers:
                tags = {"node_id": node, "pid": str(w.pid),
                        "world_rank": "" if w.world_rank is None else str(w.world_rank)}
                self._worker.set(float(w.private_bytes), tags=tags)
                self._loader.set(float(w.loader_private_bytes), tags=tags)
                n += 2
        return n


class CoordinatorMetrics:
    """Gauges and counters of one run's coordinator, tagged with the run id."""

    def __init__(self, run_id: str) -> None:
        from ray.util.metrics import Counter, Gauge
        self._run = {"run_id": str(run_id)}
        self._excess = Gauge(PREFIX + "straggler_excess_frac",
                             "fraction of a step a rank adds over the reference rank",
                             tag_keys=("run_id", "world_rank", "node_id", "cause"))
        self._flagged = Gauge(PREFIX + "straggler_node", "1 while the node is flagged a straggler",
                              tag_keys=("run_id", "node_id"))
        self._step = Gauge(PREFIX + "step_time_seconds", "step time across ranks",
                           tag_keys=("run_id", "quantile"))
        self._decisions = Counter(PREFIX + "decisions_total", "cluster decisions made",
                                  tag_keys=("run_id", "action"))
        self._ignored = Counter(PREFIX + "ignored_reports_total", "reports counted and ignored",
                                tag_keys=("run_id", "reason"))

    def record_round(self, scores: Mapping[int, StragglerScore], nodes_of: Mapping[int, str],
                     flagged: set[str] | frozenset[str], all_nodes: set[str],
                     p50_s: float | None, p99_s: float | None) -> None:
        for rank, s in scores.items():
            self._excess.set(s.excess_frac, tags={**self._run, "world_rank": str(rank),
                                                  "node_id": nodes_of.get(rank, ""),
                                                  "cause": s.cause.value})
        for node in all_nodes | set(flagged):
            self._flagged.set(float(node in flagged), tags={**self._run, "node_id": node})
        for q, v in (("p50", p50_s), ("p99", p99_s)):
            if v is not None:
                self._step.set(v, tags={**self._run, "quantile": q})

    def record_decision(self, decision: Decision) -> None:
        self._decisions.inc(1.0, tags={**self._run, "action": decision.action.value})

    def record_ignored(self, reason: str) -> None:
        self._ignored.inc(1.0, tags={**self._run, "reason": reason})
