"""Ray metrics of the node monitors and the coordinator (``ray.util.metrics``).

Every metric is named ``raytrain_guard_<what>_<unit>``; Ray's Prometheus export adds its own
``ray_`` prefix, so Grafana sees ``ray_raytrain_guard_gpu_memory_used_bytes{node_id, gpu}``.
Tag values are always strings (Ray rejects anything else). Create these objects inside the
process that records them (the actor, the train worker), never in the driver, and record off
the training hot path: the monitor records once per sample, the coordinator once per policy
round, a rank once per batch of steps (every ``report_every_steps``).

Per-rank metrics (:class:`RankMetrics`) carry Ray Train's own worker labels,
``ray_train_run_name`` and ``ray_train_worker_world_rank`` (``ray/train/v2/_internal/metrics``),
so a Grafana panel can join them with Ray's Train panels; the coordinator's carry the run name
too. Node metrics carry ``node_id`` (Ray's node id) and ``gpu`` (the NVML index).
:data:`EXPORTED` lists every metric name the package exports (what the dashboard may query).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from raytrain_guard.core.decisions import Decision
from raytrain_guard.core.node_samples import NodeSample
from raytrain_guard.core.straggler import StragglerScore

PREFIX = "raytrain_guard_"
RUN_NAME_TAG = "ray_train_run_name"          # Ray Train's own tag keys (metrics/base.py, worker.py)
WORLD_RANK_TAG = "ray_train_worker_world_rank"
#: StepStats fields exported as ``raytrain_guard_rank_phase_seconds{phase=...}``
PHASES = ("data_wait", "forward", "backward", "comm_wait", "optimizer")

#: name -> (kind, tag keys) of every metric this module creates (without Ray's ``ray_`` prefix):
#: what the Grafana dashboard may query (a test holds every panel to it)
EXPORTED: dict[str, tuple[str, tuple[str, ...]]] = {}


def _declare(name: str, kind: str, *tags: str) -> str:
    EXPORTED[PREFIX + name] = (kind, tags)
    return PREFIX + name


_GPU = ("node_id", "gpu")
_RANK = (RUN_NAME_TAG, WORLD_RANK_TAG)
_RUN = ("run_id", RUN_NAME_TAG)
_WORKER = ("node_id", "pid", "world_rank")

# node monitors
GPU_GAUGES = {   # NodeSample GpuSample field -> metric name
    "memory_used_bytes": _declare("gpu_memory_used_bytes", "gauge", *_GPU),
    "memory_total_bytes": _declare("gpu_memory_total_bytes", "gauge", *_GPU),
    "memory_frac": _declare("gpu_memory_frac", "gauge", *_GPU),
    "utilization_frac": _declare("gpu_utilization_frac", "gauge", *_GPU),
    "temperature_c": _declare("gpu_temperature_celsius", "gauge", *_GPU),
    "power_w": _declare("gpu_power_watts", "gauge", *_GPU),
}
GPU_THROTTLED = _declare("gpu_throttled", "gauge", *_GPU, "reason")
GPU_MONITORING = _declare("gpu_monitoring", "gauge", "node_id")
HOST_GAUGES = {
    "memory_available_bytes": _declare("host_memory_available_bytes", "gauge", "node_id"),
    "memory_used_frac": _declare("host_memory_used_frac", "gauge", "node_id"),
    "swap_used_bytes": _declare("host_swap_used_bytes", "gauge", "node_id"),
    "cpu_frac": _declare("host_cpu_frac", "gauge", "node_id"),
}
WORKER_PRIVATE = _declare("worker_private_bytes", "gauge", *_WORKER)
LOADER_PRIVATE = _declare("loader_private_bytes", "gauge", *_WORKER)
# the coordinator
STRAGGLER_EXCESS = _declare("straggler_excess_frac", "gauge", *_RUN, WORLD_RANK_TAG, "node_id")
STRAGGLER_CAUSE = _declare("straggler_cause", "gauge", *_RUN, WORLD_RANK_TAG, "node_id", "cause")
STRAGGLER_NODE = _declare("straggler_node", "gauge", *_RUN, "node_id")
STEP_TIME = _declare("step_time_seconds", "gauge", *_RUN, "quantile")
DECISIONS = _declare("decisions_total", "counter", *_RUN, "action")
IGNORED = _declare("ignored_reports_total", "counter", *_RUN, "reason")
HANGS = _declare("hangs_total", "counter", *_RUN, WORLD_RANK_TAG, "node_id", "phase", "basis")
# each training rank (RankMetrics)
RANK_STEP = _declare("rank_step_seconds", "gauge", *_RANK)
RANK_PHASE = _declare("rank_phase_seconds", "gauge", *_RANK, "phase")
RANK_COMPUTE = _declare("rank_compute_seconds", "gauge", *_RANK)
RANK_DATA_WAIT_FRAC = _declare("rank_data_wait_frac", "gauge", *_RANK)
RANK_MEMORY = _declare("rank_memory_frac", "gauge", *_RANK)
RANK_WATERMARK = _declare("rank_memory_watermark_frac", "gauge", *_RANK)
RANK_CRITICAL = _declare("rank_memory_critical_frac", "gauge", *_RANK)
RANK_STEPS = _declare("rank_steps_total", "counter", *_RANK)
RANK_DECISIONS = _declare("rank_decisions_total", "counter", *_RANK, "action")
RANK_PREFETCH = _declare("rank_loader_prefetch_factor", "gauge", *_RANK)
RANK_LOADER_WORKERS = _declare("rank_loader_num_workers", "gauge", *_RANK)


def _gauge(name: str, text: str) -> Any:
    from ray.util.metrics import Gauge
    return Gauge(name, text, tag_keys=EXPORTED[name][1])


def _counter(name: str, text: str) -> Any:
    from ray.util.metrics import Counter
    return Counter(name, text, tag_keys=EXPORTED[name][1])


class NodeMetrics:
    """Gauges for one node monitor's samples, tagged with node id (and GPU index, pid)."""

    def __init__(self) -> None:
        self._gpu = {key: _gauge(name, f"GPU {key} (NVML)") for key, name in GPU_GAUGES.items()}
        self._throttled = _gauge(GPU_THROTTLED, "1 while clocks are throttled for the reason")
        self._host = {key: _gauge(name, f"host {key}") for key, name in HOST_GAUGES.items()}
        self._gpu_ok = _gauge(GPU_MONITORING, "1 with NVML readings, 0 in host-only mode")
        self._worker = _gauge(WORKER_PRIVATE, "train worker private memory (USS)")
        self._loader = _gauge(LOADER_PRIVATE, "its DataLoader workers' private memory")

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
    """Gauges and counters of one run's coordinator, tagged with the run id and the Ray Train
    run name (``run_name``; the run id when None)."""

    def __init__(self, run_id: str, run_name: str | None = None) -> None:
        self._run = {"run_id": str(run_id), RUN_NAME_TAG: str(run_name or run_id)}
        self._excess = _gauge(STRAGGLER_EXCESS,
                              "fraction of a step a rank adds over the reference rank")
        self._cause = _gauge(STRAGGLER_CAUSE, "1 while the rank's score names the cause")
        self._cause_tags: dict[int, dict[str, str]] = {}   # rank -> tags of its last cause
        self._flagged = _gauge(STRAGGLER_NODE, "1 while the node is flagged a straggler")
        self._step = _gauge(STEP_TIME, "step time across ranks")
        self._decisions = _counter(DECISIONS, "cluster decisions made")
        self._ignored = _counter(IGNORED, "reports counted and ignored")
        self._hangs = _counter(HANGS, "hung attempts, labelled with the rank the coordinator "
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


class RankMetrics:
    """Per-step gauges of one training rank, labelled like Ray Train's own worker metrics
    (``ray_train_run_name``, ``ray_train_worker_world_rank``). Created in the train worker.

    :meth:`record` takes a batch of StepStats (the guard drains them every
    ``report_every_steps`` steps, never every step): each gauge ends at the batch's last step,
    the step counter grows by the batch's length. About 2-4 us per ``set`` (REFERENCE.md), a
    dozen per batch.
    """

    def __init__(self, run_name: str, world_rank: int, *, watermark_frac: float | None = None,
                 critical_frac: float | None = None) -> None:
        self.tags = {RUN_NAME_TAG: str(run_name), WORLD_RANK_TAG: str(world_rank)}
        self._step = _gauge(RANK_STEP, "step time of a training rank")
        self._phase = _gauge(RANK_PHASE, "a phase of a training rank's step (data_wait, "
                                         "forward, backward, comm_wait, optimizer)")
        self._compute = _gauge(RANK_COMPUTE, "forward + backward + optimizer of a step")
        self._wait_frac = _gauge(RANK_DATA_WAIT_FRAC, "data wait / step time")
        self._memory = _gauge(RANK_MEMORY, "the rank's memory fraction (device, or its CPU "
                                           "budget) after the step")
        self._steps = _counter(RANK_STEPS, "training steps finished")
        self._decisions = _counter(RANK_DECISIONS, "decisions applied on the rank")
        self._prefetch = _gauge(RANK_PREFETCH, "the DataLoader's prefetch_factor in force")
        self._workers = _gauge(RANK_LOADER_WORKERS, "the DataLoader's num_workers in force")
        self._phase_tags = {p: {**self.tags, "phase": p} for p in PHASES}
        # values that change rarely, set again with every batch: Ray drops a gauge not set for
        # two export intervals (its OpenTelemetry recorder's TTL), so a line set once vanishes
        self._steady: dict[str, tuple[Any, float]] = {}
        if watermark_frac is not None:
            self._steady["watermark"] = (_gauge(RANK_WATERMARK, "memory watermark (release "
                                                "cache)"), float(watermark_frac))
        if critical_frac is not None:
            self._steady["critical"] = (_gauge(RANK_CRITICAL, "memory critical line "
                                               "(checkpoint and stop)"), float(critical_frac))
        self._set_steady()

    def record(self, stats: Iterable[Any]) -> int:
        """Set the gauges from a batch of StepStats (oldest first); returns how many steps."""
        n = 0
        last = None
        for s in stats:
            n += 1
            last = s
        if last is None:
            return 0
        tags = self.tags
        self._step.set(float(last.total_s), tags=tags)
        for phase, ptags in self._phase_tags.items():
            self._phase.set(float(getattr(last, phase + "_s")), tags=ptags)
        self._compute.set(float(last.compute_s), tags=tags)
        self._wait_frac.set(float(last.data_wait_s / last.total_s) if last.total_s > 0 else 0.0,
                            tags=tags)
        if last.memory_frac is not None:
            self._memory.set(float(last.memory_frac), tags=tags)
        self._steps.inc(float(n), tags=tags)
        self._set_steady()
        return n

    def _set_steady(self) -> None:
        for gauge, value in self._steady.values():
            gauge.set(value, tags=self.tags)

    def record_decision(self, decision: Decision) -> None:
        self._decisions.inc(1.0, tags={**self.tags, "action": decision.action.value})

    def record_loader(self, num_workers: int, prefetch_factor: int) -> None:
        """The DataLoader settings in force (set again with every batch from now on)."""
        self._steady["num_workers"] = (self._workers, float(num_workers))
        self._steady["prefetch_factor"] = (self._prefetch, float(prefetch_factor))
        self._set_steady()
