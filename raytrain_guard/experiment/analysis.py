"""What one arm of the experiment did, from the files its ranks wrote (standard library only).

Every rank of every attempt appends JSON lines to ``trace/rank<r>.jsonl`` (``start``, ``step``,
``decision``, ``hang``, ``error``, ``end`` records, each with its process's ``attempt`` id and
wall time) and, per micro-batch, the sample ids it consumed to ``audit/rank<r>.jsonl``.
:func:`analyze_arm` turns them into the arm's figures: whether it completed, its attempts, the
steps it computed twice, the samples of the finished lineage lost or repeated, the step-time
quantiles, data wait, peak memory, detections (matched to the faults they follow) and
decisions with their predicted and measured effects.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from raytrain_guard.core.faults import FaultSpec

#: decision records that say what was seen, not what was done
DETECTION_ACTIONS = frozenset({"slow_step", "flag_straggler"})
#: a fault's cause is named in time when the detection comes within this many steps of its start
DETECTION_DELAY_TARGET_STEPS = 5


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


def quantile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _attempt_order(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """Attempt ids of one rank in the order they started."""
    starts = sorted((r["wall"], r["attempt"]) for r in records if r.get("t") == "start")
    return [a for _, a in starts]


def lineage(audit: Sequence[Mapping[str, Any]], order: Sequence[str]) -> dict[int, list[Any]]:
    """{step: ids} of the lineage that finished: each step as its last attempt ran it."""
    rank_of = {a: i for i, a in enumerate(order)}
    by_step: dict[int, tuple[int, list[Any]]] = {}
    for rec in audit:
        key = rank_of.get(rec.get("attempt"), -1)
        step = int(rec["step"])
        known = by_step.get(step)
        if known is None or key > known[0]:
            by_step[step] = (key, list(rec["ids"]))
        elif key == known[0]:
            known[1].extend(rec["ids"])
    return {step: ids for step, (_, ids) in by_step.items()}


def lost_steps(audit: Sequence[Mapping[str, Any]]) -> int:
    """Steps computed more than once (again after a restart), from one rank's audit."""
    runs = Counter()
    for attempt, step in {(r.get("attempt"), int(r["step"])) for r in audit}:
        runs[step] += 1
    return sum(n - 1 for n in runs.values())


def audit_samples(audits: Mapping[int, Sequence[Mapping[str, Any]]],
                  orders: Mapping[int, Sequence[str]], *, num_samples: int | None,
                  steps_per_epoch: int | None, steps_done: int) -> tuple[int, int]:
    """(samples lost, samples repeated) over the epochs the finished lineage completed: every
    sample of such an epoch should have been consumed exactly once across all ranks."""
    if not num_samples or not steps_per_epoch:
        return 0, 0
    epochs_done = steps_done // steps_per_epoch
    per_epoch: dict[int, Counter] = defaultdict(Counter)
    for rank, audit in audits.items():
        for step, ids in lineage(audit, orders.get(rank, [])).items():
            epoch = step // steps_per_epoch
            if epoch < epochs_done:
                per_epoch[epoch].update(ids)
    lost = repeated = 0
    for epoch in range(epochs_done):
        seen = per_epoch[epoch]
        lost += sum(1 for i in range(num_samples) if i not in seen)
        repeated += sum(n - 1 for n in seen.values() if n > 1)
    return lost, repeated


def match_detections(faults: Sequence[FaultSpec], detections: Sequence[Mapping[str, Any]]
                     ) -> list[dict[str, Any]]:
    """Each detection with the fault it follows (the latest fault on its rank started at or
    before it) and its delay; a fault's expected cause says whether it was named right."""
    out = []
    for d in detections:
        rank, step = d.get("rank"), d.get("step")
        onset = [f for f in faults if rank in f.ranks and step is not None and f.start <= step
                 and (f.stop is None or step < f.stop + DETECTION_DELAY_TARGET_STEPS)]
        fault = max(onset, key=lambda f: f.start) if onset else None
        out.append({**d, "fault": fault.kind if fault else None,
                    "onset_step": fault.start if fault else None,
                    "delay_steps": step - fault.start if fault else None,
                    "right_cause": bool(fault and fault.cause and d.get("cause") == fault.cause)})
    return out


