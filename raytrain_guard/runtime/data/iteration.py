"""How a GuardedDataLoader hands out batches: an iterator from the position the loop reached,
each fetch timed as the loop's data wait, the torch iterator rebuilt mid-epoch when the plan
changes, and the first batches checked against the probed samples' types and shapes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from raytrain_guard.errors import InputError
from raytrain_guard.planner.batch_inspect import SAME_SHAPE_FIX
from raytrain_guard.planner.batches import batch_nbytes, batch_signature
from raytrain_guard.runtime.data.device_prefetch import ThreadedPrefetcher
from raytrain_guard.runtime.data.figures import DataWaitFigures
from raytrain_guard.runtime.data.pipeline import WorkerPipeline
from raytrain_guard.runtime.data.resume import EpochPosition
from raytrain_guard.runtime.data.sampler import ResumableDistributedSampler
from raytrain_guard.runtime.data.sizing import LoaderSizing
from raytrain_guard.runtime.data.worker_memory import WorkerMemoryWatcher

logger = logging.getLogger(__name__)

_NUM_CHECKED_BATCHES = 3          # delivered batches whose signature is compared to the probe's
_COLLATE_ERRORS = ("stack expects each tensor to be equal size",
                   "each element in list of batch should be of equal size",
                   "Trying to resize storage that is not resizable")   # in a worker (shm)


class LoaderIteration:
    """The iterators of one loader over its ``pipeline``. Each new iterator (or :meth:`stop`)
    starts a generation; a live iterator of an older one stops. ``steps`` (set by
    :meth:`GuardedDataLoader.time_steps`) opens each step before a fetch and ends its data
    phase when the batch is there."""

    def __init__(self, *, pipeline: WorkerPipeline, sampler: ResumableDistributedSampler,
                 pos: EpochPosition, sizing: LoaderSizing, figures: DataWaitFigures,
                 watcher: WorkerMemoryWatcher | None, clock: Callable[[], float],
                 probe_signature: Any, check_shapes: bool, dataset_name: str,
                 world_rank: int) -> None:
        self._pipeline = pipeline
        self._sampler = sampler
        self._pos = pos
        self._sizing = sizing
        self._figures = figures
        self._watcher = watcher
        self._clock = clock
        self._probe_signature = probe_signature
        self._check_shapes = check_shapes
        self._dataset_name = dataset_name
        self._world_rank = world_rank
        self.steps: Any = None
        self._restart_pending = False   # the live iterator restarts at the delivered position
        self._loader_stale = False      # the plan changed: the torch DataLoader is rebuilt
        self._generation = 0
        self._num_checked = 0

    def begin(self) -> Iterator[Any]:
        """A new iterator from where the loop is: the next epoch once this one is delivered,
        re-planned at the start of every epoch after the first."""
        pos = self._pos
        self._pipeline.close_stage()      # an earlier iterator's thread stops before the reset
        pos.rebase()
        if pos.start >= pos.num_samples or self.batches_left(pos.start) == 0:
            pos.move_to(pos.epoch + 1)
        if pos.start == 0 and pos.batches_before == 0 and pos.started \
                and self._sizing.replan(pos.epoch):
            self.close_torch_loader()
        pos.started = True
        if self._loader_stale:
            self.close_torch_loader()
        self._restart_pending = False
        self._generation += 1
        self._start_torch_iter()
        return self._batches(self._generation)

    def rebuild(self) -> None:
        """The plan changed: rebuild the torch DataLoader before the next batch, at the
        position the loop reached."""
        self._loader_stale = self._restart_pending = True

    def match_stage(self) -> None:
        """After a depth change: a live stage keeps the new depth from the next batch on, or,
        of the other kind (thread or none), is replaced before it."""
        stage = self._pipeline.stage
        if stage is None:
            return
        if isinstance(stage, ThreadedPrefetcher) != self._sizing.wants_thread():
            self._restart_pending = True
        else:
            stage.set_depth(self._sizing.device_prefetch_depth)

    def stop(self) -> None:
        """A live iterator stops (the position moves elsewhere)."""
        self._generation += 1
        self._pipeline.close_stage()

    def close(self) -> None:
        """A live iterator stops, and the workers with it."""
        self._generation += 1
        self.close_torch_loader()

    def close_torch_loader(self) -> None:
        self._pipeline.close()
        self._loader_stale = False

    def batches_left(self, position: int) -> int:
        """Batches this rank still delivers in the current epoch from ``position``."""
        self._sampler.set_start(position)
        n, size = len(self._sampler), self._pipeline.batch_size
        return n // size if self._pipeline.drop_last else -(-n // size)

    def _start_torch_iter(self) -> None:
        """The torch iterator from the current position of the current epoch."""
        self._sampler.set_epoch(self._pos.epoch)
        self._sampler.set_start(self._pos.start)
        self._pipeline.start(self._sizing.plan)

    def _open_stage(self) -> Iterator[Any]:
        return self._pipeline.open_stage(self._sizing.device_prefetch_depth,
                                         thread=self._sizing.wants_thread())

    def _restart(self) -> Iterator[Any]:
        """Rebuild the torch iterator at the position the training loop reached (batches
        fetched ahead and not delivered are fetched again): how a new plan takes effect
        mid-epoch."""
        pos = self._pos
        self._pipeline.close_stage()
        pos.rebase()
        self._restart_pending = False
        if self._loader_stale:
            self.close_torch_loader()
        if self.batches_left(pos.start) == 0:
            return iter(())                    # the epoch was delivered: it ends here
        self._start_torch_iter()
        plan = self._sizing.plan
        logger.info("rank %d epoch %d: DataLoader restarted at sample %d with %d workers x "
                    "prefetch_factor %d", self._world_rank, pos.epoch, pos.start,
                    plan.num_workers, plan.prefetch_factor)
        return self._open_stage()

    def _batches(self, generation: int) -> Iterator[Any]:
        clock, steps, figures, pos = self._clock, self.steps, self._figures, self._pos
        source = self._open_stage()
        last = clock()
        try:
            while generation == self._generation:
                if self._restart_pending:
                    source = self._restart()
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
                                         value=self._dataset_name, fix=SAME_SHAPE_FIX) from exc
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
                        and self._sizing.plan.num_workers:
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
        sig = batch_signature(batch, shapes=self._check_shapes)
        if sig != self._probe_signature:
            raise InputError("dataset", f"batch {self._num_checked - 1} differs in type or shape "
                             f"from the first samples: {sig} vs {self._probe_signature}",
                             value=self._dataset_name, fix=SAME_SHAPE_FIX)
