"""Throughput of a ~10 ms training step with and without the guard, interleaved in one run.

    python benchmarks/gate_overhead.py [--blocks 200] [--block-steps 20] [--step-ms 10]
                                       [--device cpu|cuda] [--seed 0] [--runs 1]

Four loops over the same work (a matmul "forward", a matmul "backward", an in-place
"optimizer" update on one thread, sized for about --step-ms per step on an idle core):

* ``plain``: a torch DataLoader (num_workers 0, shuffled) and the work, nothing else;
* ``plain again``: a second, identical plain loop (its own DataLoader): the A/A control, whose
  ratio to ``plain`` shows the method's own bias and resolution;
* ``guard``: the plain loop plus a StepGuard per step (begin_step, the data, forward and
  backward marks, end_step after the optimizer step, which times it from the backward mark:
  timer + ProcessMemoryProbe + gate, the fast path included);
* ``guard+loader``: the StepGuard and the GuardedDataLoader (num_workers 0 as well, so the
  comparison is the guard's own bookkeeping, not a different worker count), attached as the
  shared train loop attaches them (``StepGuard.attach_loader``): the loader opens each step
  and ends its data phase, so the loop calls neither ``begin_step`` nor ``mark("data")``
  (on the host the loader writes both stamps inline; on CUDA it records the timer's events):
  two marks (forward, backward) and end_step per step.

Interleaving is per step: each round runs one step of every loop, in a fresh random order (so
no loop always follows another: what ran just before a step changes its cost by up to a
percent here, the caches being cold after 10 ms of matmul), each step timed alone. A block is
--block-steps rounds (default 20 = gate_batch_steps, so each block holds one gate batch and
about one memory read of each guard). The figure per loop is the median over blocks of
plain block time / loop block time (a throughput ratio; for the guarded loops the plain time is
the mean of both plain loops, for the control plain / plain again), with a distribution-free 95 %
confidence interval (order statistics of the binomial), and the ratio of the total times.
Noise on a shared VM comes in bursts of tens of milliseconds: steps a few milliseconds apart
share it, blocks of whole loops a second apart do not: on a calm run the intervals are +-0.3 %
where per-loop blocks (this script's first version) gave +-2 %. Bursts that outlast a block
still bias a run: the control says so (its ratio outside its own interval). Also printed: the
guard's own cost per step, timed alone (warm caches: a lower bound of its in-loop cost).

``--runs R``: R such runs, each in a fresh process (seeds seed .. seed+R-1), one after another,
and per loop the median over runs of the runs' medians, with a distribution-free CI over runs.
A run's interval describes that run only: on this 2-core VM two identical loops in one process
differ by up to 0.7 % for a whole run (the control), an offset that the interleaving does not
remove and that changes from process to process (where each loop's objects and buffers landed
in memory, by all signs: cold-cache Python pays per page and line it touches). Runs in fresh
processes sample that offset; their spread is the honest error bar.

``--device cuda``: the same loops with the work on the GPU (fp32 matmuls sized the same way
for about --step-ms on the GPU). The plain loops' torch DataLoaders pin their batches and copy
them with ``.to(device, non_blocking=True)``; the guards time with ``StepTimer(device="cuda")``
(CUDA events, read a step later) and read ``CudaMemoryProbe``; the GuardedDataLoader delivers
on the device (pinned memory, the next batch copied on a side stream). Every timed step of
every loop ends with ``torch.cuda.synchronize()``, so its host time is the step's latency.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.utils.data import DataLoader, TensorDataset

from raytrain_guard.config import GuardConfig
from raytrain_guard.runtime.data.loader import GuardedDataLoader
from raytrain_guard.runtime.guard.probes import CudaMemoryProbe, ProcessMemoryProbe
from raytrain_guard.runtime.guard.step_guard import StepGuard
from raytrain_guard.runtime.guard.timing import StepTimer

BATCH = 32
FEATURES = 64
GOAL = 0.995


def median_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """Median and a distribution-free CI: the k-th smallest and largest values, where k is the
    largest with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2."""
    xs = sorted(values)
    n = len(xs)
    alpha = (1 - confidence) / 2
    k, cdf = 0, 0.0
    for i in range(n + 1):
        p = math.comb(n, i) / 2**n
        if cdf + p > alpha:
            break
        cdf += p
        k = i + 1
    k = max(k, 1)
    return statistics.median(xs), xs[k - 1], xs[n - k]


def calibrate(step_ms: float, device: str = "cpu") -> int:
    """Matrix size n for which two n x n matmuls and an add take about step_ms (the fastest
    of five tries, so a busy machine does not shrink the step; on CUDA each try ends with a
    synchronize)."""
    n, max_n = 128, 4096 if device == "cpu" else 32768
    while True:
        a = torch.randn(n, n, device=device)
        tries = []
        for _ in range(5):
            t0 = time.perf_counter()
            (a @ a).add_(a @ a)
            if device == "cuda":
                torch.cuda.synchronize()
            tries.append(time.perf_counter() - t0)
        per_step_ms = min(tries) * 1000
        if per_step_ms >= step_ms or n > max_n:
            return max(64, int(n * (step_ms / per_step_ms) ** (1 / 3)))
        n = int(n * 1.25)


def no_sync() -> None:
    """The CPU loops' end of step: nothing to wait for."""


