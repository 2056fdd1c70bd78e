"""The micro-batch of a plan (pure): the largest that fits the device budget, the gradient
accumulation that reaches a requested global batch (``global = micro_batch x grad_accum x
world_size``), and the largest whose batches fit the host prefetch budget.
"""

from __future__ import annotations

import dataclasses
import math

from raytrain_guard.config import GuardConfig
from raytrain_guard.planner.dataloader_sizing import host_budget_bytes, workers_per_gpu
from raytrain_guard.planner.memory_model import TrainingSetup, estimate
from raytrain_guard.planner.model_stats import ActivationProfile, ModelStats

#: the micro-batch search stops here (activations that small per sample are a profile error)
MAX_MICRO_BATCH_SEARCH = 1 << 24


def _fits(model, activations, setup, micro, budget, config) -> bool:
    est = estimate(model, activations, dataclasses.replace(setup, micro_batch=micro), config)
    return est.total_bytes <= budget


def max_micro_batch(model: ModelStats, activations: ActivationProfile, setup: TrainingSetup,
                     budget: int, config: GuardConfig) -> int | None:
    """The largest micro-batch whose step fits ``budget`` (0: not even 1; None: no limit).

    Memory grows with the micro-batch, so: gallop (1, 2, 4, ...) to the first size that does not
    fit, then bisect between the last that fits and it.
    """
    if not _fits(model, activations, setup, 1, budget, config):
        return 0
    if activations.bytes_per_sample <= 0:
        return None
    good, bad = 1, 2
    while _fits(model, activations, setup, bad, budget, config):
        good, bad = bad, bad * 2
        if good >= MAX_MICRO_BATCH_SEARCH:
            return good
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if _fits(model, activations, setup, mid, budget, config) \
            else (good, mid)
    return good


def batching(setup: TrainingSetup, max_micro: int | None, global_batch: int | None,
              auto: bool) -> tuple[int, int, list[str]]:
    """(micro_batch, grad_accum, warnings) for the requested global batch."""
    world = setup.world_size
    micro = setup.micro_batch
    if auto and max_micro:
        micro = max_micro
    if global_batch is None:
        return micro, setup.grad_accum, []
    said: list[str] = []
    per_rank, rest = divmod(global_batch, world)
    if auto and max_micro and not rest:
        exact = largest_divisor_at_most(per_rank, max_micro)
        if exact * 2 >= max_micro or exact == per_rank:
            return exact, per_rank // exact, []
    accum = max(1, math.ceil(global_batch / (micro * world)))
    reached = micro * accum * world
    if reached != global_batch:
        msg = (f"global batch {global_batch} cannot be met exactly: {micro} x {accum} x {world} "
               f"ranks = {reached}")
        if rest:
            msg += f" ({global_batch} is not a multiple of the world size {world})"
        else:
            limit = max_micro if max_micro else micro
            exact = largest_divisor_at_most(per_rank, limit)
            msg += (f"; exact: micro-batch {exact} x grad_accum {per_rank // exact} x {world} "
                    f"= {global_batch}")
        said.append(msg)
    return micro, accum, said


def host_micro_batch_cap(sample_bytes: float, host_memory_bytes: int, cpus_per_node: int,
                          gpus_per_node: int, pin_memory: bool, config: GuardConfig) -> int:
    """The largest micro-batch whose batches, one per DataLoader worker (pinned copies
    included), fit the host prefetch budget; at least 1 (size_dataloader then reports it)."""
    budget = host_budget_bytes(host_memory_bytes, gpus_per_node, config)
    workers = max(1, workers_per_gpu(cpus_per_node, gpus_per_node, config))
    per_sample = sample_bytes * (2 if pin_memory else 1) * workers
    return max(1, int(budget // per_sample))


def largest_divisor_at_most(n: int, limit: int) -> int:
    return next(d for d in range(min(n, limit), 0, -1) if n % d == 0)
