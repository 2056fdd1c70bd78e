"""How many workers and how deep a prefetch one GuardedDataLoader runs: the planner's rule
(:func:`~raytrain_guard.core.dataloader_sizing.size_dataloader`) on measured batch bytes and
the host memory as it is now, re-applied at epoch boundaries and on request."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.dataloader_sizing import DataLoaderPlan, size_dataloader
from raytrain_guard.errors import PlanInputError
from raytrain_guard.host_memory import host_memory
from raytrain_guard.units import format_bytes

logger = logging.getLogger(__name__)

HostProbe = Callable[[], "tuple[int, int]"]   # () -> (total bytes, available bytes)


class LoaderSizing:
    """The plan of one loader. ``batch_bytes``: one full batch as measured before any worker
    starts; ``num_workers`` / ``prefetch_factor``: the user's, kept when given;
    ``host_memory_bytes``: a fixed host size instead of ``host_probe`` readings."""

    def __init__(self, *, batch_bytes: int, config: GuardConfig, gpus_per_node: int,
                 cpus_per_node: int, pin_memory: bool, list_backed: bool,
                 num_workers: int | None, prefetch_factor: int | None,
                 host_memory_bytes: int | None, host_probe: HostProbe | None,
                 world_rank: int) -> None:
        self.config = config
        self._gpus_per_node = gpus_per_node
        self._cpus_per_node = cpus_per_node
        self._pin_memory = pin_memory
        self._list_backed = list_backed
        self._num_workers = num_workers
        self._prefetch_factor = prefetch_factor
        self._host_memory_bytes = host_memory_bytes
        self._host_probe = host_probe or host_memory
        self._world_rank = world_rank
        self._requested_prefetch: int | None = None
        self.planned_batch_bytes = batch_bytes
        self.num_replans = 0
        self.plan = self._make_plan(batch_bytes)        # raises PlanInputError if too big

    def replan(self, batch_bytes: int, epoch: int) -> bool:
        """At an epoch boundary: re-size from ``batch_bytes`` (the largest of the epoch) and
        host pressure. Returns whether workers or prefetch changed."""
        changed = self._adopt(self._plan_or_keep(batch_bytes))
        self.planned_batch_bytes = batch_bytes
        if changed:
            logger.info("rank %d epoch %d: re-planned DataLoader: %s", self._world_rank, epoch,
                        self.plan.reason)
        return changed

    def request_prefetch_factor(self, prefetch_factor: int | None, batch_bytes: int,
                                epoch: int) -> bool:
        """Cap the prefetch_factor (None lifts the cap); returns whether the plan changed."""
        self._requested_prefetch = prefetch_factor
        changed = self._adopt(self._plan_or_keep(batch_bytes))
        if changed:
            logger.info("rank %d epoch %d: re-planned DataLoader on request: %s",
                        self._world_rank, epoch, self.plan.reason)
        return changed

    def fit_stage_depth(self, depth: int, batch_bytes: int, where: object, *,
                        warn: bool) -> int:
        """``depth`` batches kept ready in host memory, lowered to what the budget leaves."""
        room = self.plan.budget_bytes - self.plan.host_bytes
        fits = max(0, room // max(1, batch_bytes))
        if depth <= fits:
            return depth
        log = logger.warning if warn else logger.info
        log("rank %d: device_prefetch_depth %d lowered to %d: on %s its batches are host memory "
            "and only %s of the %s budget is left", self._world_rank, depth, fits, where,
            format_bytes(room), format_bytes(self.plan.budget_bytes))
        return int(fits)

    def _adopt(self, plan: DataLoaderPlan) -> bool:
        old, self.plan = self.plan, plan
        changed = (plan.num_workers, plan.prefetch_factor) != (old.num_workers,
                                                               old.prefetch_factor)
        self.num_replans += changed
        return changed

    def _host_for_plan(self) -> tuple[int, str]:
        """Host bytes the rule divides: total RAM, or what is available under pressure."""
        if self._host_memory_bytes is not None:
            return int(self._host_memory_bytes), ""
        try:
            total, available = self._host_probe()
        except Exception as exc:  # noqa: BLE001 - fail open: plan from the OS's figure
            logger.warning("host memory probe failed (%r); planning from os figures", exc)
            total = available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        used_frac = 1.0 - available / total if total else 0.0
        if used_frac >= self.config.host_memory_watermark_frac:
            return int(available), (f"host under pressure ({used_frac:.0%} used >= "
                                    f"{self.config.host_memory_watermark_frac:.0%}): budget "
                                    f"from {format_bytes(available)} available; ")
        return int(total), ""

    def _make_plan(self, batch_bytes: int) -> DataLoaderPlan:
        host, pressure = self._host_for_plan()
        plan = size_dataloader(batch_bytes=batch_bytes, host_memory_bytes=host,
                               gpus_per_node=self._gpus_per_node,
                               cpus_per_node=self._cpus_per_node, pin_memory=self._pin_memory,
                               config=self.config, list_backed_dataset=self._list_backed,
                               num_workers=self._num_workers,
                               prefetch_factor=self._prefetch_factor,
                               prefetch_cap=self._requested_prefetch)
        return dataclasses.replace(plan, reason=pressure + plan.reason) if pressure else plan

    def _plan_or_keep(self, batch_bytes: int) -> DataLoaderPlan:
        """A new plan; if the rule refuses it (one batch over a shrunken budget), the current
        plan at prefetch_factor 1: fail open, keep training with the smallest queue."""
        try:
            return self._make_plan(batch_bytes)
        except PlanInputError as exc:
            plan = dataclasses.replace(self.plan, prefetch_factor=min(1, self.plan.prefetch_factor),
                                       reason=f"re-plan failed ({exc}); prefetch_factor 1")
            logger.warning("rank %d: %s", self._world_rank, plan.reason)
            return plan