class Work:
    def __init__(self, n: int, device: str = "cpu") -> None:
        self.w = torch.randn(n, n, device=device)
        self.g = torch.empty(n, n, device=device)
        # the harness's end of every timed step: on CUDA the host waits for the step's kernels
        self.sync = torch.cuda.synchronize if device == "cuda" else no_sync

    def forward(self, batch) -> torch.Tensor:
        return self.w @ self.w + batch[0].sum()

    def backward(self, y: torch.Tensor) -> None:
        torch.mm(y, self.w, out=self.g)

    def optimizer(self) -> None:
        self.w.add_(self.g, alpha=-1e-12)


def forever(loader):
    while True:
        yield from loader


def forever_on(loader, device: str):
    """A plain loop's batches on ``device``: copied from pinned memory, as users write it."""
    for batch in forever(loader):
        yield [t.to(device, non_blocking=True) for t in batch]


def guard_cost_us(guard: StepGuard, steps: int = 20000) -> float:
    """The guard alone (no work): begin, three marks, end per step, in microseconds."""
    t0 = time.perf_counter()
    for step in range(steps):
        guard.begin_step(step)
        guard.mark("data")
        guard.mark("forward")
        guard.mark("backward")
        guard.end_step(step)
    return (time.perf_counter() - t0) / steps * 1e6


def plain_step(work: Work, batches) -> float:
    t0 = time.perf_counter()
    batch = next(batches)
    y = work.forward(batch)
    work.backward(y)
    work.optimizer()
    work.sync()
    return time.perf_counter() - t0


def guarded_step(work: Work, batches, guard: StepGuard, step: int,
                 attached: bool = False) -> float:
    """A step with the guard's calls. ``attached``: the GuardedDataLoader is attached
    (StepGuard.attach_loader), so it opens the step and ends its data phase, as the shared
    train loop runs it: no begin_step, no mark("data"). No optimizer mark in either: the
    time from the backward mark to end_step is the optimizer phase (StepTimer)."""
    t0 = time.perf_counter()
    if not attached:
        guard.begin_step(step)
    batch = next(batches)
    if not attached:
        guard.mark("data")
    y = work.forward(batch)
    guard.mark("forward")
    work.backward(y)
    guard.mark("backward")
    work.optimizer()
    guard.end_step(step)
    work.sync()
    return time.perf_counter() - t0


