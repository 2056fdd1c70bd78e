"""What a guarded run did, for a person at its end (pure): the launcher's :class:`RunSummary`
and the drop-in's :class:`GuardReport` (``result.guard``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from raytrain_guard.core.decisions import Action
from raytrain_guard.runtime.dropin.summary import combine_summaries
from raytrain_guard.units import format_bytes

logger = logging.getLogger(__name__)

#: actions that report what was seen: the summary lists them under detections
EVENT_ACTIONS = frozenset({Action.SLOW_STEP.value, Action.FLAG_STRAGGLER.value})


@dataclass(frozen=True)
class RunSummary:
    """What a guarded run did, from the workers' results and the coordinator's last status."""

    run_id: str
    steps: int
    total_steps: int
    world_size: int
    global_batch: int
    wall_s: float
    samples_per_s: float | None
    step_p50_s: float | None
    step_p99_s: float | None
    data_wait_frac: float | None
    stopped_early: bool = False
    stop_reason: str | None = None
    detections: tuple[str, ...] = ()
    decisions: tuple[Mapping[str, Any], ...] = ()
    plan: str = ""
    coordinator: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        """The summary a person reads at the end of a run."""
        def s(x: float | None, unit: str = " s", spec: str = ".3f") -> str:
            return "-" if x is None else f"{x:{spec}}{unit}"
        lines = [
            f"run {self.run_id}: {self.steps}/{self.total_steps} steps on {self.world_size} "
            f"ranks (global batch {self.global_batch}) in {self.wall_s:.1f} s"
            + (f"; stopped early: {self.stop_reason}" if self.stopped_early else ""),
            f"  throughput   {s(self.samples_per_s, ' samples/s', '.1f')}",
            f"  step time    p50 {s(self.step_p50_s)}   p99 {s(self.step_p99_s)}",
            f"  data wait    {s(self.data_wait_frac, '', '.1%')} of the step time",
        ]
        if self.plan:
            lines.append(f"  plan         {self.plan}")
        lines.append(f"  detections   {len(self.detections)}")
        lines += [f"    - {d}" for d in self.detections]
        lines.append(f"  decisions    {len(self.decisions)}")
        lines += [f"    - {decision_line(d)}" for d in self.decisions]
        return "\n".join(lines)


def _is_local(d: Mapping[str, Any]) -> bool:
    """A decision of one rank's own gate (its id counts per rank), not of the coordinator."""
    return d.get("scope") == "rank" or not d.get("decision_id")


def decision_line(d: Mapping[str, Any]) -> str:
    """One merged decision (:func:`merge_applied`) as the summary shows it."""
    ranks = d.get("ranks") or []
    if _is_local(d):
        where = f" on rank {ranks[0]} (its own gate)" if len(ranks) == 1 else \
            (f" on ranks {ranks} (their own gates)" if ranks else "")
        return f"{d.get('action')} at step {d.get('applied_at')}{where}: {d.get('reason')}"
    return (f"#{d.get('decision_id')} {d.get('action')} at step {d.get('applied_at')}"
            + (f" on ranks {ranks}" if ranks else "") + f": {d.get('reason')}")


def results_of(result: Any) -> dict[str, Any]:
    """The train loop's results dict, from the metrics of the final checkpoint."""
    metrics = getattr(result, "metrics", None) or {}
    raw = metrics.get("results")
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            logger.warning("unreadable results in the final report")
    return dict(raw or {})


def summarize(run_id: str, results: Mapping[str, Any], status: Mapping[str, Any],
              wall_s: float, plan_line: str = "", global_batch: int = 0) -> RunSummary:
    """The :class:`RunSummary` of a finished run."""
    steps = int(results.get("step", 0))
    world = int(results.get("world_size", 1))
    loaders = results.get("loader") or []
    loop_wall = float(results.get("wall_s") or wall_s)
    fracs = [lo["data_wait_frac"] for lo in loaders
             if isinstance(lo, Mapping) and lo.get("data_wait_frac") is not None]
    merged = merge_applied(results.get("decisions"))
    events = [m for m in merged if m.get("action") in EVENT_ACTIONS]
    detections = [a["reason"] for a in results.get("attribution") or []
                  if a.get("role") not in (None, "normal")]
    detections += [event_line(e) for e in events]
    flagged = {(e.get("params") or {}).get("node_id") for e in events}
    detections += [f"straggler node {n}" for n in status.get("straggler_nodes") or []
                   if n not in flagged]
    detections += list(status.get("notes") or [])
    detections += [f"hang in attempt {h.get('attempt')}: {h.get('reason')}"
                   for h in status.get("hangs") or []]
    if status.get("coordinator_lost"):
        detections.append("coordinator unreachable at the end of the run (training went on "
                          "under the local gate); step times are from its last status")
    return RunSummary(
        run_id=run_id, steps=steps, total_steps=int(results.get("total_steps", steps)),
        world_size=world, global_batch=global_batch, wall_s=round(wall_s, 3),
        samples_per_s=round(steps * global_batch / loop_wall, 2)
        if steps and global_batch and loop_wall > 0 else None,
        step_p50_s=status.get("step_p50_s"), step_p99_s=status.get("step_p99_s"),
        data_wait_frac=round(sum(fracs) / len(fracs), 4) if fracs else None,
        stopped_early=bool(results.get("stopped_early")), stop_reason=results.get("stop_reason"),
        detections=tuple(detections),
        decisions=tuple(m for m in merged if m.get("action") not in EVENT_ACTIONS),
        plan=plan_line, coordinator=dict(status))


