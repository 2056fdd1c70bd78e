"""Coordinator at scale: 1,024 simulated ranks, one report per rank per second.

Each simulated second every rank sends one report (a batch of ``report_every_steps`` step rows,
as the client sends them) and every node monitor one sample; then the coordinator runs one
policy round (``decide``; rounds run only when the benchmark calls it). Goal: a round under
100 ms p99, ingesting a second of reports under 100 ms, and memory that stops growing.

Two passes over the same simulation: pass 1 times ingestion and rounds (wall and process CPU
time); pass 2 runs under tracemalloc and records the traced memory after every round, and RSS.

    python benchmarks/coordinator_scale.py [--ranks 1024] [--ranks-per-node 8] [--seconds 60]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import random
import resource
import sys
import time
import tracemalloc

from raytrain_guard.cluster.coordinator.coordinator import Coordinator
from raytrain_guard.config import GuardConfig
from raytrain_guard.core.node_samples import GpuSample, HostSample, NodeSample
from raytrain_guard.core.steps import StepStats

GiB = 2**30
FIELDS = [f.name for f in dataclasses.fields(StepStats)]   # a report row's order


def make_reports(second: int, ranks: int, per_node: int, n_steps: int, rng: random.Random):
    """This second's reports: rank 17 is slow in compute; memory creeps up on node 3."""
    reports = []
    first = second * n_steps + 1
    for r in range(ranks):
        node = r // per_node
        compute = 0.5 * (1.4 if r == 17 else 1.0)
        mem = 0.6 + (0.25 if node == 3 else 0.0) + 0.01 * rng.random()
        rows = [tuple(getattr(s, f) for f in FIELDS) for s in (
            StepStats(step=s, total_s=1.0 + 0.02 * rng.random(), data_wait_s=0.05,
                      forward_s=compute * 0.4, backward_s=compute * 0.6,
                      comm_wait_s=max(0.0, 0.9 - compute), memory_frac=mem, world_rank=r)
            for s in range(first, first + n_steps))]
        reports.append((r, f"node-{node:04d}", 0, rows,
                        {"micro_batch": 8, "grad_accum": 4, "prefetch_factor": 4}))
    return reports


def make_samples(second: int, nodes: int, per_node: int):
    out = []
    for n in range(nodes):
        gpus = tuple(GpuSample(g, 60 * GiB, 80 * GiB, 0.95, 70.0, 600.0) for g in range(per_node))
        out.append(NodeSample(f"node-{n:04d}", second + 1, "epoch", float(second),
                              HostSample(1024 * GiB, 512 * GiB), gpus).to_dict())
    return out


class DiscardMetrics:
    """Takes the coordinator's metric calls (so the round computes what it exports)."""

    def record_round(self, *args, **kwargs):
        pass

    def record_decision(self, decision):
        pass

    def record_ignored(self, reason):
        pass


def run(ranks: int, per_node: int, seconds: int, *, trace: bool):
    cfg = GuardConfig(decision_interval_s=1e9)    # a round when decide() is called, once a second
    coord = Coordinator("bench", cfg, clock=lambda: 0.0, metrics=DiscardMetrics())
    rng = random.Random(0)
    nodes = -(-ranks // per_node)
    out = {"round_s": [], "round_cpu_s": [], "ingest_s": [], "ingest_cpu_s": [], "traced": [],
           "rss": [], "decisions": 0}
    if trace:
        tracemalloc.start()
    for second in range(seconds):
        reports = make_reports(second, ranks, per_node, cfg.report_every_steps, rng)
        samples = make_samples(second, nodes, per_node)
        t0, c0 = time.perf_counter(), time.process_time()
        for rep in reports:
            coord.report_steps(*rep)
        for s in samples:
            coord.report_node(s)
        t1, c1 = time.perf_counter(), time.process_time()
        out["decisions"] += len(coord.decide())
        t2, c2 = time.perf_counter(), time.process_time()
        out["ingest_s"].append(t1 - t0)
        out["ingest_cpu_s"].append(c1 - c0)
        out["round_s"].append(t2 - t1)
        out["round_cpu_s"].append(c2 - c1)
        del reports, samples
        if trace:
            gc.collect()
            out["traced"].append(tracemalloc.get_traced_memory()[0])
        out["rss"].append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if trace:
        tracemalloc.stop()
    status = coord.status()
    out.update(stragglers=status["straggler_ranks"], ignored=status["ignored"],
               actions=sorted({d["action"] for d in coord.decisions_since(0)}))
    return out


def q(values, p):
    ordered = sorted(values)
    return ordered[max(0, round(p * len(ordered)) - 1)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--no-trace", action="store_true", help="skip the tracemalloc pass")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)       # the policy's notes, once per round

    timed = run(args.ranks, args.ranks_per_node, args.seconds, trace=False)
    warm = slice(5, None)                  # the first windows are still filling

    def ms(key: str, p: float) -> float:
        return 1e3 * q(timed[key][warm], p)

    print(f"coordinator_scale: {args.ranks} ranks, {args.ranks_per_node} per node, "
          f"{args.seconds} simulated seconds, one report (batch of 10 step rows) per rank "
          f"per second; python {sys.version.split()[0]}")
    print(f"  decision round (decide): p50 {ms('round_s', 0.5):.1f} ms, p99 "
          f"{ms('round_s', 0.99):.1f} ms, max {1e3 * max(timed['round_s'][warm]):.1f} ms "
          f"(goal < 100 ms p99); process CPU p50 {ms('round_cpu_s', 0.5):.1f} ms")
    print(f"  ingesting one second of reports ({args.ranks} reports + node samples): p50 "
          f"{ms('ingest_s', 0.5):.1f} ms, p99 {ms('ingest_s', 0.99):.1f} ms (goal < 100 ms); "
          f"process CPU p50 {ms('ingest_cpu_s', 0.5):.1f} ms")
    print(f"  decisions: {timed['decisions']} ({timed['actions']}); straggler ranks "
          f"{timed['stragglers']}; ignored {timed['ignored']}")
    ok = q(timed["round_s"][warm], 0.99) < 0.100 and q(timed["ingest_s"][warm], 0.5) < 0.100
    if not args.no_trace:
        traced = run(args.ranks, args.ranks_per_node, args.seconds, trace=True)
        t = traced["traced"]
        mib = 2**20
        marks = [9, len(t) // 2, len(t) - 1]
        print("  traced memory after round " + ", ".join(f"{i + 1}: {t[i] / mib:.1f} MiB"
                                                        for i in marks))
        growth = (t[-1] - t[len(t) // 2]) / max(1, t[len(t) // 2])
        print(f"  growth over the second half: {growth:+.1%} (bounded windows: ~0 expected); "
              f"peak RSS {traced['rss'][-1] / mib:.0f} MiB")
        ok = ok and abs(growth) < 0.05
    print("  RESULT:", "goal met" if ok else "goal NOT met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
