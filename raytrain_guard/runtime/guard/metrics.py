"""A training rank's Ray metrics (``ray.util.metrics``), and the catalog of every metric the
package exports (:data:`EXPORTED`, with the node monitors' and the coordinator's from
:mod:`raytrain_guard.cluster.metrics`): what the dashboard may query.

Every metric is named ``raytrain_guard_<what>_<unit>`` (Grafana sees Ray's ``ray_`` prefix in
front); tag values are strings (Ray rejects anything else). Create these objects in the process
that records them (the train worker), never in the driver.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from raytrain_guard.core.decisions import Decision

PREFIX = "raytrain_guard_"
RUN_NAME_TAG = "ray_train_run_name"          # Ray Train's own tag keys (metrics/base.py, worker.py)
WORLD_RANK_TAG = "ray_train_worker_world_rank"
#: StepStats fields exported as ``raytrain_guard_rank_phase_seconds{phase=...}``
PHASES = ("data_wait", "forward", "backward", "comm_wait", "optimizer")

#: name -> (kind, tag keys) of every metric this module creates (without Ray's ``ray_`` prefix):
#: what the Grafana dashboard may query (a test holds every panel to it)
EXPORTED: dict[str, tuple[str, tuple[str, ...]]] = {}


def declare(name: str, kind: str, *tags: str) -> str:
    EXPORTED[PREFIX + name] = (kind, tags)
    return PREFIX + name


_RANK = (RUN_NAME_TAG, WORLD_RANK_TAG)

# each training rank (RankMetrics)
RANK_STEP = declare("rank_step_seconds", "gauge", *_RANK)
RANK_PHASE = declare("rank_phase_seconds", "gauge", *_RANK, "phase")
RANK_COMPUTE = declare("rank_compute_seconds", "gauge", *_RANK)
RANK_DATA_WAIT_FRAC = declare("rank_data_wait_frac", "gauge", *_RANK)
RANK_MEMORY = declare("rank_memory_frac", "gauge", *_RANK)
RANK_WATERMARK = declare("rank_memory_watermark_frac", "gauge", *_RANK)
RANK_CRITICAL = declare("rank_memory_critical_frac", "gauge", *_RANK)
RANK_STEPS = declare("rank_steps_total", "counter", *_RANK)
RANK_DECISIONS = declare("rank_decisions_total", "counter", *_RANK, "action")
RANK_PREFETCH = declare("rank_loader_prefetch_factor", "gauge", *_RANK)
RANK_LOADER_WORKERS = declare("rank_loader_num_workers", "gauge", *_RANK)



def gauge(name: str, text: str) -> Any:
    from ray.util.metrics import Gauge
    return Gauge(name, text, tag_keys=EXPORTED[name][1])


def counter(name: str, text: str) -> Any:
    from ray.util.metrics import Counter
    return Counter(name, text, tag_keys=EXPORTED[name][1])


class RankMetrics:
    """Per-step gauges of one training rank, labelled like Ray Train's own worker metrics
    (``ray_train_run_name``, ``ray_train_worker_world_rank``), so that a Grafana panel joins
    them with Ray's Train panels. :meth:`record` takes a batch of StepStats (every
    ``report_every_steps`` steps, off the hot path): each gauge ends at the batch's last step,
    the step counter grows by the batch's length.
    """

    def __init__(self, run_name: str, world_rank: int, *, watermark_frac: float | None = None,
                 critical_frac: float | None = None) -> None:
        self.tags = {RUN_NAME_TAG: str(run_name), WORLD_RANK_TAG: str(world_rank)}
        self._step = gauge(RANK_STEP, "step time of a training rank")
        self._phase = gauge(RANK_PHASE, "a phase of a training rank's step (data_wait, "
                                         "forward, backward, comm_wait, optimizer)")
        self._compute = gauge(RANK_COMPUTE, "forward + backward + optimizer of a step")
        self._wait_frac = gauge(RANK_DATA_WAIT_FRAC, "data wait / step time")
        self._memory = gauge(RANK_MEMORY, "the rank's memory fraction (device, or its CPU "
                                           "budget) after the step")
        self._steps = counter(RANK_STEPS, "training steps finished")
        self._decisions = counter(RANK_DECISIONS, "decisions applied on the rank")
        self._prefetch = gauge(RANK_PREFETCH, "the DataLoader's prefetch_factor in force")
        self._workers = gauge(RANK_LOADER_WORKERS, "the DataLoader's num_workers in force")
        self._phase_tags = {p: {**self.tags, "phase": p} for p in PHASES}
        # values that change rarely, set again with every batch: Ray drops a gauge not set for
        # two export intervals (its OpenTelemetry recorder's TTL), so a line set once vanishes
        self._steady: dict[str, tuple[Any, float]] = {}
        if watermark_frac is not None:
            self._steady["watermark"] = (gauge(RANK_WATERMARK, "memory watermark (release "
                                                "cache)"), float(watermark_frac))
        if critical_frac is not None:
            self._steady["critical"] = (gauge(RANK_CRITICAL, "memory critical line "
                                               "(checkpoint and stop)"), float(critical_frac))
        self._set_steady()

    def record(self, stats: Iterable[Any]) -> int:
        """Set the gauges from a batch of StepStats (oldest first); returns how many steps."""
        stats = list(stats)
        if not stats:
            return 0
        last, tags = stats[-1], self.tags
        self._step.set(float(last.total_s), tags=tags)
        for phase, ptags in self._phase_tags.items():
            self._phase.set(float(getattr(last, phase + "_s")), tags=ptags)
        self._compute.set(float(last.compute_s), tags=tags)
        self._wait_frac.set(float(last.data_wait_s / last.total_s) if last.total_s > 0 else 0.0,
                            tags=tags)
        if last.memory_frac is not None:
            self._memory.set(float(last.memory_frac), tags=tags)
        self._steps.inc(float(len(stats)), tags=tags)
        self._set_steady()
        return len(stats)

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
