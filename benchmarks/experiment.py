"""The before/after experiment, each fault alone: guard observing vs guard acting.

Runs ``raytrain-guard experiment`` once per row of :data:`CASES` (2 gloo workers, the built-in
sequence model on a simulated 10 MiB card, DDP (FSDP2 for the ``_fsdp`` rows), micro-batch 8),
then prints one markdown table with the figures docs/benchmarks.md records and the targets each
row is held to. About 15 minutes on a 2-core machine::

    python benchmarks/experiment.py [--out DIR] [--only KIND ...] [--repeat N]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time

from raytrain_guard import cli

#: (name, faults, steps, target): one experiment per row
CASES = (
    ("activation_spike", ["activation_spike:rank=1,start=30,factor=8,steps=3"], 100,
     "observe fails every attempt; act finishes, same global batch, 0 lost steps"),
    ("memory_growth", ["memory_growth:rank=1,start=10,per_step=40KiB"], 200,
     "observe crashes and recomputes; act checkpoints before the OOM, 0 lost steps"),
    ("slow_compute", ["slow_compute:rank=1,start=40,factor=3"], 100,
     "compute named on rank 1 within 5 steps; act throughput within 2 % of observe"),
    ("comm_delay", ["comm_delay:rank=1,start=40,seconds=0.03"], 100,
     "communication named on rank 1 within 5 steps; act within 2 % of observe"),
    ("slow_data", ["slow_data:rank=1,start=40,seconds=0.004"], 100,
     "data named on rank 1 within 5 steps; act's data wait at most half of observe's"),
    ("hang", ["hang:rank=1,start=40"], 100,
     "act names rank 1 and its phase and ends the attempt within 30 s"),
    ("crash", ["crash:rank=1,start=40"], 100,
     "both arms resume at the same step; nothing lost, nothing repeated"),
    ("none", [], 600, "nothing flagged in 600 clean steps"),
    # under FSDP2: the link delay in the reduce-scatter, the spike split alike on both ranks
    ("comm_delay_fsdp", ["comm_delay:rank=1,start=40,seconds=0.03"], 100,
     "FSDP: communication named on rank 1 within 5 steps; act within 2 % of observe"),
    ("activation_spike_fsdp", ["activation_spike:rank=1,start=30,factor=8,steps=3"], 100,
     "FSDP: observe fails; act splits on both ranks and finishes, same global batch"),
)
#: extra arguments of a case, by name suffix
EXTRA = {"_fsdp": ["--strategy", "fsdp-full"]}


def run_case(name: str, faults: list[str], steps: int, out: str, *,
             act_first: bool = False) -> dict:
    argv = ["experiment", "--steps", str(steps), "--out", os.path.join(out, name), "--json",
            "--arms", "act,observe" if act_first else "observe,act"]
    argv += [a for suffix, extra in EXTRA.items() if name.endswith(suffix) for a in extra]
    for f in faults:
        argv += ["--fault", f]
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = cli.main(argv)
    if code != 0:
        raise SystemExit(f"{name}: exit {code}")
    return json.loads(buffer.getvalue())


def row(name: str, target: str, results: list[dict]) -> str:
    """One table row: the first run's figures; the pace ratio and the steps to naming the fault
    of every run (``--repeat``, odd runs act first), since one run's pace moves by several %
    on a shared box."""
    o, a = results[0]["arms"]["observe"], results[0]["arms"]["act"]

    def done(arm):
        return (f"{arm['steps']}/{arm['total_steps']}" + ("" if arm["completed"] else
                                                          f" ({arm['error']})"))

    def named(arm):
        hits = arm.get("fault_detection") or []
        if hits:
            return ", ".join(f"{h['cause']} +{h['delay_steps']}" if h["named_at_step"]
                             is not None else f"{h['cause']} not named" for h in hits)
        hangs = [d for d in arm["detections"] if d["kind"] == "hang"]
        if hangs:
            return f"hang rank {hangs[0]['rank']} in {hangs[0]['phase']} after " \
                   f"{hangs[0]['seconds_to_detect']:.0f} s"
        return f"{len(arm['detections'])} detections"

    ratios = sorted(r for r in map(_pace_ratio, results) if r is not None)
    pace = "-" if not ratios else f"{statistics.median(ratios):.3f}" + (
        f" ({ratios[0]:.3f}-{ratios[-1]:.3f}, {len(ratios)} runs)" if len(ratios) > 1 else "")
    names = "; ".join(f"{named(r['arms']['observe'])} / {named(r['arms']['act'])}"
                      for r in results)
    return (f"| {name} | {done(o)} | {done(a)} | {o['attempts']} / {a['attempts']} | "
            f"{o['lost_steps']} / {a['lost_steps']} | "
            f"{_audited(o)} / {_audited(a)} | "
            f"{_pct(o['data_wait_frac'])} / {_pct(a['data_wait_frac'])} | "
            f"{_pct(o['peak_memory_frac'])} / {_pct(a['peak_memory_frac'])} | "
            f"{pace} | {names} | "
            f"{o['wall_s']:.0f} / {a['wall_s']:.0f} s | {target} |")


def _pace_ratio(result: dict) -> float | None:
    """Act's samples per second of step time over observe's: the steps' own pace (start-up and
    checkpoints left out: they are most of a short run)."""
    o, a = result["arms"]["observe"], result["arms"]["act"]
    if o.get("step_samples_per_s") and a.get("step_samples_per_s"):
        return a["step_samples_per_s"] / o["step_samples_per_s"]
    return None


def _audited(arm: dict) -> str:
    """``lost+repeated`` of an arm's audit, or "not audited"."""
    if arm.get("samples_lost") is None:
        return "not audited"
    return f"{arm['samples_lost']}+{arm['samples_repeated']}"


def _pct(x):
    return "-" if x is None else f"{x:.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run each row N times (pace ratio: median and range)")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="rtg-bench-experiment-")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    print("| fault | observe steps | act steps | attempts o/a | steps again o/a | "
          "samples lost+repeated o/a | data wait o/a | peak memory o/a | act/observe "
          "step samples/s | named o/a (steps after start) | wall o/a | target |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, faults, steps, target in CASES:
        if args.only and name not in args.only:
            continue
        t0 = time.perf_counter()
        # odd runs act first: drift of a shared box over a run does not favour one arm
        results = [run_case(name, faults, steps, os.path.join(out, f"run{i}") if i else out,
                            act_first=i % 2 == 1)
                   for i in range(args.repeat)]
        print(row(name, target, results), flush=True)
        print(f"  ({name}: {time.perf_counter() - t0:.0f} s, report {results[0]['report']})",
              file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
