"""What one arm of the experiment did, from the files its ranks wrote (standard library only).

Every rank of every attempt appends JSON lines to ``trace/rank<r>.jsonl`` (``start``, ``step``,
``decision``, ``hang``, ``error``, ``end`` records, each with its process's ``attempt`` id and
wall time) and the sample ids it consumed to ``audit/rank<r>.jsonl``; :func:`analyze_arm` turns
them into the arm's figures (the ARM object of docs/experiment.md), or raises
:class:`ArmTracesError` when the ranks left no trace.

A detection is dated by the step during which, or at whose end, it reached the rank
(:func:`detections_of`), and names a fault only on one of its ranks (or, for a slow link that
every rank waits on, on any rank by the fault's cause), at or after its start and at most
:class:`Lateness` after its last step (:func:`can_name`). Why these bounds:
docs/experiment.md ("Detections: their date, and how late they may come").
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from raytrain_guard.core.hang import HangRecord, name_hung_rank
from raytrain_guard.core.stats import nearest_rank
from raytrain_guard.errors import GuardError
from raytrain_guard.experiment.attempts import attempt_spans, error_line, first_error_per_attempt
from raytrain_guard.experiment.audit import audit_arm, lost_steps
from raytrain_guard.experiment.faults import FaultSpec

#: decision records that say what was seen, not what was done
DETECTION_ACTIONS = frozenset({"slow_step", "flag_straggler"})
#: a fault's cause is named in time when the detection comes within this many steps of its start
DETECTION_DELAY_TARGET_STEPS = 5


@dataclass(frozen=True)
class Lateness:
    """How many steps after a fault's last step a detection may come and still name it, by the
    detection's ``source``; the defaults are the guard's."""

    rank_steps: int = 3          # num_slow_steps
    cluster_steps: int = 20      # report_every_steps + lockstep_every_steps

    def of(self, detection: Mapping[str, Any]) -> int:
        return self.cluster_steps if detection.get("source") == "cluster" else self.rank_steps


class ArmTracesError(GuardError):
    """An arm's ranks left no trace (or only some of them did): no figures can be made of it."""


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The records of a JSON-lines file; a torn last line (a killed process) is skipped."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as fh:
        for line in fh:
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records


def read_ranks(directory: str) -> dict[int, list[dict[str, Any]]]:
    """``rank<r>.jsonl`` files of ``directory`` -> {rank: records}."""
    if not os.path.isdir(directory):
        return {}
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("rank") and name.endswith(".jsonl"):
            rank = int(name[4:-6])
            out[rank] = [{**r, "_rank": rank} for r in read_jsonl(os.path.join(directory, name))]
    return out


