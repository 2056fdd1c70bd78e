"""Replay the step traces an experiment wrote through the step gate, under other settings.

Every arm of ``raytrain-guard experiment`` leaves per-rank traces (``<out>/<arm>/trace/
rank*.jsonl``, one ``step`` record per step). Fed to a fresh :class:`StepGate`, they give the
slow-step events the gate decided in that run (the same ones: the gate is a pure function of
the steps), and with ``--set`` the events it would have decided under other thresholds, with
no run repeated: the way to weigh a threshold against clean and faulty runs together::

    python benchmarks/gate_replay.py /tmp/bench/none/observe/trace /tmp/bench/slow_compute/*/trace \
        --set slow_step_mad_k=3.0 --set num_slow_steps=2
"""

from __future__ import annotations

import argparse
import glob
import json
import os

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action
from raytrain_guard.core.gate import StepGate
from raytrain_guard.core.policy import ClusterView, PolicyState, RankView, decide
from raytrain_guard.core.steps import StepStats


def read_steps(trace_dir: str) -> dict[int, list[dict]]:
    """Per rank, the ``step`` records of a trace directory, in order."""
    out: dict[int, list[dict]] = {}
    for path in sorted(glob.glob(os.path.join(trace_dir, "rank*.jsonl"))):
        rank = int(os.path.basename(path)[len("rank"):-len(".jsonl")])
        with open(path) as fh:
            out[rank] = [r for r in map(json.loads, fh) if r.get("t") in ("step", "start")]
    return out


def peer_work_from(traces: dict[int, list[dict]], rank: int) -> dict[int, float]:
    """Per step, the most work (step time less communication wait) another rank did: what
    the node's board holds at best (every step, no race), for traces written before steps
    carried ``peer_work_s``."""
    most: dict[int, float] = {}
    for other, rows in traces.items():
        if other != rank:
            for r in rows:
                if r["t"] == "step":
                    work_s = r["data_wait_s"] + r["compute_s"]
                    most[r["step"]] = max(most.get(r["step"], work_s), work_s)
    return most


def replay(rows: list[dict], rank: int, config: GuardConfig,
           checkpoint_every: int = 0,
           peer_work: dict[int, float] | None = None) -> list[tuple[int, str]]:
    """(step, cause) of each slow-step event the gate decides on ``rows`` (``step`` and
    ``start`` records), with the pauses the train loop notes: after every ``checkpoint_every``
    steps and at a resume. ``peer_work``: per step, the ``peer_work_s`` of steps that carry
    none."""
    gate = StepGate(config)
    events = []
    for r in rows:
        if r["t"] == "start":
            if r.get("resumed_from"):
                gate = StepGate(config)      # fresh processes; the restored gate is not kept
                gate.note_pause(int(r["resumed_from"]))
            continue
        if checkpoint_every and r["step"] and r["step"] % checkpoint_every == 0:
            gate.note_pause(r["step"])       # trace steps count from 0: K steps done before it
        events += [(r["step"], d.cause.value) for d in gate.observe(_stats(r, rank, peer_work))
                   if d.action is Action.SLOW_STEP]
    return events


def _stats(r: dict, rank: int, peer_work: dict[int, float] | None) -> StepStats:
    work_s = r.get("peer_work_s")
    if work_s is None and peer_work is not None:
        work_s = peer_work.get(r["step"])
    return StepStats(r["step"], r["total_s"], r["data_wait_s"], r["compute_s"], 0.0,
                     r["comm_wait_s"], 0.0, None, rank, None, work_s)


def replay_coordinator(traces: dict[int, list[dict]], config: GuardConfig,
                       peer_work: bool = False) -> list[tuple[int, str]]:
    """(step, reason) of each straggler the coordinator's policy flags on the ranks' traces,
    all ranks on one node: a policy round after every report batch (``report_every_steps``)
    on each rank's last ``step_window`` steps, as the coordinator has them. The traces'
    latest attempt only (a resumed run restarts the coordinator's windows)."""
    steps: dict[int, dict[int, StepStats]] = {}
    for rank, rows in traces.items():
        works = peer_work_from(traces, rank) if peer_work else None
        by_step: dict[int, StepStats] = {}
        for r in rows:
            if r["t"] == "start" and r.get("resumed_from"):
                by_step.clear()
            elif r["t"] == "step":
                by_step[r["step"]] = _stats(r, rank, works)
        steps[rank] = by_step
    common = sorted(set.intersection(*(set(s) for s in steps.values())))
    state, flags = PolicyState(), []
    batch = config.report_every_steps
    for i in range(batch - 1, len(common), batch):
        upto = common[max(0, i + 1 - config.step_window):i + 1]
        view = ClusterView({r: RankView(r, "node", tuple(steps[r][st] for st in upto))
                            for r in steps})
        outcome = decide(view, state, config, common[i] + 1)
        state = outcome.state
        flags += [(common[i], d.reason) for d in outcome.decisions
                  if d.action is Action.FLAG_STRAGGLER]
    return flags


def _setting(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    return key, json.loads(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace_dirs", nargs="+")
    parser.add_argument("--set", dest="settings", action="append", type=_setting, default=[],
                        metavar="FIELD=VALUE", help="a GuardConfig field (JSON value)")
    parser.add_argument("--checkpoint-every", type=int, default=25, metavar="K",
                        help="steps between the run's checkpoints, after each of which the gate "
                        "lets steps settle (the experiment's: 25; 0: none)")
    parser.add_argument("--peer-work-from-traces", action="store_true",
                        help="steps without peer_work_s take the other ranks' work from their "
                        "traces (what the node's board holds at best: every step, no race)")
    parser.add_argument("--coordinator", action="store_true",
                        help="also replay the coordinator's straggler flags (a policy round "
                        "after every report batch)")
    parser.add_argument("--totals", action="store_true",
                        help="only the line with the events of all traces")
    args = parser.parse_args()
    config = GuardConfig.from_dict(dict(args.settings), source="--set")
    num_steps = num_events = num_flags = 0
    for trace_dir in args.trace_dirs:
        traces = read_steps(trace_dir)
        if args.coordinator:
            flags = replay_coordinator(traces, config, args.peer_work_from_traces)
            num_flags += len(flags)
            if flags and not args.totals:
                for step, reason in flags:
                    print(f"{trace_dir} coordinator at step {step}: {reason}")
        for rank, rows in traces.items():
            events = replay(rows, rank, config, args.checkpoint_every,
                            peer_work_from(traces, rank) if args.peer_work_from_traces
                            else None)
            steps = sum(r["t"] == "step" for r in rows)
            num_steps += steps
            num_events += len(events)
            if not args.totals:
                print(f"{trace_dir} rank {rank}: {steps} steps, {len(events)} events {events}")
    flagged = f", {num_flags} coordinator flags" if args.coordinator else ""
    print(f"{len(args.trace_dirs)} traces: {num_events} events in {num_steps} rank-steps"
          f"{flagged}")


if __name__ == "__main__":
    main()
