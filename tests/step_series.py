"""Synthetic step series of a DDP group on a noisy CPU box: seeded, for the cry-wolf tests.

A step of rank r: data wait, compute (forward + backward + optimizer), then the allreduce,
which ends when the last rank arrives: every rank's communication wait is the time it waited
for the slowest rank plus its link time. So an outlier on one rank (a preemption on a loaded
2-core box) also shows on the others, as a communication wait, as under real DDP.

Noise: each rank's step level drifts between ``level_ms`` bounds (a random walk), every phase
jitters (log-normal), compute speed may wander (log-normal AR(1), ``wander``), and outliers add 2-30 ms to one phase of one rank; with ``burst_p`` an
outlier carries over to the next step (a preemption spanning two steps). Calibration: clean
2.4 ms CPU steps measured on this 2-core box have a MAD of 0.04-0.06 ms and a p99 0.3-0.4 ms
over the median; with a third busy process they alternate with ~2.4x slower steps in runs of
3-7 (see the limits in tests/test_noise.py).

Faults start at ``start`` on one rank and last: compute x ``factor``, or ``extra_ms`` added to
the rank's data wait or to its own communication time (its link). Outliers come on top
(a preemption is not scaled by a slow GPU).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from raytrain_guard.core.steps import StepStats


@dataclass(frozen=True)
class Noise:
    name: str
    level_ms: tuple[float, float] = (3.0, 5.0)
    drift_ms: float = 0.02          # random-walk step of each rank's level per step
    jitter: float = 0.05            # log-normal sigma of every phase
    outlier_p: float = 0.03         # per rank and step
    outlier_ms: tuple[float, float] = (2.0, 30.0)
    burst_p: float = 0.0            # an outlier continues into the next step
    wander: float = 0.0             # log-normal sigma of a compute speed that wanders from
    wander_rho: float = 0.8         # step to step (AR(1) with this correlation: clocks, a
                                    # neighbour's load)


@dataclass(frozen=True)
class Fault:
    kind: str                       # "compute", "data", "comm"
    rank: int
    start: int
    factor: float = 2.5             # compute
    extra_ms: float = 5.0           # data, comm


def series(noise: Noise, *, seed: int, num_ranks: int = 2, num_steps: int = 600,
           fault: Fault | None = None) -> dict[int, list[StepStats]]:
    rng = random.Random(seed)
    lo, hi = noise.level_ms
    level = [rng.uniform(lo, hi) for _ in range(num_ranks)]
    carry = [0.0] * num_ranks        # an outlier carried into the next step
    speed = [0.0] * num_ranks        # log of each rank's wandering compute speed
    rho = noise.wander_rho
    out: dict[int, list[StepStats]] = {r: [] for r in range(num_ranks)}
    for step in range(num_steps):
        phases = []
        for r in range(num_ranks):
            level[r] = min(hi, max(lo, level[r] + rng.gauss(0.0, noise.drift_ms)))
            speed[r] = rho * speed[r] + (1 - rho * rho) ** 0.5 * rng.gauss(0.0, noise.wander)

            def j() -> float:
                return rng.lognormvariate(0.0, noise.jitter)

            data, compute, link = 0.05 * level[r] * j(), \
                0.8 * level[r] * j() * math.exp(speed[r]), 0.1 * level[r] * j()
            if fault is not None and fault.rank == r and step >= fault.start:
                if fault.kind == "compute":
                    compute *= fault.factor
                elif fault.kind == "data":
                    data += fault.extra_ms
                else:
                    link += fault.extra_ms
            extra, carry[r] = carry[r], 0.0
            if rng.random() < noise.outlier_p:
                extra += rng.uniform(*noise.outlier_ms)
                if rng.random() < noise.burst_p:
                    carry[r] = rng.uniform(*noise.outlier_ms)
            if extra:
                where = rng.random()
                if where < 0.7:
                    compute += extra
                elif where < 0.85:
                    data += extra
                else:
                    link += extra
            phases.append((data, compute, link))
        arrival = [d + c for d, c, _ in phases]
        last = max(arrival)
        for r, (data, compute, link) in enumerate(phases):
            wait = last - arrival[r] + link
            total = data + compute + wait + 0.05
            ms = 1e-3
            out[r].append(StepStats(step=step, total_s=total * ms, data_wait_s=data * ms,
                                    forward_s=compute * 0.35 * ms,
                                    backward_s=compute * 0.55 * ms, comm_wait_s=wait * ms,
                                    optimizer_s=compute * 0.10 * ms, world_rank=r))
    return out