def _quantile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank quantile, rounded (None for no values)."""
    return round(nearest_rank(sorted(values), q), 5) if values else None


def _attempt_order(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """Attempt ids of one rank in the order they started."""
    starts = sorted((r["wall"], r["attempt"]) for r in records if r.get("t") == "start")
    return [a for _, a in starts]


def can_name(fault: FaultSpec, rank: Any, step: int | None, *, late_steps: int,
             cause: str | None = None) -> bool:
    """Whether a detection on ``rank`` of ``cause`` dated ``step`` can name ``fault``: on one of
    its ranks (any rank, by the fault's cause, for a fault every rank waits on: a slow link
    holds every rank's collective), at or after its start, at most ``late_steps`` after its
    last step."""
    felt = rank in fault.ranks or (fault.felt_by_all and cause is not None
                                   and cause == fault.cause)
    if step is None or not felt or step < fault.start:
        return False
    last = fault.last_step
    return last is None or step <= last + late_steps


def match_detections(faults: Sequence[FaultSpec], detections: Sequence[Mapping[str, Any]], *,
                     lateness: Lateness = Lateness()) -> list[dict[str, Any]]:
    """Each detection with the fault it follows (of the faults it can name, :func:`can_name`, the
    latest started) and its delay; a fault's expected cause says whether it was named right."""
    out = []
    for d in detections:
        rank, step = d.get("rank"), d.get("step")
        onset = [f for f in faults if can_name(f, rank, step, late_steps=lateness.of(d),
                                               cause=d.get("cause"))]
        fault = max(onset, key=lambda f: f.start) if onset else None
        out.append({**d, "fault": fault.kind if fault else None,
                    "onset_step": fault.start if fault else None,
                    "delay_steps": step - fault.start if fault else None,
                    "right_cause": bool(fault and fault.cause and d.get("cause") == fault.cause)})
    return out


def fault_outcomes(faults: Sequence[FaultSpec], detections: Sequence[Mapping[str, Any]], *,
                   lateness: Lateness = Lateness()) -> list[dict[str, Any]]:
    """Per fault with a cause: the first detection of that cause that can name it, and whether it
    came within :data:`DETECTION_DELAY_TARGET_STEPS` of its start. A fault on a node (its
    ranks named, :meth:`FaultSpec.on_ranks`) is named only by a detection of that node as a
    node (``target`` ``"node"``, its ``node_index``), not by its ranks one by one."""
    out = []
    for f in faults:
        if f.cause is None:
            continue
        hits = sorted((d for d in detections if d.get("cause") == f.cause
                       and can_name(f, d.get("rank"), d.get("step"),
                                    late_steps=lateness.of(d), cause=d.get("cause"))
                       and (f.node is None or (d.get("target") == "node"
                                               and d.get("node_index") == f.node))),
                      key=lambda d: d["step"])
        first = hits[0] if hits else None
        delay = first["step"] - f.start if first else None
        outcome = {"fault": str(f), "cause": f.cause, "named_at_step": first and first["step"],
                   "delay_steps": delay,
                   "in_time": delay is not None and delay <= DETECTION_DELAY_TARGET_STEPS}
        if f.node is not None:
            outcome.update(node_index=f.node, ranks=list(f.ranks),
                           node_id=first.get("node_id") if first else None)
        out.append(outcome)
    return out


def detections_of(decisions: Sequence[Mapping[str, Any]], hangs: Sequence[Mapping[str, Any]],
                  starts: Sequence[Mapping[str, Any]],
                  node_of: Mapping[tuple[int, int], str] | None = None) -> list[dict[str, Any]]:
    """Slow steps (``source`` ``"rank"``: the rank's gate), stragglers (``"cluster"``: the
    coordinator) and hangs (``"rank"``: the watchdogs). A decision recorded at ``applied_at``
    (steps finished) is dated ``applied_at - 1``, a hang by its step. A slow step the gate read
    as its node's (``node_wide``: the node's other ranks slowed too) names that node
    (``target`` ``"node"``), whose id ``node_of`` gives per (rank, attempt)."""
    detections = [{"kind": f"slow_step ({d.get('cause')})", "rank": d.get("world_rank"),
                   "cause": d.get("cause"), "step": _dated(d), "source": "rank",
                   "reason": d.get("reason"),
                   **({"target": "node",
                       "node_id": (node_of or {}).get((d.get("world_rank"), d.get("_try")))}
                      if d.get("params", {}).get("node_wide") else {})}
                  for d in decisions if d.get("action") == "slow_step"]
    detections += [{"kind": "straggler", "rank": r, "cause": d.get("cause"), "step": _dated(d),
                    "source": "cluster", "reason": d.get("reason"),
                    "target": d.get("params", {}).get("target"),
                    "node_id": d.get("params", {}).get("node_id")}
                   for d in _merged(decisions) if d.get("action") == "flag_straggler"
                   for r in d.get("params", {}).get("world_ranks", ())]
    return detections + _hang_detections(hangs, starts)


def node_ranks(traces: Mapping[int, Sequence[Mapping[str, Any]]], node_ids: Sequence[str]
               ) -> list[dict[str, Any]]:
    """Per node of the experiment (its place in ``node_ids``), the ranks that ran there in any
    attempt (their ``start`` records' ``node_id``)."""
    ranks: dict[str, set[int]] = defaultdict(set)
    for rank, records in traces.items():
        for r in records:
            if r.get("t") == "start" and r.get("node_id"):
                ranks[r["node_id"]].add(rank)
    return [{"node_index": i, "node_id": n, "ranks": sorted(ranks.get(n, ()))}
            for i, n in enumerate(node_ids)]


def on_nodes(faults: Sequence[FaultSpec], nodes: Sequence[Mapping[str, Any]]
             ) -> list[FaultSpec]:
    """``faults`` with each node fault's ranks named: those of :func:`node_ranks` there."""
    ranks = {n["node_index"]: n["ranks"] for n in nodes}
    return [f.on_ranks(ranks.get(f.node, ())) if f.node is not None else f for f in faults]


def _with_node_index(detections: Sequence[dict[str, Any]], node_ids: Sequence[str]
                     ) -> list[dict[str, Any]]:
    """Each detection that names a Ray node with its place in the experiment (``node_index``;
    None for a node outside ``node_ids``)."""
    index = {n: i for i, n in enumerate(node_ids)}
    return [{**d, "node_index": index.get(d["node_id"])} if d.get("node_id") else d
            for d in detections]


#: decisions taken inside the step they apply to, on that step's own batch (the spike splitter
#: prices a micro-batch before its forward): they answer that step, not the one before it
IN_STEP_ACTIONS = frozenset({"split_micro_batch"})


def dated_step(action: str | None, applied_at: int | None) -> int | None:
    """The step a decision answers: ``applied_at - 1`` (``applied_at`` steps had finished: the
    last of them is what it was decided on), or ``applied_at`` itself for one decided inside
    that step (:data:`IN_STEP_ACTIONS`). The one dating rule of detections and decisions."""
    if applied_at is None:
        return None
    return int(applied_at) - (0 if action in IN_STEP_ACTIONS else 1)


def _dated(decision: Mapping[str, Any]) -> int | None:
    return dated_step(decision.get("action"), decision.get("applied_at"))


def analyze_arm(arm_dir: str, faults: Sequence[FaultSpec], *, num_samples: int | None,
                launch_error: str | None, wall_s: float, num_workers: int | None = None,
                epoch_order: Callable[[int], Sequence[Any]] | None = None,
                lateness: Lateness = Lateness(), node_ids: Sequence[str] = ()) -> dict[str, Any]:
    """The ARM object of the experiment's report. A rank below ``num_workers`` without a trace
    raises :class:`ArmTracesError` naming the folder read. ``epoch_order``: the sampler's order
    of an epoch's ids, for the exact audit (:func:`~raytrain_guard.experiment.audit.audit_arm`).
    ``node_ids``: the experiment's Ray nodes, node 0 first (node faults and ``nodes``)."""
    trace_dir = os.path.join(arm_dir, "trace")
    traces = {r: records for r, records in read_ranks(trace_dir).items() if records}
    _check_traces(traces, trace_dir, num_workers, launch_error)
    audits = read_ranks(os.path.join(arm_dir, "audit"))
    orders = {rank: _attempt_order(records) for rank, records in traces.items()}
    for rank, records in traces.items():      # _try: which attempt of the run, from 0
        index = {a: i for i, a in enumerate(orders[rank])}
        for r in records:
            r["_try"] = index.get(r.get("attempt"), -1)
    rank0 = traces.get(0, [])
    starts = [r for r in rank0 if r.get("t") == "start"]
    ends = [r for r in rank0 if r.get("t") == "end"]
    first = starts[0] if starts else {}
    world = int(first.get("world_size") or num_workers or len(traces) or 1)
    micro, accum = int(first.get("micro_batch") or 0), int(first.get("grad_accum") or 1)
    total_steps = int(first.get("total_steps") or 0)
    audit0 = audits.get(0, [])
    steps_done = _steps_done(rank0, audit0, ends)
    audit = audit_arm(audits, orders, world_size=world, steps_done=steps_done,
                      num_samples=num_samples, step_samples=_step_samples(traces),
                      epoch_order=epoch_order, audit_dir=os.path.join(arm_dir, "audit"))

    def records_of(kind: str) -> list[dict[str, Any]]:
        return [r for records in traces.values() for r in records if r.get("t") == kind]

    steps, errors, decisions, hangs = map(records_of, ("step", "error", "decision", "hang"))
    totals = [r["total_s"] for r in steps]
    in_fault = [r for r in steps if any(f.active(r["step"]) for f in faults)]
    fracs = [r["memory_frac"] for r in steps if r.get("memory_frac") is not None]
    node_of = {(rank, r.get("_try")): r["node_id"]
               for rank, records in traces.items() for r in records
               if r.get("t") == "start" and r.get("node_id")}
    detections = _with_node_index(detections_of(decisions, hangs, starts, node_of), node_ids)
    nodes = node_ranks(traces, node_ids)
    faults = on_nodes(faults, nodes)
    completed = bool(ends) and launch_error is None
    train_wall = (ends[-1]["wall"] - starts[0]["wall"]) if ends and starts else None
    # rank 0's steps alone: start-up, checkpoints and restarts left out (the steps' own pace)
    rank0_steps = [r for r in rank0 if r.get("t") == "step"]
    step_time = sum(r["total_s"] for r in rank0_steps)
    return {
        "completed": completed,
        "error": None if completed else (error_line(errors) or launch_error),
        "attempt_errors": [error_line([e]) for e in first_error_per_attempt(errors)],
        "attempts": len(starts),
        "attempt_spans": attempt_spans(starts, errors),
        "steps": steps_done, "total_steps": total_steps,
        "lost_steps": lost_steps(audit0) if audit.audited else None,
        **audit.to_dict(),
        "wall_s": round(wall_s, 2),
        "train_wall_s": round(train_wall, 2) if train_wall else None,
        "samples_per_s": round(steps_done * micro * accum * world / train_wall, 1)
        if train_wall else None,
        "step_samples_per_s": round(len(rank0_steps) * micro * accum * world / step_time, 1)
        if step_time else None,
        "step_p50_s": _quantile(totals, 0.5), "step_p99_s": _quantile(totals, 0.99),
        "data_wait_frac": _wait_frac(steps),
        "fault_data_wait_frac": _wait_frac(in_fault),
        "peak_memory_frac": round(max(fracs), 4) if fracs else None,
        "batch_changes": [{"step": d.get("applied_at"), **d.get("params", {})}
                          for d in _merged(decisions)
                          if d.get("action") == "shrink_micro_batch" and d.get("applied")],
        "detections": match_detections(faults, detections, lateness=lateness),
        "fault_detection": fault_outcomes(faults, detections, lateness=lateness),
        "decisions": [_decision(d) for d in _merged(decisions)
                      if d.get("action") not in DETECTION_ACTIONS],
        "nodes": nodes,
    }


def _check_traces(traces: Mapping[int, Sequence[Mapping[str, Any]]], trace_dir: str,
                  num_workers: int | None, launch_error: str | None) -> None:
    """:class:`ArmTracesError` for an arm with no trace records, or without a rank's."""
    cause = f"; the launch failed: {launch_error}" if launch_error else ""
    if not traces:
        raise ArmTracesError(f"no trace records in {trace_dir}: the arm's workers wrote none "
                             f"there{cause}")
    missing = [r for r in range(num_workers or 0) if r not in traces]
    if missing:
        raise ArmTracesError(
            f"traces of {len(traces)} of {num_workers} ranks in {trace_dir}: rank "
            f"{', '.join(map(str, missing))} wrote none there{cause}")


def _steps_done(rank0: Sequence[Mapping[str, Any]], audit0: Sequence[Mapping[str, Any]],
                ends: Sequence[Mapping[str, Any]]) -> int:
    """Steps the lineage finished: the ``end`` record's; else the steps finished when the last
    attempt failed (its ``error`` record on rank 0); else what rank 0's traced steps and its
    audit show (a step whose ids were recorded may not have finished: the steps before the
    last audited one did)."""
    if ends:
        return int(ends[-1]["step"])
    last_try = max((r.get("_try", -1) for r in rank0), default=-1)
    failed = [r for r in rank0 if r.get("t") == "error" and r.get("_try") == last_try
              and r.get("step") is not None]
    if failed:
        return int(failed[-1]["step"])
    traced = max((int(r["step"]) + 1 for r in rank0 if r.get("t") == "step"), default=0)
    return max(traced, max((int(r["step"]) for r in audit0), default=0))


def _step_samples(traces: Mapping[int, Sequence[Mapping[str, Any]]]) -> dict[int, int]:
    """{step: micro_batch x grad_accum} from the traced steps (the latest attempt's)."""
    out: dict[int, tuple[int, int]] = {}
    for records in traces.values():
        for r in records:
            if r.get("t") == "step" and r.get("micro_batch"):
                value = int(r["micro_batch"]) * int(r.get("grad_accum") or 1)
                known = out.get(int(r["step"]))
                if known is None or r.get("_try", -1) >= known[0]:
                    out[int(r["step"])] = (r.get("_try", -1), value)
    return {step: value for step, (_, value) in out.items()}


def _wait_frac(steps: Sequence[Mapping[str, Any]]) -> float | None:
    """Data wait over step time, summed over ``steps`` (None for none)."""
    total = sum(r["total_s"] for r in steps)
    return round(sum(r.get("data_wait_s", 0.0) for r in steps) / total, 4) if total else None


def _merged(decisions: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Decision records -> one per decision: coordinator decisions by id across ranks (with the
    ranks that applied them), a rank's own decisions one each."""
    merged: dict[Any, dict[str, Any]] = {}
    for d in decisions:
        did = d.get("decision_id") or 0
        key = (d.get("world_rank"), d.get("attempt"), d.get("applied_at"), d.get("action")) \
            if d.get("scope") == "rank" or not did else did
        entry = merged.setdefault(key, {**d, "ranks": []})
        if d.get("applied", True):
            entry["ranks"].append(d.get("world_rank"))
    return list(merged.values())


def _decision(d: Mapping[str, Any]) -> dict[str, Any]:
    return {"action": d.get("action"), "step": d.get("applied_at"), "ranks": d.get("ranks"),
            "applied": bool(d.get("ranks")), "reason": d.get("reason"),
            "predicted": d.get("predicted"), "measured": d.get("measured")}


def _hang_detections(hangs: Sequence[Mapping[str, Any]], starts: Sequence[Mapping[str, Any]]
                     ) -> list[dict[str, Any]]:
    """Per attempt, the hung rank by the coordinator's rule (:func:`raytrain_guard.core.hang.
    name_hung_rank`) over the watchdog records the ranks wrote down; an attempt whose ranks
    the rule cannot tell apart (a tie) names none."""
    out = []
    by_try: dict[Any, list[Mapping[str, Any]]] = defaultdict(list)
    for h in hangs:
        by_try[h.get("_try")].append(h)
    for group in by_try.values():
        records = {}
        for h in group:
            try:
                records[h["world_rank"]] = (HangRecord.from_dict(h), h)
            except (KeyError, ValueError):
                continue                     # a record from before its fields existed
        verdict = name_hung_rank([r for r, _ in records.values()], waited_s=math.inf)
        if verdict is None or verdict.world_rank not in records:
            continue
        hung = records[verdict.world_rank][1]
        began = hung["wall"] - hung.get("step_for_s", 0.0)
        restart = min((r["wall"] for r in starts if r["wall"] > hung["wall"]), default=None)
        out.append({"kind": "hang", "rank": verdict.world_rank, "cause": "hang", "source": "rank",
                    "step": verdict.step, "phase": verdict.phase,
                    "seconds_to_detect": hung.get("step_for_s"),
                    "seconds_to_restart": None if restart is None else round(restart - began, 2),
                    "reason": verdict.reason})
    return out