def fault_outcomes(faults: Sequence[FaultSpec], detections: Sequence[Mapping[str, Any]]
                   ) -> list[dict[str, Any]]:
    """Per fault with a cause: the first detection naming that cause on its rank, and whether
    it came within :data:`DETECTION_DELAY_TARGET_STEPS`."""
    out = []
    for f in faults:
        if f.cause is None:
            continue
        hits = sorted((d for d in detections if d.get("rank") in f.ranks
                       and d.get("cause") == f.cause and d.get("step") is not None
                       and d["step"] >= f.start), key=lambda d: d["step"])
        first = hits[0] if hits else None
        delay = first["step"] - f.start if first else None
        out.append({"fault": str(f), "cause": f.cause, "named_at_step": first and first["step"],
                    "delay_steps": delay,
                    "in_time": delay is not None and delay <= DETECTION_DELAY_TARGET_STEPS})
    return out


def analyze_arm(arm_dir: str, faults: Sequence[FaultSpec], *, num_samples: int | None,
                launch_error: str | None, wall_s: float) -> dict[str, Any]:
    """The ARM object of the experiment's report (see the module docstring)."""
    traces = read_ranks(os.path.join(arm_dir, "trace"))
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
    world = int(first.get("world_size") or len(traces) or 1)
    micro, accum = int(first.get("micro_batch") or 0), int(first.get("grad_accum") or 1)
    total_steps = int(first.get("total_steps") or 0)
    steps_per_epoch = None
    if num_samples and micro:
        per_rank = math.ceil(num_samples / world)           # the sampler pads the shards
        steps_per_epoch = math.ceil(math.ceil(per_rank / micro) / accum)
    audit0 = audits.get(0, [])
    steps_done = max((int(r["step"]) + 1 for r in audit0), default=0)
    if ends:
        steps_done = int(ends[-1]["step"])
    lost, repeated = audit_samples(audits, orders, num_samples=num_samples,
                                   steps_per_epoch=steps_per_epoch, steps_done=steps_done)

    steps = [r for records in traces.values() for r in records if r.get("t") == "step"]
    totals = [r["total_s"] for r in steps]
    in_fault = [r for r in steps if any(f.active(r["step"]) for f in faults)]
    fracs = [r["memory_frac"] for r in steps if r.get("memory_frac") is not None]
    waits = sum(r.get("data_wait_s", 0.0) for r in steps)
    errors = [r for records in traces.values() for r in records if r.get("t") == "error"]
    decisions = [r for records in traces.values() for r in records if r.get("t") == "decision"]
    hangs = [r for records in traces.values() for r in records if r.get("t") == "hang"]

    detections = [{"kind": f"slow_step ({d.get('cause')})", "rank": d.get("world_rank"),
                   "cause": d.get("cause"), "step": int(d.get("applied_at", 1)) - 1,
                   "reason": d.get("reason")}
                  for d in decisions if d.get("action") == "slow_step"]
    detections += [{"kind": "straggler", "rank": r, "cause": d.get("cause"),
                    "step": d.get("applied_at"), "reason": d.get("reason")}
                   for d in _merged(decisions) if d.get("action") == "flag_straggler"
                   for r in (d.get("params", {}).get("ranks") or d.get("ranks") or [])]
    detections += _hang_detections(hangs, starts)
    completed = bool(ends) and launch_error is None
    train_wall = (ends[-1]["wall"] - starts[0]["wall"]) if ends and starts else None
    # rank 0's steps alone: start-up, checkpoints and restarts left out (the steps' own pace)
    step_time = sum(r["total_s"] for r in rank0 if r.get("t") == "step")
    rank0_steps = sum(1 for r in rank0 if r.get("t") == "step")
    return {
        "completed": completed,
        "error": None if completed else (_error_line(errors) or launch_error),
        "attempt_errors": [_error_line([e]) for e in _first_error_per_attempt(errors)],
        "attempts": len(starts),
        "steps": steps_done, "total_steps": total_steps,
        "lost_steps": lost_steps(audit0),
        "samples_lost": lost, "samples_repeated": repeated,
        "wall_s": round(wall_s, 2),
        "train_wall_s": round(train_wall, 2) if train_wall else None,
        "samples_per_s": round(steps_done * micro * accum * world / train_wall, 1)
        if train_wall else None,
        "step_samples_per_s": round(rank0_steps * micro * accum * world / step_time, 1)
        if step_time else None,
        "step_p50_s": _round(quantile(totals, 0.5)), "step_p99_s": _round(quantile(totals, 0.99)),
        "data_wait_frac": round(waits / sum(totals), 4) if totals and sum(totals) else None,
        "fault_data_wait_frac": _wait_frac(in_fault),
        "peak_memory_frac": round(max(fracs), 4) if fracs else None,
        "global_batch": micro * accum * world,
        "batch_changes": [{"step": d.get("applied_at"), **d.get("params", {})}
                          for d in _merged(decisions)
                          if d.get("action") == "shrink_micro_batch" and d.get("applied")],
        "detections": match_detections(faults, detections),
        "fault_detection": fault_outcomes(faults, detections),
        "decisions": [_decision(d) for d in _merged(decisions)
                      if d.get("action") not in DETECTION_ACTIONS],
    }


