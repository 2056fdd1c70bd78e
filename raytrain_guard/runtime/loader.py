"""The guarded DataLoader: sized from measured batches, sharded exactly once, resumable.

:class:`GuardedDataLoader` builds and drives a torch DataLoader inside a Ray Train worker:
a resumable DistributedSampler (:mod:`~raytrain_guard.runtime.sampler`), workers and prefetch
sized to the host budget (:mod:`~raytrain_guard.runtime.loader_sizing`), batches kept ready
ahead of the loop (:mod:`~raytrain_guard.runtime.device_prefetch`), per-batch data wait
(:mod:`~raytrain_guard.runtime.loader_figures`) and a copy-on-read watch on its workers
(:mod:`~raytrain_guard.runtime.worker_memory`). What it does and its contracts:
docs/train_loop.md, "The guarded DataLoader".
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

from raytrain_guard.batch_inspect import SAME_SHAPE_FIX, is_list_backed, measure_dataset
from raytrain_guard.config import GuardConfig
from raytrain_guard.core.dataloader_sizing import DataLoaderPlan
from raytrain_guard.errors import InputError, check_int
from raytrain_guard.runtime.batches import batch_nbytes, batch_signature
from raytrain_guard.runtime.context import current_context
from raytrain_guard.runtime.device_prefetch import ThreadedPrefetcher
from raytrain_guard.runtime.loader_figures import DataWaitFigures
from raytrain_guard.runtime.loader_pipeline import WorkerPipeline
from raytrain_guard.runtime.loader_position import EpochPosition
from raytrain_guard.runtime.loader_sizing import HostProbe, LoaderSizing
from raytrain_guard.runtime.sampler import ResumableDistributedSampler
from raytrain_guard.runtime.worker_memory import WorkerMemoryWatcher

logger = logging.getLogger(__name__)

_NUM_CHECKED_BATCHES = 3          # delivered batches whose signature is compared to the probe's
_COLLATE_ERRORS = ("stack expects each tensor to be equal size",
                   "each element in list of batch should be of equal size",
                   "Trying to resize storage that is not resizable")   # in a worker (shm)


class GuardedDataLoader:
    """A DataLoader for one training process, sized, sharded and watched by the guard.

    Resuming: :meth:`state_dict` holds the epoch and the position in the epoch's permutation
    (``samples_consumed``, all ranks together); :meth:`load_state_dict` continues there by
    skipping indices in the sampler. The position counts batches delivered to the loop, never
    batches fetched ahead (those are fetched again when the iterator is rebuilt). Errors are
    raised in ``__init__`` where possible, from figures every rank computes alike, so every
    rank raises the same error before any collective.
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
        ctx = None
        if world_rank is None or world_size is None or gpus_per_node is None:
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
        self._collate_fn = collate_fn
        self._clock = clock
        self.device = torch.device(device) if device is not None else None
        self._pin_memory = (self.device is not None and self.device.type == "cuda"
                            and torch.cuda.is_available())

        # Measure a real batch and check the samples agree, before any worker exists.
        self._probe_signature, self.probe_batch_bytes = self._probe_batch()
        self._sizing = LoaderSizing(
            batch_bytes=self.probe_batch_bytes, config=config,
            gpus_per_node=gpus_per_node if gpus_per_node is not None else max(
                1, ctx.local_world_size),
            cpus_per_node=cpus_per_node if cpus_per_node is not None else _cpu_count(),
            pin_memory=self._pin_memory,
            list_backed=is_list_backed(dataset, min_items=config.list_dataset_min_items),
            num_workers=num_workers, prefetch_factor=prefetch_factor,
            host_memory_bytes=host_memory_bytes, host_probe=host_memory_probe,
            world_rank=self.world_rank)
        self._figures = DataWaitFigures()
        self._device_prefetch_depth = self._fit_device_depth(device_prefetch_depth, warn=False)

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
            multiprocessing_context=multiprocessing_context, pin_memory=self._pin_memory,
            device=self.device)
        self._pos = EpochPosition(num_samples, batch_size * self.world_size)
        self._restart_pending = False   # the live iterator restarts at the delivered position
        self._loader_stale = False      # the plan changed: the torch DataLoader is rebuilt
        self._generation = 0            # a live iterator of an older generation stops
        self._num_checked = 0
        self._steps: Any = None         # opens the loop's steps (StepGuard.attach_loader)
        self._watcher: WorkerMemoryWatcher | None = None
        if watch_worker_memory:
            ref = weakref.ref(self)
            self._watcher = WorkerMemoryWatcher(
                lambda: ref().worker_pids() if ref() is not None else (),
                interval_s=config.worker_memory_interval_s,
                num_samples=config.worker_memory_growth_samples,
                min_growth_bytes=config.worker_memory_growth_bytes)
            weakref.finalize(self, self._watcher.stop)
        logger.info("rank %d/%d: %s", self.world_rank, self.world_size, self.plan.reason)
        for warning in self.plan.warnings:
            logger.warning("rank %d: %s", self.world_rank, warning)

    # -- planning -------------------------------------------------------------------------------
    @property
    def plan(self) -> DataLoaderPlan:
        """The plan in effect: num_workers, prefetch_factor, bytes and the reason."""
        return self._sizing.plan

    def _probe_batch(self) -> tuple[Any, int]:
        """Collate dataset[0..k-1] here: (signature, bytes scaled to one full batch)."""
        k = min(self.config.loader_probe_samples, self.batch_size, self.num_samples)
        measured = measure_dataset(self.dataset, num_samples=k, collate=self._collate_fn,
                                   config=self.config, field="dataset", error=InputError,
                                   require_bytes=False)
        nbytes = math.ceil(measured.batch_bytes * self.batch_size / k)
        return measured.signature, max(1, nbytes)

    def _batch_bytes(self) -> int:
        """The largest batch delivered this epoch, else the figure of the last plan."""
        return self._figures.max_batch_bytes or self._sizing.planned_batch_bytes

    def _fit_device_depth(self, depth: int, *, warn: bool) -> int:
        """Clamp the device-prefetch depth to the host budget when its batches are host memory."""
        if not self._stage_in_host():
            return depth
        return self._sizing.fit_stage_depth(depth, self._batch_bytes(), self.device, warn=warn)

    def _replan(self) -> None:
        """At an epoch boundary: re-size from the largest batch of the epoch and host pressure."""
        measured = self._batch_bytes()
        self._figures.max_batch_bytes = 0              # the next epoch measures afresh
        changed = self._sizing.replan(measured, self._pos.epoch)
        self._device_prefetch_depth = self._fit_device_depth(self._device_prefetch_depth,
                                                             warn=True)
        if changed:
            self._close_torch_loader()

    # -- the torch DataLoader -------------------------------------------------------------------
    def _close_torch_loader(self) -> None:
        self._pipeline.close()
        self._loader_stale = False

    @property
    def torch_loader(self) -> DataLoader:
        """The underlying torch DataLoader (built on first use, rebuilt by a re-plan)."""
        pipeline = self._pipeline
        if pipeline.torch_loader is None:
            pipeline.torch_loader = pipeline.build(self.plan)
        return pipeline.torch_loader

    def worker_pids(self) -> tuple[int, ...]:
        """Process ids of the live DataLoader workers (empty without workers)."""
        return self._pipeline.worker_pids()

    # -- iteration ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        pos = self._pos
        self._pipeline.close_stage()      # an earlier iterator's thread stops before the reset
        pos.rebase()
        if pos.start >= self.num_samples or self._batches_left(pos.start) == 0:
            pos.move_to(pos.epoch + 1)
        if pos.start == 0 and pos.batches_before == 0 and pos.started:
            self._replan()
        pos.started = True
        if self._loader_stale:
            self._close_torch_loader()
        self._restart_pending = False
        self._generation += 1
        self._start_torch_iter()
        return self._batches(self._generation)

    def _start_torch_iter(self) -> None:
        """The torch iterator from the current position of the current epoch."""
        self._sampler.set_epoch(self._pos.epoch)
        self._sampler.set_start(self._pos.start)
        self._pipeline.start(self.plan)

    def _stage_in_host(self) -> bool:
        """Batches kept ahead are host memory: no CUDA stage, and workers or a device stage."""
        return not self._pin_memory and (self.device is not None or self.plan.num_workers > 0)

    def _wants_thread(self) -> bool:
        """Batches from worker processes, not on CUDA (there torch's pin-memory thread takes
        them from the workers), and batches to keep ahead."""
        return not self._pin_memory and self.plan.num_workers > 0 \
            and self._device_prefetch_depth > 0

    def _open_stage(self) -> Iterator[Any]:
        return self._pipeline.open_stage(self._device_prefetch_depth,
                                         thread=self._wants_thread())

    def _restart(self) -> Iterator[Any]:
        """Rebuild the torch iterator at the position the training loop reached (batches
        fetched ahead and not delivered are fetched again): how a new plan takes effect
        mid-epoch."""
        pos = self._pos
        self._pipeline.close_stage()
        pos.rebase()
        self._restart_pending = False
        if self._loader_stale:
            self._close_torch_loader()
        if self._batches_left(pos.start) == 0:
            return iter(())                    # the epoch was delivered: it ends here
        self._start_torch_iter()
        logger.info("rank %d epoch %d: DataLoader restarted at sample %d with %d workers x "
                    "prefetch_factor %d", self.world_rank, pos.epoch, pos.start,
                    self.plan.num_workers, self.plan.prefetch_factor)
        return self._open_stage()

    def time_steps(self, steps: Any) -> bool:
        """From the next iterator on, call ``steps.before_fetch()`` before each fetch and
        ``steps.after_fetch()`` when the batch is there (None stops): how an attached
        :class:`~raytrain_guard.runtime.step_guard.StepGuard` opens each step and ends its
        data phase. Returns whether it will. Usually called by :meth:`StepGuard.attach_loader`."""
        self._steps = steps
        return steps is not None

    def _batches(self, generation: int) -> Iterator[Any]:
        clock, steps, figures, pos = self._clock, self._steps, self._figures, self._pos
        source = self._open_stage()
        last = clock()
        try:
            while generation == self._generation:
                if self._restart_pending:
                    source = self._restart()
                elif source is self._pipeline.stage and \
                        source.depth != self._device_prefetch_depth:
                    source.set_depth(self._device_prefetch_depth)
                if steps is not None:
                    steps.before_fetch()
                t0 = clock()
                try:
                    batch = next(source)
                except StopIteration:
                    pos.move_to(pos.epoch + 1)
                    return
                except RuntimeError as exc:
                    if any(text in str(exc) for text in _COLLATE_ERRORS):
                        raise InputError("dataset", "samples of different shapes in one batch",
                                         value=type(self.dataset).__name__,
                                         fix=SAME_SHAPE_FIX) from exc
                    raise
                now = clock()
                if steps is not None:
                    steps.after_fetch()
                figures.record(now - t0, now - last, batch_nbytes(batch))
                last = now
                if self._num_checked < _NUM_CHECKED_BATCHES:
                    self._check_batch(batch)
                pos.batches_in_iter += 1
                if pos.batches_in_iter == 1 and self._watcher is not None \
                        and self.plan.num_workers:
                    self._watcher.start()   # after the first batch: workers are past start-up
                yield batch
                # the loop owns the batch now: freeing it (unmapping its shared memory) is the
                # loop's cost, not a wait for data
                del batch
        finally:
            if source is self._pipeline.stage:
                self._pipeline.close_stage()

    def _check_batch(self, batch: Any) -> None:
        self._num_checked += 1
        sig = batch_signature(batch, shapes=self._collate_fn is None)
        if sig != self._probe_signature:
            raise InputError("dataset", f"batch {self._num_checked - 1} differs in type or shape "
                             f"from the first samples: {sig} vs {self._probe_signature}",
                             value=type(self.dataset).__name__, fix=SAME_SHAPE_FIX)

    def _batches_left(self, position: int) -> int:
        """Batches this rank still delivers in the current epoch from ``position``."""
        self._sampler.set_start(position)
        n = len(self._sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __len__(self) -> int:
        """Batches of a whole epoch on this rank."""
        per_rank = (self.num_samples // self.world_size if self.drop_last
                    else -(-self.num_samples // self.world_size))
        return per_rank // self.batch_size if self.drop_last else -(-per_rank // self.batch_size)

    # -- epoch and resume -----------------------------------------------------------------------
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
        self._generation += 1           # a live iterator of the old epoch stops
        self._pipeline.close_stage()
        self._pos.move_to(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands: enough to continue with no sample lost or repeated."""
        return {"epoch": self._pos.epoch, "batches_consumed": self.batches_consumed,
                "samples_consumed": self._pos.samples_consumed, "seed": self.seed,
                "shuffle": self.shuffle, "drop_last": self.drop_last,
                "num_samples": self.num_samples, "batch_size": self.batch_size,
                "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; also valid after a change of world size or batch size."""
        for key in ("epoch", "batches_consumed"):
            if key not in state:
                raise InputError(f"state_dict[{key!r}]", "missing", value=sorted(state),
                                 fix="pass a dict from GuardedDataLoader.state_dict()")
        if state.get("num_samples", self.num_samples) != self.num_samples:
            raise InputError("state_dict['num_samples']", "differs from this dataset's length "
                             f"{self.num_samples}", value=state["num_samples"],
                             fix="resume with the dataset the state was saved with")
        for key in ("seed", "shuffle", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                logger.warning("rank %d: resuming with the saved %s=%r instead of %r, so the "
                               "epoch order matches", self.world_rank, key, state[key],
                               getattr(self, key))
                setattr(self, key, state[key])
        self._sampler.seed, self._sampler.shuffle = self.seed, self.shuffle
        self._sampler.drop_last = self._pipeline.drop_last = self.drop_last
        self._pipeline.seed = self.seed
        position = state.get("samples_consumed")
        if position is None:
            position = (int(state["batches_consumed"]) * int(state.get("batch_size", self.batch_size))
                        * int(state.get("world_size", self.world_size)))
        self._generation += 1
        self._pipeline.close_stage()
        self._pos.move_to(int(state["epoch"]), int(position), int(state["batches_consumed"]))
        self._pos.started = True

    # -- run-time controls ----------------------------------------------------------------------
    def set_device_prefetch_depth(self, depth: int) -> int:
        """Keep ``depth`` batches ready from the next batch on; returns the depth applied
        (lowered to what the host budget leaves when those batches are host memory)."""
        check_int("device_prefetch_depth", depth, fix="use 0 (off), 1 or 2")
        self._device_prefetch_depth = self._fit_device_depth(depth, warn=True)
        stage = self._pipeline.stage
        if stage is not None and isinstance(stage, ThreadedPrefetcher) != self._wants_thread():
            self._restart_pending = True    # the background stage starts or stops
        return self._device_prefetch_depth

    @property
    def device_prefetch_depth(self) -> int:
        return self._device_prefetch_depth

    @property
    def prefetch_factor(self) -> int:
        """The workers' prefetch_factor in effect (a requested cap included; 0 without workers)."""
        return self.plan.prefetch_factor

    def request_prefetch_factor(self, prefetch_factor: int | None) -> None:
        """Cap the workers' prefetch_factor (None lifts the cap), effective from the next batch.

        A cap, never a raise above the plan: the loader stays within its host budget. The plan
        (:attr:`plan`, :attr:`prefetch_factor`) changes at once; a live iterator is rebuilt at
        the position the training loop reached, before it hands out its next batch.
        """
        if prefetch_factor is not None:
            check_int("prefetch_factor", prefetch_factor, at_least=1, fix="use 1 or more, or None")
        if not self._sizing.request_prefetch_factor(prefetch_factor, self._batch_bytes(),
                                                    self._pos.epoch):
            return
        self._device_prefetch_depth = self._fit_device_depth(self._device_prefetch_depth,
                                                             warn=True)
        self._loader_stale = self._restart_pending = True

    def stats(self) -> dict[str, Any]:
        """Data-wait totals, batches, bytes in flight (estimate), re-plans."""
        batch = self._batch_bytes()
        plan = self.plan
        workers = plan.num_workers * plan.prefetch_factor * batch * (2 if self._pin_memory else 1)
        has_stage = self.device is not None or plan.num_workers > 0
        stage = self._device_prefetch_depth * batch if has_stage else 0
        in_host = self._stage_in_host()
        watcher = self._watcher
        return {"epoch": self._pos.epoch, "batches_consumed": self.batches_consumed,
                **self._figures.to_dict(),
                "bytes_in_flight_estimate": workers + stage,
                "host_bytes_in_flight_estimate": workers + (stage if in_host else 0),
                "device_bytes_in_flight_estimate": 0 if in_host else stage,
                "host_budget_bytes": plan.budget_bytes,
                "num_workers": plan.num_workers, "prefetch_factor": plan.prefetch_factor,
                "device_prefetch_depth": self._device_prefetch_depth,
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

    @property
    def worker_memory_watcher(self) -> WorkerMemoryWatcher | None:
        return self._watcher

    def close(self) -> None:
        """Stop the workers and the memory watcher."""
        if self._watcher is not None:
            self._watcher.stop()
        self._generation += 1
        self._close_torch_loader()

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


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1
