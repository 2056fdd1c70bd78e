"""Ray Data batches for a Ray Train worker, guarded: ``DataIterator.iter_torch_batches`` with
``prefetch_batches`` held to the host budget, the data wait timed and the depth re-set per epoch.

The rules:

- Budget: ``host_prefetch_frac`` (5 %) of host RAM per GPU, as the DataLoader's; a prefetched
  batch costs its bytes (measured on the first batch of each epoch; the largest seen counts).
- ``prefetch_batches`` the user gave is kept while ``prefetch_batches x batch bytes`` fits, and
  lowered with a warning naming the rule and the figures when it does not. Left out: Ray's 1,
  then sized by the run.
- Between epochs (a shard's iterator cannot be restarted mid-epoch: every rank starts an epoch
  of a streaming split together): an epoch that waited for data more than
  ``ray_data_raise_wait_frac`` (10 %) of its time doubles the depth, never past
  ``max_prefetch_factor`` or the budget; a SET_PREFETCH decision caps it. A raise must pay:
  when the next epoch's wait did not fall by ``effect_min_share`` (half) of the way to that
  line, the depth goes back and is not raised again (a stage slower than the step on average
  is not helped by a deeper queue, which only holds host RAM).
- Each batch's wait ends the step's ``data`` phase (:meth:`time_steps`, the step guard's
  ``before_fetch``/``after_fetch``): a slow pipeline shows as data in the gate and the summary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import check_int
from raytrain_guard.planner.batch_inspect import measure_batch
from raytrain_guard.planner.dataloader_sizing import host_budget_bytes
from raytrain_guard.units import format_bytes

logger = logging.getLogger(__name__)

def fit_prefetch(prefetch_batches: int, batch_bytes: int, budget_bytes: int,
                 config: GuardConfig) -> tuple[int, str | None]:
    """``(prefetch_batches, warning)``: kept when ``prefetch_batches x batch_bytes`` fits
    ``budget_bytes``, else the largest depth that does (at least 1), with the warning (pure)."""
    held = prefetch_batches * batch_bytes
    if held <= budget_bytes:
        return prefetch_batches, None
    fits = max(1, budget_bytes // max(1, batch_bytes))
    return fits, (f"prefetch_batches {prefetch_batches} lowered to {fits}: {prefetch_batches} x "
                  f"{format_bytes(batch_bytes)} per batch = {format_bytes(held)} exceed the host "
                  f"prefetch budget of {format_bytes(budget_bytes)} (rule: host_prefetch_frac "
                  f"{config.host_prefetch_frac:.0%} of host RAM per GPU)")


def next_prefetch(prefetch_batches: int, data_wait_frac: float, batch_bytes: int,
                  budget_bytes: int, config: GuardConfig, cap: int | None = None) -> int:
    """The next epoch's depth (pure): doubled after an epoch that waited for data more than
    ``config.ray_data_raise_wait_frac`` of its time, within ``max_prefetch_factor``, the budget and
    ``cap`` (a SET_PREFETCH decision's)."""
    ceiling = min(config.max_prefetch_factor, max(1, budget_bytes // max(1, batch_bytes)))
    if cap is not None:
        ceiling = min(ceiling, cap)
    wanted = prefetch_batches * 2 if data_wait_frac > config.ray_data_raise_wait_frac \
        else prefetch_batches
    return max(1, min(wanted, ceiling))


def raise_paid(wait_before: float, wait_after: float, config: GuardConfig) -> bool:
    """Whether a raised depth paid for itself (pure): the epoch's data wait fell by at least
    ``effect_min_share`` of the way from the wait before down to ``ray_data_raise_wait_frac``
    (the doubling's aim). Example: 18 % before, line 10 %: at most 14 % after."""
    aim = max(0.0, wait_before - config.ray_data_raise_wait_frac)
    return wait_before - wait_after >= config.effect_min_share * aim


class GuardedBatches:
    """An iterable over a Ray Train worker's Ray Data shard: one epoch per ``iter()``
    (see the module rules). ``kwargs`` go to ``shard.iter_torch_batches``."""

    def __init__(self, shard: Any, *, config: GuardConfig, host_memory_bytes: int,
                 gpus_per_node: int, world_rank: int = 0,
                 clock: Callable[[], float] = time.perf_counter, **kwargs: Any) -> None:
        given = kwargs.pop("prefetch_batches", None)
        if given is not None:
            check_int("prefetch_batches", given, at_least=1, fix="use 1 or more, or leave it "
                      "out for the guard to size it")
        self._shard, self._kwargs, self._clock = shard, kwargs, clock
        self.config = config
        self.world_rank = world_rank
        self.budget_bytes = host_budget_bytes(host_memory_bytes, gpus_per_node, config)
        self.prefetch_batches = given or 1
        self.batch_size = kwargs.get("batch_size", 256)
        self.batch_bytes = 0
        self.lowered: list[str] = []
        self.history: list[dict[str, Any]] = []     # per epoch: depth, wait fraction
        self._cap: int | None = None
        self._raised: tuple[int, float] | None = None   # (depth, wait) before the last raise
        self._raises_pay = True                          # False once a raise did not
        self._steps: Any = None
        self._wait_s = self._total_s = 0.0
        self._batches = 0

    # -- what the guard reads ------------------------------------------------------------------
    @property
    def plan(self) -> Any:
        return _Plan(0, self.prefetch_batches)

    def time_steps(self, steps: Any) -> bool:
        self._steps = steps
        return steps is not None

    def request_prefetch_factor(self, prefetch: int | None) -> None:
        """A SET_PREFETCH decision: cap the depth from the next epoch on (None lifts it)."""
        self._cap = prefetch

    def settings(self) -> dict[str, Any]:
        return {"source": "ray_data", "batch_size": self.batch_size, "num_workers": 0,
                "prefetch_factor": None, "prefetch_batches": self.prefetch_batches,
                "persistent_workers": False,
                "multiprocessing_context": None, "world_size": None,
                "budget_bytes": self.budget_bytes, "batch_bytes": self.batch_bytes,
                "reason": "Ray Data iter_torch_batches", "lowered": list(self.lowered),
                "epochs": list(self.history)}

    def stats(self) -> dict[str, Any]:
        frac = self._wait_s / self._total_s if self._total_s > 0 else 0.0
        return {"data_wait_frac": frac, "data_wait_total_s": self._wait_s,
                "batches": self._batches}

    # -- iteration -------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        it = iter(self._shard.iter_torch_batches(prefetch_batches=self.prefetch_batches,
                                                 **self._kwargs))
        clock, steps = self._clock, self._steps
        epoch_wait = 0.0
        start = last = clock()
        first = True
        while True:
            if steps is not None:
                steps.before_fetch()
            fetch = clock()
            try:
                batch = next(it)
            except StopIteration:
                break
            now = clock()
            if steps is not None:
                steps.after_fetch()
            epoch_wait += now - fetch
            self._wait_s += now - fetch
            self._total_s += now - last
            last = now
            self._batches += 1
            if first:
                first = False
                self._measured(batch)
            yield batch
        self._total_s += clock() - last
        self._epoch_done(epoch_wait, clock() - start)

    def _measured(self, batch: Any) -> None:
        """The first batch of an epoch: its bytes; a given depth over the budget is lowered
        (from the next epoch on: this one's iterator runs)."""
        self.batch_bytes = max(self.batch_bytes, measure_batch(batch).batch_bytes)
        depth, warning = fit_prefetch(self.prefetch_batches, self.batch_bytes,
                                      self.budget_bytes, self.config)
        if warning is not None and depth != self.prefetch_batches:
            logger.warning("rank %d: Ray Data %s", self.world_rank, warning)
            self.lowered.append(warning)
            self.prefetch_batches = depth

    def _epoch_done(self, wait_s: float, epoch_s: float) -> None:
        frac = wait_s / epoch_s if epoch_s > 0 else 0.0
        self.history.append({"prefetch_batches": self.prefetch_batches,
                             "data_wait_frac": round(frac, 4)})
        raised, self._raised = self._raised, None
        if raised is not None and not raise_paid(raised[1], frac, self.config):
            logger.info("rank %d: Ray Data prefetch_batches %d -> %d, not raised again: at %d "
                        "the epoch still waited %.0f%% of its time for data (%.0f%% at %d), the "
                        "stage is slower than the step, not bursty", self.world_rank,
                        self.prefetch_batches, raised[0], self.prefetch_batches, 100 * frac,
                        100 * raised[1], raised[0])
            self.prefetch_batches, self._raises_pay = raised[0], False
            return
        cap = self._cap if self._raises_pay else min(self._cap or self.prefetch_batches,
                                                     self.prefetch_batches)
        depth = next_prefetch(self.prefetch_batches, frac, self.batch_bytes, self.budget_bytes,
                              self.config, cap)
        if depth > self.prefetch_batches:
            self._raised = (self.prefetch_batches, frac)
        if depth != self.prefetch_batches:
            logger.info("rank %d: Ray Data prefetch_batches %d -> %d: the epoch waited %.0f%% "
                        "of its time for data (raised above %.0f%%), %d x %s within the host "
                        "budget of %s", self.world_rank, self.prefetch_batches, depth,
                        100 * frac, 100 * self.config.ray_data_raise_wait_frac, depth,
                        format_bytes(self.batch_bytes), format_bytes(self.budget_bytes))
            self.prefetch_batches = depth


class _Plan:
    """``plan.num_workers`` / ``plan.prefetch_factor`` as the guard's metrics read them."""

    def __init__(self, num_workers: int, prefetch_factor: int) -> None:
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
