"""``raytrain-guard demo``: a short default experiment on an embedded local Ray cluster.

Two gloo workers train the built-in sequence model (:mod:`raytrain_guard.experiment.model`)
twice under the same faults (:data:`DEMO_FAULTS`): rank 1 slowed down threefold for a stretch
(the guard names compute on rank 1 in both arms), then a stretch of sequences eight times longer
that overflows rank 1's simulated card. Observing only, that run fails with
``OutOfMemoryError`` on every attempt; acting, the guard prices the long batches before their
forward, runs them in pieces within the same optimizer step and finishes with the same global
batch. The side-by-side table and the report's path are printed.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from raytrain_guard.core.faults import parse_fault

DEMO_FAULTS = ("slow_compute:rank=1,start=15,stop=25,factor=3",
               "activation_spike:rank=1,start=40,factor=8,steps=3")
DEMO_STEPS = 60


def run_demo(*, out_dir: str | None = None, out: TextIO = sys.stdout) -> dict[str, Any]:
    """Run the demo experiment; print its progress, table and report path; return its result."""
    from raytrain_guard.experiment.report import format_text
    from raytrain_guard.experiment.runner import ExperimentSetup, run_experiment

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

    result = run_experiment(setup, out_dir or time.strftime("raytrain-guard-demo-%Y%m%d-%H%M%S"),
                            progress=progress)
    out.write(format_text(result) + "\n")
    out.write(f"report: {result['report']}\n(demo took {time.monotonic() - started:.0f} s)\n")
    return result


def rehearsal_probes() -> Any:
    """Every node's GPU probe reads one 80 GiB GPU at 89 % of its memory, holding the node's
    registered train workers (a scripted node under pressure, for rehearsals and tests)."""
    from raytrain_guard.cluster.node_probes import ScriptedProbeFactory
    from raytrain_guard.core.node_samples import GpuSample
    from raytrain_guard.units import GiB
    total = 80 * GiB
    return ScriptedProbeFactory([[GpuSample(0, int(0.89 * total), total)]], worker_gpus=(0,))
