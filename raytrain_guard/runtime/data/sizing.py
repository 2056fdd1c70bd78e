"""How many workers and how deep a prefetch one GuardedDataLoader runs: the planner's rule
(:func:`~raytrain_guard.planner.dataloader_sizing.size_dataloader`) on measured batch bytes and
the host memory as it is now, re-applied at epoch boundaries and on request, and the depth of
the stage that keeps batches ready, held within what the plan leaves of the host budget."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable

from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import PlanInputError
from raytrain_guard.planner.dataloader_sizing import DataLoaderPlan, size_dataloader
from raytrain_guard.runtime.data.figures import DataWaitFigures
from raytrain_guard.runtime.host_memory import host_memory
from raytrain_guard.units import format_bytes

logger = logging.getLogger(__name__)

HostProbe = Callable[[], "tuple[int, int]"]   # () -> (total bytes, available bytes)


class LoaderSizing:
    """The plan of one loader and its stage's depth. ``batch_bytes``: one full batch as
    measured before any worker starts; ``figures``: the batches delivered since (an epoch's
    largest sizes the next); ``num_workers`` / ``prefetch_factor``: the user's, kept when
    given; ``host_memory_bytes``: a fixed host size instead of ``host_probe`` readings;
    ``device_prefetch_depth``: batches the stage keeps ready (lowered when they are host
    memory the budget lacks)."""

    def __init__(self, *, batch_bytes: int, figures: DataWaitFigures, config: GuardConfig,
                 gpus_per_node: int, cpus_per_node: int, pin_memory: bool, device: object,
                 list_backed: bool, num_workers: int | None, prefetch_factor: int | None,
                 device_prefetch_depth: int, host_memory_bytes: int | None,
                 host_probe: HostProbe | None, world_rank: int) -> None:
        self.config = config
        self._figures = figures
        self._pin_memory = pin_memory
        self._device = device
        # the planner's rule with the inputs that stay fixed for this loader
        self._size = functools.partial(
            size_dataloader, gpus_per_node=gpus_per_node, cpus_per_node=cpus_per_node,
            pin_memory=pin_memory, config=config, list_backed_dataset=list_backed,
            num_workers=num_workers, prefetch_factor=prefetch_factor)
        self._host_memory_bytes = host_memory_bytes
        self._host_probe = host_probe or host_memory
        self._world_rank = world_rank
        self._requested_prefetch: int | None = None
        self.planned_batch_bytes = batch_bytes
        self.num_replans = 0
        self.plan = self._make_plan(batch_bytes)        # raises PlanInputError if too big
        self.device_prefetch_depth = self._fit_stage_depth(device_prefetch_depth, warn=False)

    @property
    def batch_bytes(self) -> int:
        """The largest batch delivered this epoch, else the figure of the last plan."""
        return self._figures.max_batch_bytes or self.planned_batch_bytes

    def replan(self, epoch: int) -> bool:
        """At an epoch boundary: re-size from the epoch's largest batch and host pressure (the
        next epoch measures afresh). Returns whether workers or prefetch changed."""
        batch_bytes = self.batch_bytes
        self._figures.max_batch_bytes = 0
        changed = self._adopt(self._plan_or_keep(batch_bytes))
        self.planned_batch_bytes = batch_bytes
        if changed:
            logger.info("rank %d epoch %d: re-planned DataLoader: %s", self._world_rank, epoch,
                        self.plan.reason)
        self.device_prefetch_depth = self._fit_stage_depth(self.device_prefetch_depth, warn=True)
        return changed

    def request_prefetch_factor(self, prefetch_factor: int | None, epoch: int) -> bool:
        """Cap the prefetch_factor (None lifts the cap); returns whether the plan changed."""
        self._requested_prefetch = prefetch_factor
        if not self._adopt(self._plan_or_keep(self.batch_bytes)):
            return False
        logger.info("rank %d epoch %d: re-planned DataLoader on request: %s",
                    self._world_rank, epoch, self.plan.reason)
        self.device_prefetch_depth = self._fit_stage_depth(self.device_prefetch_depth, warn=True)
        return True

    def set_device_prefetch_depth(self, depth: int) -> int:
        """Keep ``depth`` batches ready; returns the depth applied."""
        self.device_prefetch_depth = self._fit_stage_depth(depth, warn=True)
        return self.device_prefetch_depth

    def stage_in_host(self) -> bool:
        """Batches kept ahead are host memory: no CUDA stage, and workers or a device stage."""
        return not self._pin_memory and (self._device is not None or self.plan.num_workers > 0)

    def wants_thread(self) -> bool:
        """Batches from worker processes, not on CUDA (there torch's pin-memory thread takes
        them from the workers), and batches to keep ahead."""
        return not self._pin_memory and self.plan.num_workers > 0 \
            and self.device_prefetch_depth > 0

    def bytes_in_flight(self) -> tuple[int, int]:
        """Estimated (host, device) bytes of the batches kept ahead: the workers' queues
        (twice when pinned copies are made) and the stage."""
        batch, plan = self.batch_bytes, self.plan
        workers = plan.num_workers * plan.prefetch_factor * batch * (2 if self._pin_memory else 1)
        has_stage = self._device is not None or plan.num_workers > 0
        stage = self.device_prefetch_depth * batch if has_stage else 0
        return (workers + stage, 0) if self.stage_in_host() else (workers, stage)

    def _fit_stage_depth(self, depth: int, *, warn: bool) -> int:
        """``depth``, lowered to what the budget leaves when the stage's batches are host
        memory."""
        if not self.stage_in_host():
            return depth
        room = self.plan.budget_bytes - self.plan.host_bytes
        fits = max(0, room // max(1, self.batch_bytes))
        if depth <= fits:
            return depth
        log = logger.warning if warn else logger.info
        log("rank %d: device_prefetch_depth %d lowered to %d: on %s its batches are host memory "
            "and only %s of the %s budget is left", self._world_rank, depth, fits, self._device,
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
        plan = self._size(batch_bytes=batch_bytes, host_memory_bytes=host,
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
