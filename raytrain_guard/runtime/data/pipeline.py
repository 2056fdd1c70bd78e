"""The torch side of a GuardedDataLoader: the torch DataLoader it builds (so that
``prefetch_factor`` and ``persistent_workers`` are kept), its iterator with the worker
processes, and the stage that keeps batches ready ahead of the loop."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from raytrain_guard.log import warn_once
from raytrain_guard.planner.batches import map_tensors
from raytrain_guard.planner.dataloader_sizing import DataLoaderPlan
from raytrain_guard.runtime.data.device_prefetch import DevicePrefetcher, ThreadedPrefetcher

logger = logging.getLogger(__name__)


class WorkerPipeline:
    """A torch DataLoader over ``sampler``, rebuilt when the plan changes, and its stage: on
    CUDA a :class:`DevicePrefetcher` (side-stream copies; torch's pin-memory thread takes
    batches from the workers), elsewhere with workers a :class:`ThreadedPrefetcher` (a thread
    takes batches from the workers' queue, so the training thread does not pay the handoff)."""

    def __init__(self, dataset: Any, *, batch_size: int, sampler: Sampler, drop_last: bool,
                 collate_fn: Callable[[list], Any] | None, seed: int, persistent_workers: bool,
                 multiprocessing_context: Any, pin_memory: bool, device: Any) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = sampler
        self.drop_last = drop_last
        self.seed = seed
        self._collate_fn = collate_fn
        self._persistent_workers = persistent_workers
        self._mp_context = multiprocessing_context
        self.pin_memory = pin_memory
        self.device = device
        self.torch_loader: DataLoader | None = None
        self.torch_iter: Any = None
        self.stage: ThreadedPrefetcher | DevicePrefetcher | None = None

    def start(self, plan: DataLoaderPlan) -> None:
        """A new torch iterator (the sampler set by the caller); persistent workers are reused:
        torch resets their iterator."""
        self.torch_iter = iter(self.loader(plan))

    def loader(self, plan: DataLoaderPlan) -> DataLoader:
        """The torch DataLoader, built on first use (and after :meth:`close`) from ``plan``."""
        if self.torch_loader is not None:
            return self.torch_loader
        workers = plan.num_workers
        self.torch_loader = DataLoader(
            self.dataset, batch_size=self.batch_size, sampler=self.sampler,
            drop_last=self.drop_last, collate_fn=self._collate_fn, num_workers=workers,
            prefetch_factor=plan.prefetch_factor if workers else None,
            persistent_workers=self._persistent_workers and workers > 0,
            pin_memory=self.pin_memory,
            multiprocessing_context=self._mp_context if workers else None,
            generator=torch.Generator().manual_seed(self.seed))
        return self.torch_loader

    def open_stage(self, depth: int, *, thread: bool) -> Iterator[Any]:
        """The source of batches over the current iterator: a stage keeping ``depth`` ready
        (``thread``: the background thread), or the iterator itself."""
        device = self.device
        if thread:
            move = None
            if device is not None and device.type != "cpu":
                def move(batch: Any) -> Any:
                    return map_tensors(batch, lambda t: t.to(device))
            self.stage = ThreadedPrefetcher(self.torch_iter, depth, move)
        elif device is not None:
            self.stage = DevicePrefetcher(self.torch_iter, device, depth)
        else:
            self.stage = None
        return self.stage or self.torch_iter

    def close_stage(self) -> None:
        stage, self.stage = self.stage, None
        if isinstance(stage, ThreadedPrefetcher):
            stage.close()

    def close(self) -> None:
        """Stop the stage and the workers; the next :meth:`start` builds a new DataLoader."""
        self.close_stage()                      # first: its thread may be inside next(it)
        it, loader = self.torch_iter, self.torch_loader
        self.torch_iter = self.torch_loader = None
        if it is not None and loader is not None and loader.num_workers:
            _shutdown_workers(it)

    def worker_pids(self) -> tuple[int, ...]:
        """Process ids of the live workers (empty without workers)."""
        loader, it = self.torch_loader, self.torch_iter
        if loader is None or it is None or not loader.num_workers:
            return ()
        return _worker_pids(it)


def _shutdown_workers(it: Any) -> None:
    """Stop a torch DataLoader iterator's worker processes now. torch has no public call for
    it (its iterator's ``__del__`` calls the private ``_shutdown_workers``): call that where it
    exists, else drop the iterator and let garbage collection stop them (warned once)."""
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is None:
        warn_once(logger, "_shutdown_workers", "this torch's DataLoader iterator has no "
                  "_shutdown_workers: workers stop when the old iterator is garbage-collected")
        return
    try:
        shutdown()
    except Exception as exc:  # noqa: BLE001 - fail open
        logger.debug("shutting down DataLoader workers: %r", exc)


def _worker_pids(it: Any) -> tuple[int, ...]:
    """Process ids of a torch DataLoader iterator's workers. torch exposes them only as the
    private ``_workers``: without it (another torch), none, and the copy-on-read watch sees
    nothing (warned once)."""
    workers = getattr(it, "_workers", None)
    if workers is None:
        warn_once(logger, "_workers", "this torch's DataLoader iterator has no _workers: the "
                  "worker memory watch is off")
        return ()
    return tuple(w.pid for w in workers if w.pid is not None)
