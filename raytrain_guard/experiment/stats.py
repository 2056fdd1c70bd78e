"""Figures over the experiment's repeats: per arm, the median of a metric across repeats and its
95 % percentile-bootstrap interval (standard library only).

:func:`bootstrap_median` resamples the repeats' values with replacement (``resamples`` times,
``random.Random(seed)``: the same values give the same interval), takes each resample's median
and reads the interval off the 2.5th and 97.5th percentiles of those medians. :func:`arm_stats`
applies it to every metric of an arm (:data:`METRICS`, each fault's detection delay, the false
events per 1000 clean steps) and :func:`act_observe_stats` to the act/observe throughput ratio
of each pair of arms that ran with the same seed. Which metrics and why: docs/experiment.md
("Repeats").
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from raytrain_guard.core.stats import median_of_sorted
from raytrain_guard.experiment.analysis import DETECTION_DELAY_TARGET_STEPS, dated_step

#: the interval's confidence, the resamples drawn and the RNG's seed (fixed: a report reproduces)
CONFIDENCE = 0.95
RESAMPLES = 2000
BOOTSTRAP_SEED = 0

#: an arm's figures summarised over its repeats: (stats key, ARM key)
METRICS: Sequence[tuple[str, str]] = (
    ("samples_per_s", "samples_per_s"), ("step_samples_per_s", "step_samples_per_s"),
    ("data_wait_frac", "data_wait_frac"), ("peak_memory_frac", "peak_memory_frac"),
    ("lost_steps", "lost_steps"), ("samples_lost", "samples_lost"),
    ("samples_repeated", "samples_repeated"), ("host_oom_kills", "host_oom_kills"),
)
#: the throughput whose act/observe ratio is taken per pair: the steps' own pace (start-up,
#: checkpoints and restarts left out, as in benchmarks/experiment.py)
RATIO_KEY = "step_samples_per_s"
FALSE_EVENTS = "false_events_per_1000_clean_steps"
ACT_OBSERVE = "act_observe_step_samples_per_s"
#: the key of ``[k, N]`` in a ``fault_detection`` entry: named within the detection target
NAMED_WITHIN = f"named_within_{DETECTION_DELAY_TARGET_STEPS}"


@dataclass(frozen=True)
class Interval:
    """The median of ``values`` (in the repeats' order) and its bootstrap interval
    ``[low, high]``."""

    median: float
    low: float
    high: float
    values: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"median": _round(self.median), "low": _round(self.low),
                "high": _round(self.high), "n": len(self.values), "values": list(self.values)}


def bootstrap_median(values: Sequence[float], *, confidence: float = CONFIDENCE,
                     resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED) -> Interval | None:
    """The median of ``values`` and its percentile-bootstrap interval (None for no values).

    Example: [10, 11, 12] -> median 11; resampled medians lie in 10..12, so the interval is
    within [10, 12] and holds 11. One value v -> [v, v].
    """
    ordered = sorted(values)
    if not ordered:
        return None
    rng = random.Random(seed)
    n = len(ordered)
    medians = sorted(median_of_sorted(sorted(rng.choices(ordered, k=n)))
                     for _ in range(resamples))
    tail = (1 - confidence) / 2
    return Interval(median=median_of_sorted(ordered), low=_percentile(medians, tail),
                    high=_percentile(medians, 1 - tail), values=tuple(values))


def _percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted values, linear between neighbours."""
    position = q * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def _round(x: float) -> float:
    return round(x, 5)


def clean_steps(steps: int, faults: Sequence[Any]) -> int:
    """Steps ``0 .. steps - 1`` of the lineage outside every fault's own steps (its start to
    :attr:`~raytrain_guard.experiment.faults.FaultSpec.last_step`; a fault without an end: to the
    end)."""
    return sum(1 for s in range(steps) if not _in_a_window(s, faults, 0))


def false_events(arm: Mapping[str, Any], faults: Sequence[Any], *,
                 late_steps: int) -> int:
    """Events that matched no fault: detections the analysis matched to none (their ``fault``
    is None), and applied decisions dated (:func:`~raytrain_guard.experiment.analysis.
    dated_step`: the step before the one they apply at, or that one for a split) outside every
    fault's window, from its start to ``late_steps`` after its last step (a decision names no
    rank's fault: any fault's window excuses it)."""
    unmatched = sum(1 for d in arm.get("detections") or () if d.get("fault") is None)
    return unmatched + sum(
        1 for d in arm.get("decisions") or ()
        if d.get("applied") and not _in_a_window(dated_step(d.get("action"), d.get("step")),
                                                 faults, late_steps))


def _in_a_window(step: int | None, faults: Sequence[Any], late_steps: int) -> bool:
    """Whether ``step`` lies from a fault's start to ``late_steps`` after its last step."""
    if step is None:
        return False
    for f in faults:
        last = f.last_step
        if step >= f.start and (last is None or step <= last + late_steps):
            return True
    return False


def false_events_per_1000(arm: Mapping[str, Any], faults: Sequence[Any], *,
                          late_steps: int) -> float | None:
    """:func:`false_events` per 1000 of the arm's :func:`clean_steps` (None with none)."""
    clean = clean_steps(int(arm.get("steps") or 0), faults)
    return 1000 * false_events(arm, faults, late_steps=late_steps) / clean if clean else None


def named_within(repeats: Sequence[Mapping[str, Any]], fault: str,
                 target_steps: int = DETECTION_DELAY_TARGET_STEPS) -> list[int]:
    """``[k, N]``: of the ``N`` repeats, the ``k`` whose ``fault_detection`` named ``fault``
    (its spec string) within ``target_steps`` of its start."""
    hits = 0
    for arm in repeats:
        for f in arm.get("fault_detection") or ():
            if f["fault"] == fault and f.get("delay_steps") is not None \
                    and f["delay_steps"] <= target_steps:
                hits += 1
                break
    return [hits, len(repeats)]


def delay_key(fault: str) -> str:
    """The stats key of a fault's detection delay: ``delay_steps <spec>``."""
    return f"delay_steps {fault}"


def arm_stats(repeats: Sequence[Mapping[str, Any]], faults: Sequence[Any], *,
              late_steps: int) -> dict[str, dict[str, Any]]:
    """``{metric: {"median", "low", "high", "n", "values"}}`` of one arm over its repeats:
    :data:`METRICS`, each fault's detection delay in steps (over the repeats that named it:
    ``n`` of them) and the false events per 1000 clean steps. A metric no repeat has is left out."""
    series: dict[str, list[float]] = {key: [arm[name] for arm in repeats
                                            if arm.get(name) is not None]
                                      for key, name in METRICS}
    specs = [f["fault"] for f in repeats[0].get("fault_detection") or ()] if repeats else []
    for spec in specs:
        series[delay_key(spec)] = [f["delay_steps"] for arm in repeats
                                   for f in arm.get("fault_detection") or ()
                                   if f["fault"] == spec and f.get("delay_steps") is not None]
    series[FALSE_EVENTS] = [x for x in (false_events_per_1000(arm, faults, late_steps=late_steps)
                                        for arm in repeats) if x is not None]
    return {key: interval.to_dict() for key, values in series.items()
            if (interval := bootstrap_median(values)) is not None}


def act_observe_stats(observe: Sequence[Mapping[str, Any]], act: Sequence[Mapping[str, Any]]
                      ) -> dict[str, Any] | None:
    """The act/observe ratio of :data:`RATIO_KEY`, per pair (the same repeat, the same seed),
    over the pairs where both have it."""
    ratios = [a[RATIO_KEY] / o[RATIO_KEY] for o, a in zip(observe, act)
              if o.get(RATIO_KEY) and a.get(RATIO_KEY)]
    interval = bootstrap_median(ratios)
    return interval.to_dict() if interval else None


def summarize_repeats(runs: Mapping[str, Sequence[Mapping[str, Any]]], faults: Sequence[Any], *,
                      late_steps: int) -> dict[str, dict[str, Any]]:
    """Per arm, its ARM object over ``runs[arm]`` (one ARM object per repeat, in order): the
    first repeat's figures as they are, each ``fault_detection`` entry with
    ``named_within_5`` (:func:`named_within`), ``repeats`` (every repeat's ARM object) and
    ``stats`` (:func:`arm_stats`; the act arm's also the act/observe ratio,
    :func:`act_observe_stats`, when both arms ran)."""
    out = {}
    for arm, repeats in runs.items():
        first = copy.deepcopy(dict(repeats[0]))
        for f in first.get("fault_detection") or ():
            f[NAMED_WITHIN] = named_within(repeats, f["fault"])
        first["repeats"] = [dict(r) for r in repeats]
        first["stats"] = arm_stats(repeats, faults, late_steps=late_steps)
        out[arm] = first
    if "observe" in runs and "act" in runs:
        ratio = act_observe_stats(runs["observe"], runs["act"])
        if ratio is not None:
            out["act"]["stats"][ACT_OBSERVE] = ratio
    return out