def verdict(lo: float, med: float) -> str:
    return "met" if lo >= GOAL else "met by the median" if med >= GOAL else "NOT met"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=200, help="blocks of rounds")
    parser.add_argument("--block-steps", type=int, default=20, help="rounds per block")
    parser.add_argument("--step-ms", type=float, default=10.0, help="target step time")
    parser.add_argument("--seed", type=int, default=0, help="seed of the round orders")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the work runs (cuda: see the module doc)")
    parser.add_argument("--runs", type=int, default=1,
                        help="independent runs, each in a fresh process (seeds seed, seed+1, "
                             "...), and their aggregate: see the module doc")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON line of this run's figures (what --runs reads)")
    args = parser.parse_args()
    if args.runs > 1:
        sys.exit(aggregate_runs(args))
    measure(args)


def child_command(args: argparse.Namespace, seed: int) -> list[str]:
    return [sys.executable, __file__, "--blocks", str(args.blocks), "--block-steps",
            str(args.block_steps), "--step-ms", str(args.step_ms), "--device", args.device,
            "--seed", str(seed), "--json"]


def aggregate_runs(args: argparse.Namespace) -> int:
    """Run --runs fresh processes one after another; print each run's medians and, per loop,
    the median over runs with its distribution-free CI over runs."""
    results = []
    for i in range(args.runs):
        out = subprocess.run(child_command(args, args.seed + i), capture_output=True,
                             text=True, check=False)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode != 0 or not lines:
            print(f"run {i} (seed {args.seed + i}) failed:\n{out.stdout}{out.stderr}")
            return 1
        run = json.loads(lines[-1])
        results.append(run)
        print(f"run {i} seed {run['seed']}: plain step {run['plain_ms']:.2f} ms; " + ", ".join(
            f"{name} {r['median']:.4f}" for name, r in run["loops"].items()), flush=True)
    first = results[0]
    print(f"machine: {first['machine']}; {args.runs} runs (fresh processes) x {args.blocks} "
          f"blocks x {args.block_steps} rounds")
    for name in first["loops"]:
        medians = [r["loops"][name]["median"] for r in results]
        totals = [r["loops"][name]["total"] for r in results]
        med, lo, hi = median_ci(medians)
        goal = ("control: expect 1" if name == "plain again"
                else f"goal >= {GOAL}: {verdict(lo, med)}")
        print(f"{name:>13}: median over runs {med:.4f} (95% CI over runs {lo:.4f}-{hi:.4f}, "
              f"range {min(medians):.4f}-{max(medians):.4f}), mean total-time ratio "
              f"{statistics.mean(totals):.4f}; {goal}")
    decisions = sum(r["decisions"] for r in results)
    print(f"decisions during the timed loops, all runs: {decisions}; guard alone "
          f"{statistics.median(r['guard_alone_us'] for r in results):.1f} us per step "
          f"(median over runs)")
    return 0


