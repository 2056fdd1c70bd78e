"""The guarded DataLoader: sized from measured batches, sharded exactly once, resumable.

:class:`GuardedDataLoader` joins the parts of this folder around a torch DataLoader. Its
contracts: docs/train_loop.md, "The guarded DataLoader".
"""

from __future__ import annotations

import logging
import math
import os
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from raytrain_guard.config import GuardConfig
from raytrain_guard.coordination.context import current_context
from raytrain_guard.errors import InputError, check_int
from raytrain_guard.planner.batch_inspect import is_list_backed, measure_dataset
from raytrain_guard.planner.dataloader_sizing import DataLoaderPlan
from raytrain_guard.runtime.data.figures import DataWaitFigures
from raytrain_guard.runtime.data.iteration import LoaderIteration
from raytrain_guard.runtime.data.pipeline import WorkerPipeline
from raytrain_guard.runtime.data.resume import (
    EpochPosition,
    resume_state,
    saved_order,
    saved_position,
)
from raytrain_guard.runtime.data.sampler import ResumableDistributedSampler
from raytrain_guard.runtime.data.sizing import HostProbe, LoaderSizing
from raytrain_guard.runtime.data.worker_memory import WorkerMemoryWatcher

logger = logging.getLogger(__name__)


class GuardedDataLoader:
    """A DataLoader for one training process, sized, sharded and watched by the guard.

    :meth:`state_dict` holds the epoch and the position in its permutation (samples delivered
    to the loop, all ranks together; batches fetched ahead are fetched again on resume).
    Errors are raised in ``__init__`` where possible, from figures every rank computes alike,
    so every rank raises the same error before any collective.
    """

    def __init__(self, dataset: Any, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, collate_fn: Callable[[list], Any] | None = None,
                 config: GuardConfig = GuardConfig(), world_rank: int | None = None,
                 world_size: int | None = None, device: Any = None,
                 num_workers: int | None = None, prefetch_factor: int | None = None,
                 host_memory_bytes: int | None = None, gpus_per_node: int | None = None,
                 cpus_per_node: int | None = None, device_prefetch_depth: int = 1,
                 persistent_workers: bool = True, clock: Callable[[], float] = time.perf_counter,
                 host_memory_probe: HostProbe | None = None,
                 multiprocessing_context: Any = None, watch_worker_memory: bool = True) -> None:
        check_int("batch_size", batch_size, at_least=1,
                  fix="pass the per-rank micro-batch size, e.g. 32")
        check_int("device_prefetch_depth", device_prefetch_depth, fix="use 0 (off), 1 or 2")
        if num_workers is not None:
            check_int("num_workers", num_workers, fix="use None to let the guard size it")
        if prefetch_factor is not None:
            check_int("prefetch_factor", prefetch_factor, at_least=1,
                      fix="use None to let the guard size it")
        num_samples = _dataset_len(dataset)
        ctx = current_context()
        self.world_size = ctx.world_size if world_size is None else world_size
        self.world_rank = ctx.world_rank if world_rank is None else world_rank
        check_int("world_size", self.world_size, at_least=1,
                  fix="pass the number of data-parallel ranks")
        if not isinstance(self.world_rank, int) or not 0 <= self.world_rank < self.world_size:
            raise InputError("world_rank", f"must be in [0, {self.world_size - 1}]",
                             value=self.world_rank, fix="pass this process's rank in the run")

        self.dataset = dataset
        self.batch_size = batch_size
        self.num_samples = num_samples
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.config = config
        self.device = torch.device(device) if device is not None else None
        #: batches are pinned for the copy to a CUDA device
        self.pin_memory = pin_memory = (self.device is not None and self.device.type == "cuda"
                                        and torch.cuda.is_available())

        # Measure a real batch and check the samples agree, before any worker exists.
        probe_signature, self.probe_batch_bytes = probe_batch(dataset, batch_size, collate_fn,
                                                               config)
        self._figures = DataWaitFigures()
        self._sizing = LoaderSizing(
            batch_bytes=self.probe_batch_bytes, figures=self._figures, config=config,
            gpus_per_node=gpus_per_node if gpus_per_node is not None else max(
                1, ctx.local_world_size),
            cpus_per_node=cpus_per_node if cpus_per_node is not None else usable_cpus(),
            pin_memory=pin_memory, device=self.device,
            list_backed=is_list_backed(dataset, min_items=config.list_dataset_min_items),
            num_workers=num_workers, prefetch_factor=prefetch_factor,
            device_prefetch_depth=device_prefetch_depth, host_memory_bytes=host_memory_bytes,
            host_probe=host_memory_probe, world_rank=self.world_rank)

        self._sampler = ResumableDistributedSampler(
            dataset, num_replicas=self.world_size, rank=self.world_rank, shuffle=self.shuffle,
            seed=self.seed, drop_last=self.drop_last)
        if len(self) == 0:
            raise InputError("batch_size", f"leaves no batch: {num_samples} samples over "
                             f"{self.world_size} ranks with drop_last give each rank fewer than "
                             f"{batch_size}", value=batch_size,
                             fix="use a smaller batch_size, or drop_last=False")
        self._pipeline = WorkerPipeline(
            dataset, batch_size=batch_size, sampler=self._sampler, drop_last=self.drop_last,
            collate_fn=collate_fn, seed=self.seed, persistent_workers=bool(persistent_workers),
            multiprocessing_context=multiprocessing_context, pin_memory=pin_memory,
            device=self.device)
        self._pos = EpochPosition(num_samples, batch_size * self.world_size)
        self._watcher: WorkerMemoryWatcher | None = None
        if watch_worker_memory:
            ref = weakref.ref(self)
            self._watcher = WorkerMemoryWatcher(
                lambda: ref().worker_pids() if ref() is not None else (),
                interval_s=config.worker_memory_interval_s,
                num_samples=config.worker_memory_growth_samples,
                min_growth_bytes=config.worker_memory_growth_bytes)
            weakref.finalize(self, self._watcher.stop)
        self._iteration = LoaderIteration(
            pipeline=self._pipeline, sampler=self._sampler, pos=self._pos, sizing=self._sizing,
            figures=self._figures, watcher=self._watcher, clock=clock,
            probe_signature=probe_signature, check_shapes=collate_fn is None,
            dataset_name=type(dataset).__name__, world_rank=self.world_rank)
        logger.info("rank %d/%d: %s", self.world_rank, self.world_size, self.plan.reason)
        for warning in self.plan.warnings:
            logger.warning("rank %d: %s", self.world_rank, warning)

    # -- the torch DataLoader -------------------------------------------------------------------
    @property
    def torch_loader(self) -> DataLoader:
        """The underlying torch DataLoader (built on first use, rebuilt by a re-plan)."""
        return self._pipeline.loader(self.plan)

    def worker_pids(self) -> tuple[int, ...]:
        """Process ids of the live DataLoader workers (empty without workers)."""
        return self._pipeline.worker_pids()

    # -- iteration -------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return self._iteration.begin()

    def __len__(self) -> int:
        """Batches of a whole epoch on this rank."""
        per_rank = (self.num_samples // self.world_size if self.drop_last
                    else -(-self.num_samples // self.world_size))
        return per_rank // self.batch_size if self.drop_last else -(-per_rank // self.batch_size)

    def time_steps(self, steps: Any) -> bool:
        """From the next iterator on, call ``steps.before_fetch()`` before each fetch and
        ``steps.after_fetch()`` when the batch is there (None stops); returns whether it will
        (:meth:`~raytrain_guard.runtime.guard.step_guard.StepGuard.attach_loader`)."""
        self._iteration.steps = steps
        return steps is not None

    # -- epoch and resume ------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._pos.epoch

    @property
    def batches_consumed(self) -> int:
        """Batches this rank has delivered in the current epoch (resumed ones included)."""
        return self._pos.batches_consumed

    @property
    def samples_consumed(self) -> int:
        """The epoch's position in samples of all ranks together (independent of the world
        size and the batch size): what the resume state records."""
        return self._pos.samples_consumed

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; a no-op for the current epoch (keeps a resume)."""
        check_int("epoch", epoch, fix="pass the epoch number, from 0")
        if epoch == self._pos.epoch:
            return
        self._iteration.stop()
        self._pos.move_to(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands: enough to continue with no sample lost or repeated."""
        return resume_state(self._pos, self._order(), batch_size=self.batch_size,
                            world_size=self.world_size)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; also valid after a change of world size or batch size."""
        epoch, position, batches = saved_position(state, num_samples=self.num_samples,
                                                  batch_size=self.batch_size,
                                                  world_size=self.world_size)
        order = saved_order(state, self._order(), self.world_rank)
        self.seed, self.shuffle, self.drop_last = order["seed"], order["shuffle"], \
            order["drop_last"]
        self._sampler.seed, self._sampler.shuffle = self.seed, self.shuffle
        self._sampler.drop_last = self._pipeline.drop_last = self.drop_last
        self._pipeline.seed = self.seed
        self._iteration.stop()
        self._pos.move_to(epoch, position, batches)
        self._pos.started = True

    def _order(self) -> dict[str, Any]:
        return {"seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last}

    # -- resizing --------------------------------------------------------------------------------
    @property
    def plan(self) -> DataLoaderPlan:
        """The plan in effect: num_workers, prefetch_factor, bytes and the reason."""
        return self._sizing.plan

    @property
    def prefetch_factor(self) -> int:
        """The workers' prefetch_factor in effect (a requested cap included; 0 without workers)."""
        return self.plan.prefetch_factor

    def request_prefetch_factor(self, prefetch_factor: int | None) -> None:
        """Cap the workers' prefetch_factor (None lifts the cap; never above the plan): the
        plan changes at once, a live iterator is rebuilt where the loop is before its next
        batch."""
        if prefetch_factor is not None:
            check_int("prefetch_factor", prefetch_factor, at_least=1, fix="use 1 or more, or None")
        if self._sizing.request_prefetch_factor(prefetch_factor, self._pos.epoch):
            self._iteration.rebuild()

    @property
    def device_prefetch_depth(self) -> int:
        return self._sizing.device_prefetch_depth

    def set_device_prefetch_depth(self, depth: int) -> int:
        """Keep ``depth`` batches ready from the next batch on; returns the depth applied
        (lowered to what the host budget leaves when those batches are host memory)."""
        check_int("device_prefetch_depth", depth, fix="use 0 (off), 1 or 2")
        applied = self._sizing.set_device_prefetch_depth(depth)
        self._iteration.match_stage()     # the live stage follows
        return applied

    # -- figures ---------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Data-wait totals, batches, bytes in flight (estimate), re-plans."""
        plan, watcher = self.plan, self._watcher
        host, device = self._sizing.bytes_in_flight()
        return {"epoch": self._pos.epoch, "batches_consumed": self.batches_consumed,
                **self._figures.to_dict(), "bytes_in_flight_estimate": host + device,
                "host_bytes_in_flight_estimate": host, "device_bytes_in_flight_estimate": device,
                "host_budget_bytes": plan.budget_bytes, "num_workers": plan.num_workers,
                "prefetch_factor": plan.prefetch_factor,
                "device_prefetch_depth": self._sizing.device_prefetch_depth,
                "replans": self._sizing.num_replans,
                "worker_private_bytes": watcher.last_private_bytes if watcher else 0,
                "copy_on_read_warned": bool(watcher and watcher.warned)}

    @property
    def last_data_wait_s(self) -> float:
        """How long the loop waited for the latest batch."""
        return self._figures.last_wait_s

    @property
    def last_batch_bytes(self) -> int:
        """Bytes of the latest batch."""
        return self._figures.last_batch_bytes

    def close(self) -> None:
        """Stop the workers and the memory watcher."""
        if self._watcher is not None:
            self._watcher.stop()
        self._iteration.close()

    def __enter__(self) -> GuardedDataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _dataset_len(dataset: Any) -> int:
    try:
        n = len(dataset)
    except TypeError:
        raise InputError("dataset", "has no length", value=type(dataset).__name__,
                         fix="pass a map-style dataset (__len__ and __getitem__)") from None
    if n == 0:
        raise InputError("dataset", "is empty", value=0,
                         fix="check the data path or the filter that built the dataset")
    return n


def probe_batch(dataset: Any, batch_size: int, collate_fn: Callable[[list], Any] | None,
                config: GuardConfig, *, field: str = "dataset") -> tuple[Any, int]:
    """Collate dataset[0..k-1] here: (signature, bytes scaled to one full batch). ``field``
    names the dataset in an error."""
    k = max(1, min(config.loader_probe_samples, batch_size, len(dataset)))
    measured = measure_dataset(dataset, num_samples=k, collate=collate_fn, config=config,
                               field=field, error=InputError, require_bytes=False)
    return measured.signature, max(1, math.ceil(measured.batch_bytes * batch_size / k))


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), for sizing loader workers."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1
