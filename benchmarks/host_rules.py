"""The host-contention rules, on and off: what they change in the experiment's outcomes.

The rules that excuse a slow step the host caused (the gate's host excuse and its aftermath, the
node-peer excuse, and the coordinator's straggler rule leaving host-starved steps out) are on by
default; ``slow_step_host_wait_frac=0``, ``slow_step_host_settle_steps=0`` and
``slow_step_peer_work_frac=0`` turn them all off. This script runs the experiment (2 gloo
workers, the built-in job at its default device step, both arms) with the rules ON and OFF,
interleaved (ON, OFF, ON, OFF, ...) so that the box's drift hits both:

* ``clean``: no fault, 600 steps, 3 repeats per setting: false slow-step events and straggler
  flags per 1000 rank-steps, and any decision applied;
* ``busy``: the clean case once per setting with one core kept busy (``python -c 'while True:
  pass'``, killed after the run): the condition the rules were built for;
* ``fault``: slow_compute, comm_delay and slow_data on rank 1 from step 40, 100 steps, 2
  repeats per setting: the step the fault was named at (its delay from the fault's start) and
  the events that named no fault.

Each run's JSON (the runner's result, with the setting) goes to ``<out>/<run>.json`` and its
report and traces to ``<out>/runs/<run>/``; then a table of every (case, setting) is printed,
and ``benchmarks/gate_replay.py`` replays every case's traces with each rule on and off (the
same steps judged both ways, beside the live runs' noise). About 35 minutes on a 2-core machine::

    python benchmarks/host_rules.py [--out DIR] [--only clean busy fault] [--table]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raytrain_guard.experiment.analysis import fault_outcomes, match_detections
from raytrain_guard.experiment.faults import parse_fault
from raytrain_guard.experiment.runner import (
    ExperimentSetup,
    detection_lateness,
    run_experiment,
)

#: the guard settings compared: the default GuardConfig, and every host-contention rule off
SETTINGS = {"on": {},
            "off": {"slow_step_host_wait_frac": 0, "slow_step_host_settle_steps": 0,
                    "slow_step_peer_work_frac": 0}}
CLEAN_STEPS, CLEAN_REPEATS = 600, 3
FAULT_STEPS, FAULT_REPEATS = 100, 2
FAULTS = {"slow_compute": "slow_compute:rank=1,start=40,factor=2",
          "comm_delay": "comm_delay:rank=1,start=40,seconds=0.03",
          "slow_data": "slow_data:rank=1,start=40,seconds=0.004"}
ARMS = ("observe", "act")
HERE = Path(__file__).resolve().parent


def plan(only: set[str]) -> list[dict]:
    """The runs, in order: each (case, repeat) ON then OFF."""
    runs = []
    if "clean" in only:
        runs += [{"case": "clean", "fault": None, "steps": CLEAN_STEPS, "busy": False,
                  "repeat": i, "setting": s} for i in range(CLEAN_REPEATS) for s in SETTINGS]
    if "busy" in only:
        runs += [{"case": "busy", "fault": None, "steps": CLEAN_STEPS, "busy": True,
                  "repeat": 0, "setting": s} for s in SETTINGS]
    if "fault" in only:
        runs += [{"case": name, "fault": spec, "steps": FAULT_STEPS, "busy": False,
                  "repeat": i, "setting": s}
                 for name, spec in FAULTS.items() for i in range(FAULT_REPEATS) for s in SETTINGS]
    for r in runs:
        r["name"] = f"{r['case']}-{r['setting']}-{r['repeat']}"
    return runs


def run_one(run: dict, out: str, log) -> dict:
    """One experiment (both arms); the busy core, when asked, runs through it."""
    faults = (parse_fault(run["fault"], world_size=2),) if run["fault"] else ()
    setup = ExperimentSetup(faults=faults, arms=ARMS, max_steps=run["steps"],
                            guard=dict(SETTINGS[run["setting"]]))
    busy = None
    if run["busy"]:
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        log(f"  busy core: pid {busy.pid}")
    started = time.perf_counter()
    try:
        result = run_experiment(setup, os.path.join(out, "runs", run["name"]),
                                namespace=f"rtg-host-rules-{run['name']}")
        error = None
    except Exception as exc:  # noqa: BLE001 - a run that cannot run is recorded, not fatal
        result, error = None, f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    return {**run, "guard": SETTINGS[run["setting"]], "error": error,
            "wall_s": round(time.perf_counter() - started, 1), "result": result}


def rank_steps(trace_dir: str) -> int:
    """The step records of every rank's trace (every attempt's)."""
    total = 0
    for path in glob.glob(os.path.join(trace_dir, "rank*.jsonl")):
        with open(path) as fh:
            total += sum(1 for line in fh if '"t": "step"' in line or '"t":"step"' in line)
    return total


def trace_flags(trace_dir: str) -> list[dict]:
    """The coordinator's straggler flags an arm's ranks recorded, one per decision, with the
    ranks it names (``params.world_ranks``) and dated as the runner dates a detection (the
    step before ``applied_at``). Read here, not from the runner's detections: those take a
    flag's ranks from ``params.ranks``, which a flag does not carry, and so list the ranks that
    applied it instead (every rank in act, none in observe)."""
    flags: dict = {}
    for path in sorted(glob.glob(os.path.join(trace_dir, "rank*.jsonl"))):
        with open(path) as fh:
            for line in fh:
                if '"flag_straggler"' not in line:
                    continue
                d = json.loads(line)
                flags.setdefault(d.get("decision_id") or (d["attempt"], d["applied_at"]), d)
    return [{"kind": "straggler", "rank": r, "cause": d.get("cause"), "source": "cluster",
             "step": None if d.get("applied_at") is None else int(d["applied_at"]) - 1,
             "reason": d.get("reason")}
            for d in flags.values() for r in d.get("params", {}).get("world_ranks") or []]


def arm_figures(record: dict, arm: str) -> dict:
    """One arm's slow-step events (the runner's), straggler flags (:func:`trace_flags`),
    false events (naming no fault), the fault named (by either), and decisions applied."""
    a = record["result"]["arms"][arm]
    trace = os.path.join(os.path.dirname(record["result"]["report"]), arm, "trace")
    faults = [parse_fault(record["fault"], world_size=2)] if record["fault"] else []
    lateness = detection_lateness(ExperimentSetup(faults=faults,
                                                  guard=dict(SETTINGS[record["setting"]])))
    slow = [d for d in a["detections"] if d["kind"].startswith("slow_step")]
    flags = match_detections(faults, trace_flags(trace), lateness=lateness)
    named = [(f["cause"], f["delay_steps"], f["in_time"])
             for f in fault_outcomes(faults, slow + flags, lateness=lateness)]
    return {"rank_steps": rank_steps(trace), "slow_steps": len(slow), "flags": len(flags),
            "false_slow": sum(d.get("fault") is None for d in slow),
            "false_flags": sum(d.get("fault") is None for d in flags),
            "named": named,
            "named_by_runner": [(f["cause"], f["delay_steps"], f["in_time"])
                                for f in a["fault_detection"]],
            "applied": [d["action"] for d in a["decisions"] if d["applied"]],
            "p50_ms": (a["step_p50_s"] or 0) * 1000, "completed": a["completed"]}


def table(records: list[dict]) -> str:
    """Per (case, setting) and arm: summed over the repeats."""
    header = ("| case | rules | arm | runs | rank-steps | slow-step events | straggler flags | "
              "false per 1000 rank-steps | fault named (steps after start) | runner's "
              "fault_detection | applied decisions | step p50 ms |")
    lines = [header, "|---" * 12 + "|"]
    cases = list(dict.fromkeys(r["case"] for r in records))
    for case in cases:
        for setting in SETTINGS:
            group = [r for r in records if r["case"] == case and r["setting"] == setting]
            failed = [r["name"] for r in group if r["error"]]
            group = [r for r in group if not r["error"]]
            for arm in ARMS:
                figs = [arm_figures(r, arm) for r in group]
                if not figs:
                    lines.append(f"| {case} | {setting} | {arm} | 0 (failed: {failed}) |"
                                 + " |" * 8)
                    continue
                steps = sum(f["rank_steps"] for f in figs)
                false = sum(f["false_slow"] + f["false_flags"] for f in figs)
                named, by_runner = ("; ".join(
                    ", ".join(f"{c} +{d}" if d is not None else f"{c} MISSED"
                              for c, d, _ in f[key]) or "-" for f in figs)
                    for key in ("named", "named_by_runner"))
                applied = sum(len(f["applied"]) for f in figs)
                kinds = sorted({k for f in figs for k in f["applied"]})
                p50 = statistics.median(f["p50_ms"] for f in figs)
                lines.append(
                    f"| {case} | {setting} | {arm} | {len(figs)} | {steps} | "
                    f"{sum(f['slow_steps'] for f in figs)} ({sum(f['false_slow'] for f in figs)} "
                    f"false) | {sum(f['flags'] for f in figs)} "
                    f"({sum(f['false_flags'] for f in figs)} false) | "
                    f"{1000 * false / steps:.2f} | {named} | {by_runner} | "
                    f"{applied}{' ' + ','.join(kinds) if kinds else ''} | {p50:.1f} |")
    return "\n".join(lines)


#: the rule sets replayed over the traces: every rule on, each group off, all off
REPLAYS = {"all on": {},
           "host wait + settle off": {"slow_step_host_wait_frac": 0,
                                      "slow_step_host_settle_steps": 0},
           "peer off": {"slow_step_peer_work_frac": 0},
           "all off": SETTINGS["off"]}


def replay(records: list[dict], out: str) -> str:
    """``gate_replay.py --coordinator`` over each case's traces (the ON runs' and the OFF
    runs' apart: both carry the waits the rules read), under every rule set of
    :data:`REPLAYS`: the same steps judged with and without each rule. The gate's events
    replay as the live run decided them; the coordinator's flags are dated by its policy
    round (live, the ranks record them up to a report batch and a lockstep later)."""
    text = []
    for case in dict.fromkeys(r["case"] for r in records):
        for setting in SETTINGS:
            trace_dirs = [os.path.join(os.path.dirname(r["result"]["report"]), arm, "trace")
                          for r in records if r["case"] == case and r["setting"] == setting
                          and not r["error"] for arm in ARMS]
            for label, settings in REPLAYS.items():
                cmd = [sys.executable, str(HERE / "gate_replay.py"), *trace_dirs,
                       *(a for k, v in settings.items() for a in ("--set", f"{k}={v}")),
                       "--coordinator"]
                done = subprocess.run(cmd, capture_output=True, text=True, check=False)
                lines = done.stdout.strip().splitlines() or [done.stderr.strip()]
                events = [line.split(": ", 1)[1] for line in lines[:-1]
                          if " events [(" in line or " coordinator at step " in line]
                steps = sorted(int(line.split(" coordinator at step ")[1].split(":")[0])
                               for line in lines if " coordinator at step " in line)
                text.append(f"{case}, {setting.upper()} traces, {label}: {lines[-1]}; "
                            f"flags at rounds {steps}; events "
                            + "; ".join(e for e in events if " events [(" in e))
    with open(os.path.join(out, "replay.txt"), "w") as fh:
        fh.write("\n".join(text) + "\n")
    return "\n".join(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="host-rules-bench")
    parser.add_argument("--only", nargs="*", default=["clean", "busy", "fault"],
                        choices=["clean", "busy", "fault"])
    parser.add_argument("--table", action="store_true",
                        help="no runs: the table and the replay of the JSON already in --out")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    def log(line: str) -> None:
        stamped = f"{time.strftime('%H:%M:%S')} {line}"
        print(stamped, file=sys.stderr, flush=True)
        with open(os.path.join(out, "progress.log"), "a") as fh:
            fh.write(stamped + "\n")

    if not args.table:
        runs = plan(set(args.only))
        for i, run in enumerate(runs):
            log(f"[{i + 1}/{len(runs)}] {run['name']} ...")
            record = run_one(run, out, log)
            with open(os.path.join(out, f"{run['name']}.json"), "w") as fh:
                json.dump(record, fh, indent=1, default=str)
            summary = record["error"] or "; ".join(
                f"{arm}: {f['slow_steps']} slow, {f['flags']} flags, named {f['named']}, "
                f"applied {f['applied']}, p50 {f['p50_ms']:.1f} ms"
                for arm in ARMS for f in [arm_figures(record, arm)])
            log(f"  {run['name']} in {record['wall_s']:.0f} s: {summary}")
    records = []
    for path in sorted(glob.glob(os.path.join(out, "*.json"))):
        with open(path) as fh:
            records.append(json.load(fh))
    order = {name: i for i, name in enumerate(["clean", "busy", *FAULTS])}
    records.sort(key=lambda r: (order.get(r["case"], 99), r["setting"], r["repeat"]))
    print(table(records))
    print()
    print(replay(records, out))


if __name__ == "__main__":
    main()
