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
from raytrain_guard.core.gate import StepGate
from raytrain_guard.core.steps import StepStats


def read_steps(trace_dir: str) -> dict[int, list[dict]]:
    """Per rank, the ``step`` records of a trace directory, in order."""
    out: dict[int, list[dict]] = {}
    for path in sorted(glob.glob(os.path.join(trace_dir, "rank*.jsonl"))):
        rank = int(os.path.basename(path)[len("rank"):-len(".jsonl")])
        with open(path) as fh:
            out[rank] = [r for r in map(json.loads, fh) if r.get("t") == "step"]
    return out


def replay(rows: list[dict], rank: int, config: GuardConfig) -> list[tuple[int, str]]:
    """(step, cause) of each slow-step event the gate decides on ``rows``."""
    gate = StepGate(config)
    events = []
    for r in rows:
        stats = StepStats(r["step"], r["total_s"], r["data_wait_s"], r["compute_s"], 0.0,
                          r["comm_wait_s"], 0.0, None, rank)
        events += [(r["step"], d.cause.value) for d in gate.observe(stats)
                   if d.action.value == "slow_step"]
    return events


def _setting(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    return key, json.loads(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace_dirs", nargs="+")
    parser.add_argument("--set", dest="settings", action="append", type=_setting, default=[],
                        metavar="FIELD=VALUE", help="a GuardConfig field (JSON value)")
    args = parser.parse_args()
    config = GuardConfig.from_dict(dict(args.settings), source="--set")
    for trace_dir in args.trace_dirs:
        for rank, rows in read_steps(trace_dir).items():
            events = replay(rows, rank, config)
            print(f"{trace_dir} rank {rank}: {len(rows)} steps, {len(events)} events "
                  f"{events}")


if __name__ == "__main__":
    main()