def measure(args: argparse.Namespace) -> None:
    """One run: interleave the four loops, print (or --json) the figures."""
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available here; nothing measured")
        sys.exit(2)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    # the other loops' steps between two steps of one loop are no pause of that loop (a real
    # loop's steps follow each other): without this its gate took them for checkpoints
    config = GuardConfig(pause_gap_steps=1e9)
    n = calibrate(args.step_ms, args.device)
    work = Work(n, args.device)
    dataset = TensorDataset(torch.randn(100_000, FEATURES))

    def torch_batches():
        if cuda:
            return forever_on(DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=0,
                                         pin_memory=True), args.device)
        return forever(DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=0))

    def new_guard(**kwargs) -> StepGuard:
        if cuda:
            return StepGuard(config, probe=CudaMemoryProbe(config=config),
                             timer=StepTimer(device="cuda"), **kwargs)
        return StepGuard(config, probe=ProcessMemoryProbe(config), **kwargs)

    # Decisions are counted, not logged: on a shared box a noisy burst can raise slow steps.
    logging.getLogger("raytrain_guard").setLevel(logging.ERROR)
    decisions: list = []
    guards = [new_guard(on_decision=decisions.append) for _ in range(2)]
    loader = GuardedDataLoader(dataset, BATCH, config=config, world_rank=0, world_size=1,
                               gpus_per_node=1, num_workers=0,
                               device=args.device if cuda else None)
    batches = [torch_batches(), torch_batches(), torch_batches(), forever(loader)]
    attached = guards[1].attach_loader(loader)     # the loader opens steps, times data
    loops = {
        "plain": lambda s: plain_step(work, batches[0]),
        "plain again": lambda s: plain_step(work, batches[1]),
        "guard": lambda s: guarded_step(work, batches[2], guards[0], s),
        "guard+loader": lambda s: guarded_step(work, batches[3], guards[1], s, attached),
    }
    names = list(loops)
    rng = random.Random(args.seed)
    for step in range(3 * args.block_steps):         # warm up every loop, untimed
        for name in names:
            loops[name](step)
    blocks: dict[str, list[float]] = {name: [] for name in names}
    step = 3 * args.block_steps
    for _ in range(args.blocks):
        sums = dict.fromkeys(names, 0.0)
        for _ in range(args.block_steps):
            order = names[:]
            rng.shuffle(order)
            for name in order:
                sums[name] += loops[name](step)
            step += 1
        for name in names:
            blocks[name].append(sums[name])
    plain_ms = statistics.median(blocks["plain"]) / args.block_steps * 1000
    where = f"{torch.cuda.get_device_name()}, fp32" if cuda else \
        f"{torch.get_num_threads()} torch thread,"
    machine = f"{where} matmul n={n}"
    say = (lambda *a, **k: None) if args.json else print
    say(f"machine: {machine}, plain step median "
        f"{plain_ms:.2f} ms; {args.blocks} blocks x {args.block_steps} rounds, one step of "
        f"each loop per round in random order")
    figures: dict[str, dict[str, float]] = {}
    # the control first (plain vs plain again), then each guarded loop against both plain ones
    base = {"plain again": blocks["plain"]}
    both = [(a + b) / 2 for a, b in zip(blocks["plain"], blocks["plain again"])]
    steps = step - 3 * args.block_steps
    control_ok = True
    for name in names[1:]:
        reference = base.get(name, both)
        med, lo, hi = median_ci([a / b for a, b in zip(reference, blocks[name])])
        total = sum(reference) / sum(blocks[name])
        extra_us = (sum(blocks[name]) - sum(reference)) / steps * 1e6
        if name == "plain again":
            control_ok = lo <= 1.0 <= hi
            against, goal = "plain", "control: expect 1" + (
                "" if control_ok else "; NOT within the CI: this run's noise is not what the "
                "CI assumes, rerun before quoting it")
        else:
            against, goal = "both plain", f"goal >= {GOAL}: {verdict(lo, med)}"
        figures[name] = {"median": med, "lo": lo, "hi": hi, "total": total,
                         "extra_us": extra_us}
        say(f"{name:>13}: throughput ratio vs {against} {med:.4f} (95% CI {lo:.4f}-{hi:.4f}), "
            f"total-time ratio {total:.4f} ({extra_us:+.1f} us/step); {goal}")
    say(f"decisions during the timed loops: {len(decisions)} "
        f"({', '.join(sorted({d.action.value for d in decisions})) or 'none'})")
    cost = guard_cost_us(new_guard())
    say(f"guard alone: {cost:.1f} us per step (timer + probe + gate, no work), "
        f"{cost / (plain_ms * 1000):.4%} of a {plain_ms:.1f} ms step")
    if args.json:
        print(json.dumps({"seed": args.seed, "machine": machine, "plain_ms": plain_ms,
                          "loops": figures, "decisions": len(decisions),
                          "guard_alone_us": cost}))


if __name__ == "__main__":
    main()