def _wait_frac(steps: Sequence[Mapping[str, Any]]) -> float | None:
    """Data wait over step time, summed over ``steps`` (None for none)."""
    total = sum(r["total_s"] for r in steps)
    return round(sum(r.get("data_wait_s", 0.0) for r in steps) / total, 4) if total else None


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 5)


def _error_line(errors: Sequence[Mapping[str, Any]]) -> str | None:
    """``OutOfMemoryError on rank 1 at step 31`` for the error that caused the last attempt
    that failed to fail (:func:`_first_error_per_attempt`)."""
    if not errors:
        return None
    first = _first_error_per_attempt(errors)[-1]
    return f"{first.get('error')} on rank {_rank_of(first)} at step {first.get('step')}"


#: errors a rank raises because another rank failed first
_CONSEQUENCES = ("DistBackendError", "RuntimeError", "KeyboardInterrupt", "SystemExit")


def _rank_of(record: Mapping[str, Any]) -> Any:
    return record.get("_rank", record.get("world_rank", "?"))


def _first_error_per_attempt(errors: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Per attempt, in order, the error that caused it to fail: the earliest of its ranks'
    errors that is not a consequence of another rank's (a broken collective)."""
    groups: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for e in errors:
        groups[e.get("_try", -1)].append(e)
    return [min(groups[t], key=lambda e: (e.get("error") in _CONSEQUENCES, e["wall"]))
            for t in sorted(groups)]


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


#: a step's phases in order: the hung rank is the one that stopped earliest in its step
def _hang_detections(hangs: Sequence[Mapping[str, Any]], starts: Sequence[Mapping[str, Any]]
                     ) -> list[dict[str, Any]]:
    """Per attempt, the hung rank by the coordinator's rule (:func:`raytrain_guard.core.hang.
    name_hung_rank`) over the watchdog records the ranks wrote down; an attempt whose ranks
    the rule cannot tell apart (a tie) names none."""
    from raytrain_guard.core.hang import HangRecord, name_hung_rank

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
        out.append({"kind": "hang", "rank": verdict.world_rank, "cause": "hang",
                    "step": verdict.step, "phase": verdict.phase,
                    "seconds_to_detect": hung.get("step_for_s"),
                    "seconds_to_restart": None if restart is None else round(restart - began, 2),
                    "reason": verdict.reason})
    return out