def merge_applied(decisions: Any) -> list[dict[str, Any]]:
    """Per-rank decision records (the train loop's) -> one entry per decision: a coordinator
    decision merged by id across ranks, with the steps it was applied at (one when lockstep
    worked) and the ranks that applied it; a rank's own gate decision one entry per rank."""
    merged: dict[Any, dict[str, Any]] = {}
    for d in decisions or []:
        if not isinstance(d, Mapping):
            continue
        did = d.get("decision_id") or 0
        key = (("local", d.get("world_rank"), did, d.get("applied_at"), d.get("action"))
               if _is_local(d) else did)
        entry = merged.setdefault(key, {"decision_id": did, "action": d.get("action"),
                                        "reason": d.get("reason"), "scope": d.get("scope"),
                                        "params": dict(d.get("params") or {}),
                                        "applied_at": d.get("applied_at"), "ranks": [],
                                        "steps": []})
        if d.get("applied") is False:
            continue
        entry["ranks"].append(d.get("world_rank"))
        if d.get("applied_at") not in entry["steps"]:
            entry["steps"].append(d.get("applied_at"))
    return list(merged.values())


def event_line(e: Mapping[str, Any]) -> str:
    """A merged event (``slow_step``, ``flag_straggler``) as a detection line."""
    if e.get("action") == Action.SLOW_STEP.value:
        return str(e.get("reason"))        # its reason names the rank and steps
    return f"{e.get('action')} at step {e.get('applied_at')}: {e.get('reason')}"


@dataclass(frozen=True)
class GuardReport:
    """``result.guard``: what the guard saw and did in a run."""

    run: RunSummary
    """The launcher's summary: steps, throughput, step p50/p99, data wait, detections,
    decisions."""
    attribution: tuple[Mapping[str, Any], ...] = ()
    """One entry per rank: its role (``straggler_compute``, ``straggler_data``, ``waiting``,
    ``normal``) and the reason with the figures."""
    loaders: tuple[Mapping[str, Any] | None, ...] = ()
    """Per rank: the DataLoader settings in force, what was lowered and why, the data wait."""
    attempts: int = 0
    """Worker groups started: each failure ended one, and a run that finished had one more."""
    worker_failures: tuple[Mapping[str, Any], ...] = ()
    """Ray Train's controller's ``after_exception`` calls: the ranks and their errors."""
    num_reports: int = 0
    """``ray.train.report`` rounds the controller saw (``after_report``)."""
    ranks: tuple[Mapping[str, Any], ...] = ()
    """Each rank's own summary (window, decisions, loader, stop), as posted at its end."""

    def format(self) -> str:
        """What a person reads: the run summary, attempts, and each rank's DataLoader settings."""
        lines = [self.run.format(), (f"  attempts     {self.attempts} (worker failures "
                                    f"{len(self.worker_failures)}, reports {self.num_reports})")]
        for rank, loader in enumerate(self.loaders):
            if loader:
                lines.append(f"  loader {rank:<5} {loader_settings(loader)}, data wait "
                             f"{loader.get('data_wait_frac') or 0:.1%}")
                lines += [f"    - lowered: {w}" for w in loader.get("lowered") or ()]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def loader_settings(loader: Mapping[str, Any]) -> str:
    """A rank's loader settings as the summary prints them: a torch DataLoader's workers and
    ``prefetch_factor``, or Ray Data's ``prefetch_batches`` (per epoch when it changed) within
    the host budget."""
    if loader.get("source") != "ray_data":
        return (f"num_workers {loader['num_workers']} prefetch_factor "
                f"{loader['prefetch_factor']} persistent_workers {loader['persistent_workers']}")
    depths = [e["prefetch_batches"] for e in loader.get("epochs") or ()]
    by_epoch = f" (epochs ran at {', '.join(map(str, depths))})" if len(set(depths)) > 1 else ""
    return (f"Ray Data prefetch_batches {loader['prefetch_batches']}{by_epoch}, batch "
            f"{format_bytes(loader.get('batch_bytes') or 0)}, host budget "
            f"{format_bytes(loader.get('budget_bytes') or 0)}")


def build_report(run_id: str, status: Mapping[str, Any], summaries: Mapping[int, Any],
                 events: list[Mapping[str, Any]], wall_s: float, plan_line: str = "", *,
                 straggler_frac: float, finished: bool = True) -> GuardReport:
    """The :class:`GuardReport` of a run from what the coordinator gathered."""
    ranks = [summaries[r] for r in sorted(summaries)]
    combined = combine_summaries(ranks, straggler_frac=straggler_frac) if ranks else {}
    loaders = combined.get("loader") or []
    results = {"step": combined.get("steps", 0), "world_size": len(ranks) or 1,
               "loader": [lo for lo in loaders if lo],
               "decisions": combined.get("decisions") or [],
               "attribution": combined.get("attribution") or [],
               "stopped_early": combined.get("stopped_early", False),
               "stop_reason": combined.get("stop_reason")}
    batch = sum(lo["batch_size"] for lo in loaders if lo)
    run = summarize(run_id, results, status, wall_s, plan_line, batch)
    failures = tuple(e for e in events if e.get("kind") == "exception")
    return GuardReport(run=run, attribution=tuple(results["attribution"]),
                       loaders=tuple(loaders),
                       attempts=max(int(status.get("attempt") or 0),
                                    len(failures) + (1 if finished else 0)),
                       worker_failures=failures,
                       num_reports=sum(1 for e in events if e.get("kind") == "report"),
                       ranks=tuple(ranks))
