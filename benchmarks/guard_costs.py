"""Where the guard's time goes inside a ~10 ms CPU training loop: each guard call timed in place.

    python benchmarks/guard_costs.py [--steps 2000] [--step-ms 10] [--seed 0]

``gate_overhead.py`` compares whole steps, whose matmuls vary by +-0.5 % from loop to loop
and run to run: more than the guard costs. This script times only what the guard adds, in the
loop, on the caches the loop leaves (after ~10 ms of matmul every Python call runs on cold
caches and costs 5-10x its warm cost). Three loops, one step of each per round in random
order, the same work as gate_overhead.py:

* ``plain``: a torch DataLoader (num_workers 0, shuffled) and the work;
* ``guard``: the same plus a StepGuard: begin_step, mark("data"), the forward and backward
  marks, end_step (after the optimizer step, which it times from the backward mark);
* ``guard+loader``: a GuardedDataLoader attached to its StepGuard (StepGuard.attach_loader),
  the forward and backward marks, end_step: the shared train loop's calls.

Every guard call and every batch fetch is timed with perf_counter around it; the memory
probe's reads and the gate batches (GateFeed.flush) are timed inside end_step by wrapping
them. Printed per loop: the mean per step of each part (the probe and the gate batch are
inside end_step: shown per read and per batch, and per step), the fetch against plain's,
and the guard's in-loop cost per step: its calls plus its fetch minus plain's fetch, less
the timing's own cost (an empty timed region, measured in the same loop), as a fraction of
plain's step. That fraction is what the guard takes from throughput, leaving out what it does
to the work's own caches (gate_overhead.py sees all of it, under its noise).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from gate_overhead import BATCH, FEATURES, Work, calibrate, forever
from torch.utils.data import DataLoader, TensorDataset

from raytrain_guard.config import GuardConfig
from raytrain_guard.runtime.data.loader import GuardedDataLoader
from raytrain_guard.runtime.guard.node_peers import NodePeers
from raytrain_guard.runtime.guard.probes import ProcessMemoryProbe
from raytrain_guard.runtime.guard.step_guard import StepGuard
from raytrain_guard.runtime.guard.timing import StepTimer

clock = time.perf_counter


class TimedProbe:
    """A probe whose reads are timed."""

    def __init__(self, probe) -> None:
        self.probe, self.cause, self.times = probe, probe.cause, []

    def read(self):
        t0 = clock()
        reading = self.probe.read()
        self.times.append(clock() - t0)
        return reading


def timed_guard(config: GuardConfig, peers: NodePeers
                ) -> tuple[StepGuard, TimedProbe, list[float]]:
    """A StepGuard with the train loop's timer (with the node's board) whose probe reads and
    gate batches are timed."""
    probe = TimedProbe(ProcessMemoryProbe(config))
    guard = StepGuard(config, probe=probe, timer=StepTimer(peers=peers))
    batches: list[float] = []
    flush = guard.feed.flush

    def timed_flush():
        t0 = clock()
        out = flush()
        batches.append(clock() - t0)
        return out

    guard.feed.flush = timed_flush
    return guard, probe, batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="timed rounds")
    parser.add_argument("--step-ms", type=float, default=10.0, help="target step time")
    parser.add_argument("--seed", type=int, default=0, help="seed of the round orders")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    logging.getLogger("raytrain_guard").setLevel(logging.ERROR)
    # the other loops' steps between two steps of one loop are no pause of that loop (a real
    # loop's steps follow each other): without this its gate took them for checkpoints
    config = GuardConfig(pause_gap_steps=1e9)
    n = calibrate(args.step_ms)
    work = Work(n)
    dataset = TensorDataset(torch.randn(100_000, FEATURES))

    def torch_batches():
        return forever(DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=0))

    # the board of a node of 8 ranks, this one local rank 0 (the others' slots stay 0)
    peers = NodePeers(os.path.join(tempfile.mkdtemp(prefix="rtg-costs-"), "board"), 0, 8)
    guard, guard_probe, guard_batches = timed_guard(config, peers)
    attached, attached_probe, attached_batches = timed_guard(config, peers)
    loader = GuardedDataLoader(dataset, BATCH, config=config, world_rank=0, world_size=1,
                               gpus_per_node=1, num_workers=0)
    assert attached.attach_loader(loader)
    sources = {"plain": torch_batches(), "guard": torch_batches(), "guard+loader": forever(loader)}
    parts: dict[str, dict[str, list[float]]] = {name: {} for name in sources}

    def put(name: str, part: str, seconds: float) -> None:
        parts[name].setdefault(part, []).append(seconds)

    def plain(step: int, timed: bool) -> None:
        t0 = clock()
        batch = next(sources["plain"])
        t1 = clock()
        y = work.forward(batch)
        work.backward(y)
        work.optimizer()
        t2 = clock()
        t3 = clock()                      # an empty timed region after the work: the floor
        if timed:
            put("plain", "fetch", t1 - t0)
            put("plain", "empty", t3 - t2)
            put("plain", "step", t2 - t0)

    def guarded(name: str, guard: StepGuard, step: int, timed: bool) -> None:
        """One step of ``name``'s loop; with an attached loader (guard+loader) the loader
        opens the step and ends its data phase: no begin_step, no mark("data")."""
        attached = guard.loader_attached
        t0 = clock()
        if not attached:
            guard.begin_step(step)
        t1 = clock()
        batch = next(sources[name])
        t2 = clock()
        if not attached:
            guard.mark("data")
        t3 = clock()
        y = work.forward(batch)
        t4 = clock()
        guard.mark("forward")
        t5 = clock()
        work.backward(y)
        t6 = clock()
        guard.mark("backward")
        t7 = clock()
        work.optimizer()
        t9 = clock()
        guard.end_step(step)
        t10 = clock()
        if timed:
            if not attached:
                put(name, "begin_step", t1 - t0)
                put(name, "mark data", t3 - t2)
            put(name, "fetch", t2 - t1)
            put(name, "2 marks", (t5 - t4) + (t7 - t6))
            put(name, "end_step", t10 - t9)

    loops = [plain, lambda step, timed: guarded("guard", guard, step, timed),
             lambda step, timed: guarded("guard+loader", attached, step, timed)]
    rng = random.Random(args.seed)
    warm = 100
    for step in range(warm + args.steps):
        rng.shuffle(loops)
        for loop in loops:
            loop(step, step >= warm)
    timed_steps = warm + args.steps

    def mean_us(values: list[float]) -> float:
        return statistics.mean(values) * 1e6

    plain_step_us = mean_us(parts["plain"]["step"])
    floor_us = mean_us(parts["plain"]["empty"])
    plain_fetch_us = mean_us(parts["plain"]["fetch"])
    print(f"machine: 1 torch thread, matmul n={n}; {args.steps} rounds (+{warm} untimed), one "
          f"step of each loop per round in random order")
    print(f"plain: step {plain_step_us / 1000:.2f} ms mean, fetch {plain_fetch_us:.1f} us; "
          f"an empty timed region after the work {floor_us:.2f} us (subtracted once per timed part)")
    for name, probe, batches in (("guard", guard_probe, guard_batches),
                                 ("guard+loader", attached_probe, attached_batches)):
        got = parts[name]
        calls = {part: mean_us(v) for part, v in got.items() if part != "fetch"}
        fetch_delta = mean_us(got["fetch"]) - plain_fetch_us
        num_parts = 5 if name == "guard" else 3   # timed guard regions per step (marks: 2)
        total = sum(calls.values()) + fetch_delta - num_parts * floor_us
        probe_us = sum(probe.times) / timed_steps * 1e6
        batch_us = sum(batches) / timed_steps * 1e6
        print(f"{name}: " + ", ".join(f"{part} {us:.1f}" for part, us in calls.items())
              + f" us per step; fetch {fetch_delta:+.1f} us against plain's")
        print(f"  inside end_step: {len(probe.times)} probe reads of "
              f"{statistics.mean(probe.times) * 1e6:.0f} us ({probe_us:.1f} us per step), "
              f"{len(batches)} gate batches of {statistics.mean(batches) * 1e6:.0f} us "
              f"({batch_us:.1f} us per step)")
        print(f"  in-loop cost {total:.1f} us per step = {total / plain_step_us:.2%} of plain's "
              f"step: throughput ratio about {1 - total / plain_step_us:.4f}")
    peers.close()                          # local rank 0: removes the board
    os.rmdir(os.path.dirname(peers.path))


if __name__ == "__main__":
    main()
