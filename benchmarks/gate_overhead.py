"""Throughput of a ~10 ms training step with and without the guard, interleaved in one run.

    python benchmarks/gate_overhead.py [--pairs 60] [--steps 20] [--step-ms 10]

Three loops over the same work (a matmul "forward", a matmul "backward", an in-place
"optimizer" update on one thread, sized for about --step-ms per step on an idle core):

* ``plain``: a torch DataLoader (num_workers 0, shuffled) and the work, nothing else;
* ``guard``: the same plus a StepGuard per step (begin_step, four phase marks, end_step:
  timer + ProcessMemoryProbe read + gate);
* ``guard+loader``: the StepGuard and the GuardedDataLoader (num_workers 0 as well, so the
  comparison is the guard's own bookkeeping, not a different worker count), when
  ``raytrain_guard/runtime/loader.py`` exists.

Each round runs one block of --steps steps of every loop, in a rotating order (ABC, BCA, CAB,
...); the per-round ratio is plain time / guarded time (throughput ratio). The figure is the
median of the per-round ratios with a distribution-free 95 % confidence interval (order
statistics of the binomial), for wall-clock time and for this process's CPU time (the
second is not disturbed by other processes taking the cores: on a shared box it is the one
that resolves a fraction of a percent). Also printed: the guard's own cost per step, timed
alone.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.utils.data import DataLoader, TensorDataset

from raytrain_guard.config import GuardConfig
from raytrain_guard.runtime.probes import ProcessMemoryProbe
from raytrain_guard.runtime.step_guard import StepGuard

try:
    from raytrain_guard.runtime.loader import GuardedDataLoader
except ImportError:   # the loader lands in another change
    GuardedDataLoader = None

BATCH = 32
FEATURES = 64


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


def calibrate(step_ms: float) -> int:
    """Matrix size n for which two n x n matmuls and an add take about step_ms (the fastest
    of five tries, so a busy machine does not shrink the step)."""
    n = 128
    while True:
        a = torch.randn(n, n)
        tries = []
        for _ in range(5):
            t0 = time.perf_counter()
            (a @ a).add_(a @ a)
            tries.append(time.perf_counter() - t0)
        per_step_ms = min(tries) * 1000
        if per_step_ms >= step_ms or n > 4096:
            return max(64, int(n * (step_ms / per_step_ms) ** (1 / 3)))
        n = int(n * 1.25)


class Work:
    def __init__(self, n: int) -> None:
        self.w = torch.randn(n, n)
        self.g = torch.empty(n, n)

    def forward(self, batch) -> torch.Tensor:
        return self.w @ self.w + batch[0].sum()

    def backward(self, y: torch.Tensor) -> None:
        torch.mm(y, self.w, out=self.g)

    def optimizer(self) -> None:
        self.w.add_(self.g, alpha=-1e-12)


def plain_block(work: Work, batches, steps: int) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        batch = next(batches)
        y = work.forward(batch)
        work.backward(y)
        work.optimizer()
    return time.perf_counter() - t0, time.process_time() - c0


def guarded_block(work: Work, batches, guard: StepGuard, steps: int,
                  first_step: int) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    for step in range(first_step, first_step + steps):
        guard.begin_step(step)
        batch = next(batches)
        guard.mark("data")
        y = work.forward(batch)
        guard.mark("forward")
        work.backward(y)
        guard.mark("backward")
        work.optimizer()
        guard.mark("optimizer")
        guard.end_step(step)
    return time.perf_counter() - t0, time.process_time() - c0


def forever(loader):
    while True:
        yield from loader


def guard_cost_us(guard: StepGuard, steps: int = 20000) -> float:
    """The guard alone (no work): begin, four marks, end per step, in microseconds."""
    t0 = time.perf_counter()
    for step in range(steps):
        guard.begin_step(step)
        guard.mark("data")
        guard.mark("forward")
        guard.mark("backward")
        guard.mark("optimizer")
        guard.end_step(step)
    return (time.perf_counter() - t0) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=60, help="rounds (one block of each loop)")
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    parser.add_argument("--step-ms", type=float, default=10.0, help="target step time")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GuardConfig()
    n = calibrate(args.step_ms)
    work = Work(n)
    dataset = TensorDataset(torch.randn(100_000, FEATURES))
    plain_batches = forever(DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=0))
    # Decisions are counted, not logged: on a shared box a noisy block can raise slow steps.
    logging.getLogger("raytrain_guard").setLevel(logging.ERROR)
    decisions: list = []
    guard = StepGuard(config, probe=ProcessMemoryProbe(config), on_decision=decisions.append)
    loops = {"plain": lambda s: plain_block(work, plain_batches, args.steps)}
    loops["guard"] = lambda s: guarded_block(work, plain_batches, guard, args.steps, s)
    if GuardedDataLoader is not None:
        loader = GuardedDataLoader(dataset, BATCH, config=config, world_rank=0, world_size=1,
                                   gpus_per_node=1, num_workers=0)
        guarded_batches = forever(loader)
        guard2 = StepGuard(config, probe=ProcessMemoryProbe(config),
                           on_decision=decisions.append)
        loops["guard+loader"] = lambda s: guarded_block(work, guarded_batches, guard2,
                                                        args.steps, s)
    names = list(loops)
    for name in names:                      # warm up every loop once, untimed
        loops[name](0)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    step = args.steps
    for r in range(args.pairs):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            times[name].append(loops[name](step))
        step += args.steps
    plain_ms = statistics.median(t for t, _ in times["plain"]) / args.steps * 1000
    print(f"machine: {torch.get_num_threads()} torch thread, matmul n={n}, "
          f"plain step median {plain_ms:.2f} ms, {args.pairs} rounds x {args.steps} steps")
    for name in names[1:]:
        for kind, i in (("wall-clock", 0), ("CPU-time", 1)):
            ratios = [a[i] / b[i] for a, b in zip(times["plain"], times[name])]
            med, lo, hi = median_ci(ratios)
            print(f"{name:>13}: {kind:>10} throughput ratio vs plain {med:.4f} "
                  f"(95% CI {lo:.4f}-{hi:.4f}), goal >= 0.995: "
                  f"{'met' if lo >= 0.995 else 'met by the median' if med >= 0.995 else 'NOT met'}")
    if GuardedDataLoader is None:
        print("guard+loader: not measured (raytrain_guard/runtime/loader.py does not exist)")
    print(f"decisions during the timed loops: {len(decisions)} "
          f"({', '.join(sorted({d.action.value for d in decisions})) or 'none'})")
    cost = guard_cost_us(StepGuard(config, probe=ProcessMemoryProbe(config)))
    print(f"guard alone: {cost:.1f} us per step (timer + probe + gate, no work), "
          f"{cost / (plain_ms * 1000):.4%} of a {plain_ms:.1f} ms step")


if __name__ == "__main__":
    main()
