"""``raytrain-guard demo``: a short default experiment on an embedded local Ray cluster.

Two gloo workers train the built-in sequence model twice under :data:`DEMO_FAULTS`: rank 1
slowed down sixfold for a stretch (a busy box's noise covered threefold:
docs/experiment.md, "raytrain-guard demo"), then a stretch of sequences eight times longer that
overflows rank 1's simulated card. Observing, that run fails with ``OutOfMemoryError``; acting,
the guard runs the long batches in pieces within the same optimizer step and finishes.
:func:`shortfalls` says what of that did not happen (``raytrain-guard demo`` then exits 1).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from raytrain_guard.experiment.faults import parse_fault

DEMO_FAULTS = ("slow_compute:rank=1,start=15,stop=25,factor=6",
               "activation_spike:rank=1,start=40,factor=8,steps=3")
DEMO_STEPS = 60
DEMO_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"


def run_demo(*, out_dir: str | None = None, out: TextIO | None = None) -> dict[str, Any]:
    """Run the demo experiment, printing its progress, table and report path to ``out``
    (default ``sys.stdout``); return its result, with ``shortfalls``. ``out_dir``: default a
    new folder in the working directory."""
    from raytrain_guard.experiment.report import format_text
    from raytrain_guard.experiment.runner import ExperimentSetup, run_experiment

    out = out or sys.stdout
    started = time.monotonic()
    setup = ExperimentSetup(faults=tuple(parse_fault(f) for f in DEMO_FAULTS),
                            max_steps=DEMO_STEPS)
    out.write(f"raytrain-guard demo: 2 gloo workers, {DEMO_STEPS} steps of the built-in "
              f"sequence model, twice (guard observing, guard acting) under the faults "
              f"{', '.join(DEMO_FAULTS)}\n")
    out.flush()

    def progress(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    # absolute in the driver: a worker resolves a relative path in its own working directory
    out_dir = os.path.abspath(out_dir or time.strftime("raytrain-guard-demo-%Y%m%d-%H%M%S"))
    # Ray Train's controller polls its workers every 2 s and each checkpoint's report and
    # attempt's end waits for a poll; the embedded cluster inherits a 0.25 s poll (a fifth of
    # the demo's time); an existing cluster keeps its own
    os.environ.setdefault(DEMO_POLL_ENV, "0.25")
    result = run_experiment(setup, out_dir, progress=progress)
    out.write(format_text(result) + "\n")
    out.write(f"report: {result['report']}\n(demo took {time.monotonic() - started:.0f} s)\n")
    result["shortfalls"] = shortfalls(result, setup)
    if result["shortfalls"]:
        out.write("the demo did not show what it exists to show: "
                  + "; ".join(result["shortfalls"]) + "\n")
    return result


def shortfalls(result: Mapping[str, Any], setup: Any) -> list[str]:
    """What of the demo's outcome did not happen, one phrase each (empty: all of it did): act
    finishes every step, audited with nothing lost, repeated or misplaced and one global batch
    throughout; observe does not finish; the slowed rank's cause is named in both arms."""
    arms = result["arms"]
    act, observe = arms.get("act", {}), arms.get("observe", {})
    out = []
    if not act.get("completed") or act.get("steps") != act.get("total_steps"):
        out.append(f"act did not finish every step ({act.get('steps')}/"
                   f"{act.get('total_steps')} steps" + (f"; {act['error']}" if act.get("error")
                                                        else "") + ")")
    if act.get("samples_audited") is None:
        out.append(f"act's samples were not audited ({act.get('audit')})")
    else:
        bad = {k: act.get(k) for k in ("samples_lost", "samples_repeated", "samples_misplaced")
               if act.get(k)}
        if bad:
            out.append("act's audit found " + ", ".join(f"{k} {v}" for k, v in bad.items()))
        batch = setup.micro_batch * setup.grad_accum * setup.num_workers
        if (act.get("global_batch_min"), act.get("global_batch_max")) != (batch, batch):
            out.append(f"act's global batch was not {batch} at every step "
                       f"({act.get('global_batch_min')}-{act.get('global_batch_max')})")
    if observe.get("completed"):
        out.append("observe finished: the spike did not overflow rank 1's card")
    for fault in (f for f in setup.faults if f.cause == "compute"):
        for name, arm in arms.items():
            if not _named(arm, fault):
                out.append(f"{name} did not name the slowed rank "
                           f"{'+'.join(map(str, fault.ranks))} ({fault.cause})")
    return out


def _named(arm: Mapping[str, Any], fault: Any) -> bool:
    return any(h["fault"] == str(fault) and h["named_at_step"] is not None
               for h in arm.get("fault_detection", ()))
