"""The guarded DataLoader: sized from measured batches, sharded exactly once, resumable.

``GuardedDataLoader(dataset, batch_size)`` inside a Ray Train worker:

* shards with a DistributedSampler from the worker's rank and world size (see
  :mod:`raytrain_guard.runtime.sampler` for the exactly-once and padding contract) and calls
  ``set_epoch`` itself: iterating to the end of an epoch moves to the next one;
* measures the bytes of a real batch before any worker starts (``dataset[0..k-1]`` collated in
  this process, scaled to the batch size) and asks the planner rule
  (:func:`raytrain_guard.core.dataloader_sizing.size_dataloader`) for ``num_workers`` and
  ``prefetch_factor``; ``pin_memory`` on CUDA;
* builds the torch DataLoader itself, so ``prefetch_factor`` and ``persistent_workers`` are
  kept (Ray's ``prepare_data_loader`` drops both);
* times how long the training loop waits for each batch and counts the batch's bytes (two clock
  reads and one walk over the batch per step; no device synchronization);
* keeps ``device_prefetch_depth`` batches ready ahead of the training loop
  (:mod:`raytrain_guard.runtime.device_prefetch`): on CUDA already on the device (side
  stream; torch's pin-memory thread takes them from the workers); elsewhere, with workers, a
  background thread takes them from the workers' queue so the training thread does not pay
  the per-batch handoff (about 2 ms for a 4.6 MiB batch);
* re-plans ``num_workers``/``prefetch_factor`` at each epoch boundary from the largest batch it
  delivered and host pressure (psutil, cgroup-aware);
* applies a cap set by :meth:`request_prefetch_factor` at the next batch: the torch iterator is
  rebuilt at the position the training loop reached (nothing lost or repeated), and
  :attr:`plan` / :attr:`prefetch_factor` report the capped value at once;
* watches the workers' private memory on a background thread and warns once of copy-on-read
  (:mod:`raytrain_guard.runtime.worker_memory`).

Resuming: ``state_dict()`` holds the epoch and the position in the epoch's permutation
(``samples_consumed``, all ranks together); ``load_state_dict`` continues from there, skipping
the consumed indices in the sampler, never by loading batches. Breaking out of a loop and
iterating again also continues the epoch where the loop stopped. The position counts batches
delivered to the training loop, never batches fetched ahead: those are dropped and fetched
again whenever the iterator is rebuilt.

Errors are raised in ``__init__`` where possible (empty dataset, samples of different type or
shape, one batch over the host budget), from figures every rank computes alike, so every rank
raises the same error before any collective.
"""

from __future__ import annotations

import dataclasses
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
from raytrain_guard.core.dataloader_sizing import DataLoaderPlan, size_dataloader
from raytrain_guard.errors import InputError, PlanInputError
from raytrain_guard.host_memory import host_memory, read_cgroup_memory, within_cgroup  # noqa: F401
from raytrain_guard.runtime.batches import batch_nbytes, batch_signature, map_tensors
from raytrain_guard.runtime.context import current_context
from raytrain_guard.runtime.device_prefetch import DevicePrefetcher, ThreadedPrefetcher
from raytrain_guard.runtime.sampler import ResumableDistributedSampler
from raytrain_guard.runtime.timing import BEGUN_BY_LOADER, DATA_SLOT, NOT_BEGUN, UNTIMED
from raytrain_guard.runtime.worker_memory import WorkerMemoryWatcher
from raytrain_guard.units import format_bytes

logger = logging.getLogger(__name__)

_NUM_CHECKED_BATCHES = 3          # delivered batches whose signature is compared to the probe's
_COLLATE_ERRORS = ("stack expects each tensor to be equal size",
                   "each element in list of batch should be of equal size",
                   "Trying to resize storage that is not resizable")   # in a worker (shm)

HostProbe = Callable[[], "tuple[int, int]"]   # () -> (total bytes, available bytes)


# The cgroup-aware host reading lives in raytrain_guard.host_memory (shared with the probes,
# the node monitor and the CLI); these names stay importable from here.
psutil_host_memory = host_memory


class GuardedDataLoader:
    """A DataLoader for one training process, sized, sharded and watched by the guard."""

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
        _check_int("batch_size", batch_size, 1, "pass the per-rank micro-batch size, e.g. 32")
        _check_int("device_prefetch_depth", device_prefetch_depth, 0, "use 0 (off), 1 or 2")
        if num_workers is not None:
            _check_int("num_workers", num_workers, 0, "use None to let the guard size it")
        if prefetch_factor is not None:
            _check_int("prefetch_factor", prefetch_factor, 1, "use None to let the guard size it")
        num_samples = _dataset_len(dataset)
        ctx = None
        if world_rank is None or world_size is None or gpus_per_node is None:
            ctx = current_context()
        self.world_size = ctx.world_size if world_size is None else world_size
        self.world_rank = ctx.world_rank if world_rank is None else world_rank
        _check_int("world_size", self.world_size, 1, "pass the number of data-parallel ranks")
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
        self._user_num_workers = num_workers
        self._user_prefetch_factor = prefetch_factor
        self._persistent_workers = bool(persistent_workers)
        self._mp_context = multiprocessing_context
        self._host_memory_bytes = host_memory_bytes
        self._host_probe = host_memory_probe or psutil_host_memory
        self._gpus_per_node = gpus_per_node if gpus_per_node is not None else max(
            1, ctx.local_world_size)
        self._cpus_per_node = cpus_per_node if cpus_per_node is not None else _cpu_count()
        self.device = torch.device(device) if device is not None else None
        self._pin_memory = (self.device is not None and self.device.type == "cuda"
                            and torch.cuda.is_available())

        # Measure a real batch and check the samples agree, before any worker exists.
        self._probe_signature, self.probe_batch_bytes = self._probe_batch()
        self._list_backed = is_list_backed(dataset, min_items=config.list_dataset_min_items)
        self._requested_prefetch: int | None = None
        self._max_batch_bytes = 0
        self._last_planned_batch_bytes = self.probe_batch_bytes
        self.plan = self._make_plan(self.probe_batch_bytes)   # raises PlanInputError if too big
        self._device_prefetch_depth = self._fit_device_depth(device_prefetch_depth, warn=False)

        self._sampler = ResumableDistributedSampler(
            dataset, num_replicas=self.world_size, rank=self.world_rank, shuffle=self.shuffle,
            seed=self.seed, drop_last=self.drop_last)
        if len(self) == 0:
            raise InputError("batch_size", f"leaves no batch: {num_samples} samples over "
                             f"{self.world_size} ranks with drop_last give each rank fewer than "
                             f"{batch_size}", value=batch_size,
                             fix="use a smaller batch_size, or drop_last=False")
        self._torch_loader: DataLoader | None = None
        self._torch_iter: Any = None
        self._stage: ThreadedPrefetcher | DevicePrefetcher | None = None
        self._restart_pending = False   # the live iterator restarts at the delivered position
        self._loader_stale = False      # the plan changed: the torch DataLoader is rebuilt
        self._generation = 0
        # position in the epoch's permutation before the current iterator; batches since then
        self._epoch = 0
        self._position = 0
        self._batches_base = 0
        self._batches_in_iter = 0
        self._epoch_started = False
        # per-step figures
        self.last_data_wait_s = 0.0
        self.last_batch_bytes = 0
        self._wait_total_s = 0.0
        self._wait_max_s = 0.0
        self._wall_total_s = 0.0
        self._num_batches = 0
        self._num_checked = 0
        self._replans = 0
        self._step_timer: Any = None    # the StepTimer whose steps this loader opens
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
    def _probe_batch(self) -> tuple[Any, int]:
        """Collate dataset[0..k-1] here: (signature, bytes scaled to one full batch)."""
        k = min(self.config.loader_probe_samples, self.batch_size, self.num_samples)
        measured = measure_dataset(self.dataset, num_samples=k, collate=self._collate_fn,
                                   config=self.config, field="dataset", error=InputError,
                                   require_bytes=False)
        nbytes = math.ceil(measured.batch_bytes * self.batch_size / k)
        return measured.signature, max(1, nbytes)

    def _host_for_plan(self) -> tuple[int, str]:
        """Host bytes the rule divides: total RAM, or what is available under pressure."""
        if self._host_memory_bytes is not None:
            return int(self._host_memory_bytes), ""
        try:
            total, available = self._host_probe()
        except Exception as exc:  # noqa: BLE001 - fail open: plan from the last known figure
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
                               num_workers=self._user_num_workers,
                               prefetch_factor=self._user_prefetch_factor,
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
            logger.warning("rank %d: %s", self.world_rank, plan.reason)
            return plan

    def _fit_device_depth(self, depth: int, *, warn: bool) -> int:
        """Clamp the device-prefetch depth to the host budget when its batches are host memory."""
        if not self._stage_in_host():
            return depth
        room = self.plan.budget_bytes - self.plan.host_bytes
        fits = max(0, room // max(1, self._batch_bytes()))
        if depth <= fits:
            return depth
        log = logger.warning if warn else logger.info
        log("rank %d: device_prefetch_depth %d lowered to %d: on %s its batches are host memory "
            "and only %s of the %s budget is left", self.world_rank, depth, fits, self.device,
            format_bytes(room), format_bytes(self.plan.budget_bytes))
        return int(fits)

    def _batch_bytes(self) -> int:
        """The largest batch delivered this epoch, else the figure of the last plan."""
        return self._max_batch_bytes or self._last_planned_batch_bytes

    def _replan(self) -> None:
        """At an epoch boundary: re-size from the largest batch of the epoch and host pressure."""
        measured = self._batch_bytes()
        self._max_batch_bytes = 0                      # the next epoch measures afresh
        plan = self._plan_or_keep(measured)
        changed = (plan.num_workers, plan.prefetch_factor) != (self.plan.num_workers,
                                                               self.plan.prefetch_factor)
        self.plan = plan
        self._last_planned_batch_bytes = measured
        self._device_prefetch_depth = self._fit_device_depth(self._device_prefetch_depth,
                                                             warn=True)
        if changed:
            self._replans += 1
            logger.info("rank %d epoch %d: re-planned DataLoader: %s", self.world_rank,
                        self._epoch, plan.reason)
            self._close_torch_loader()

    # -- the torch DataLoader -------------------------------------------------------------------
    def _build_torch_loader(self) -> DataLoader:
        workers = self.plan.num_workers
        return DataLoader(
            self.dataset, batch_size=self.batch_size, sampler=self._sampler,
            drop_last=self.drop_last, collate_fn=self._collate_fn, num_workers=workers,
            prefetch_factor=self.plan.prefetch_factor if workers else None,
            persistent_workers=self._persistent_workers and workers > 0,
            pin_memory=self._pin_memory, multiprocessing_context=self._mp_context if workers
            else None, generator=torch.Generator().manual_seed(self.seed))

    def _close_torch_loader(self) -> None:
        self._close_stage()                     # first: its thread may be inside next(it)
        it, self._torch_iter, self._torch_loader = self._torch_iter, None, None
        self._loader_stale = False
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception as exc:  # noqa: BLE001 - fail open
                logger.debug("shutting down DataLoader workers: %r", exc)

    @property
    def torch_loader(self) -> DataLoader:
        """The underlying torch DataLoader (built on first use, rebuilt by a re-plan)."""
        if self._torch_loader is None:
            self._torch_loader = self._build_torch_loader()
        return self._torch_loader

    def worker_pids(self) -> tuple[int, ...]:
        """Process ids of the live DataLoader workers (empty without workers)."""
        workers = getattr(self._torch_iter, "_workers", None) or ()
        return tuple(w.pid for w in workers if w.pid is not None)

    # -- iteration ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        self._close_stage()               # an earlier iterator's thread stops before the reset
        self._position = self._current_position()
        self._batches_base += self._batches_in_iter
        self._batches_in_iter = 0
        if self._position >= self.num_samples or self._batches_left(self._position) == 0:
            self._finish_epoch()
        if self._position == 0 and self._batches_base == 0 and self._epoch_started:
            self._replan()
        self._epoch_started = True
        if self._loader_stale:
            self._close_torch_loader()
        self._restart_pending = False
        self._generation += 1
        self._start_torch_iter()
        return self._batches(self._generation)

    def _start_torch_iter(self) -> None:
        """The torch iterator from ``self._position`` of the current epoch (persistent workers
        are reused: torch resets their iterator and drops what they had fetched)."""
        self._sampler.set_epoch(self._epoch)
        self._sampler.set_start(self._position)
        self._torch_iter = iter(self.torch_loader)

    def _stage_in_host(self) -> bool:
        """Batches kept ahead are host memory: no CUDA stage, and workers or a device stage."""
        return not self._pin_memory and (self.device is not None or self.plan.num_workers > 0)

    def _wants_thread(self) -> bool:
        """Batches from worker processes, not on CUDA (there torch's pin-memory thread takes
        them from the workers), and batches to keep ahead."""
        return not self._pin_memory and self.plan.num_workers > 0 \
            and self._device_prefetch_depth > 0

    def _open_stage(self) -> tuple[Iterator[Any], Any]:
        """(source of batches, stage or None) over the current torch iterator."""
        depth, device = self._device_prefetch_depth, self.device
        if self._wants_thread():
            move = None
            if device is not None and device.type != "cpu":
                def move(batch: Any) -> Any:
                    return map_tensors(batch, lambda t: t.to(device))
            self._stage = ThreadedPrefetcher(self._torch_iter, depth, move)
        elif device is not None:
            self._stage = DevicePrefetcher(self._torch_iter, device, depth)
        else:
            self._stage = None
        return self._stage or self._torch_iter, self._stage

    def _close_stage(self) -> None:
        stage, self._stage = self._stage, None
        if isinstance(stage, ThreadedPrefetcher):
            stage.close()

    def _restart(self) -> tuple[Iterator[Any], Any]:
        """Rebuild the torch iterator at the position the training loop reached (batches
        fetched ahead and not delivered are fetched again): how a new plan takes effect
        mid-epoch."""
        self._close_stage()
        self._position = self._current_position()
        self._batches_base += self._batches_in_iter
        self._batches_in_iter = 0
        self._restart_pending = False
        if self._loader_stale:
            self._close_torch_loader()
        if self._batches_left(self._position) == 0:
            return iter(()), None              # the epoch was delivered: it ends here
        self._start_torch_iter()
        logger.info("rank %d epoch %d: DataLoader restarted at sample %d with %d workers x "
                    "prefetch_factor %d", self.world_rank, self._epoch, self._position,
                    self.plan.num_workers, self.plan.prefetch_factor)
        return self._open_stage()

    def time_steps(self, timer: Any) -> bool:
        """Stamp ``timer``'s steps from now on (the next iterator on): open a step nobody began
        where the loop starts fetching its first batch, and end the ``data`` phase where each
        batch arrives (see :meth:`StepTimer.loader_stamps`). Returns whether it will: a host
        timer must be on this loader's clock (a timer of CUDA events records its own); None
        stops. Usually called through :meth:`StepGuard.attach_loader`."""
        if timer is not None and not timer.loader_stamps(self._clock):
            return False
        self._step_timer = timer
        return timer is not None

    def _batches(self, generation: int) -> Iterator[Any]:
        clock = self._clock
        timer = self._step_timer
        on_host = timer is not None and timer.on_host
        source, stage = self._open_stage()
        last = clock()
        try:
            while generation == self._generation:
                if self._restart_pending:
                    source, stage = self._restart()
                elif stage is not None and stage.depth != self._device_prefetch_depth:
                    stage.set_depth(self._device_prefetch_depth)
                if timer is None:
                    t0 = clock()
                else:
                    # StepTimer.begin_step and mark("data"), inline on a host timer (see
                    # time_steps); a timer of CUDA events records its own
                    record = timer._record
                    if record.step == NOT_BEGUN and len(record.marks) == 1:
                        if timer.before_step is not None:
                            timer.before_step()      # the guard's pacing sleep
                        t0 = clock()
                        if on_host:
                            record.marks[0] = (UNTIMED, t0)
                            record.step = BEGUN_BY_LOADER
                        else:
                            timer.begin_step(BEGUN_BY_LOADER)
                    else:
                        t0 = clock()
                try:
                    batch = next(source)
                except StopIteration:
                    self._finish_epoch()
                    return
                except RuntimeError as exc:
                    if any(text in str(exc) for text in _COLLATE_ERRORS):
                        raise InputError("dataset", "samples of different shapes in one batch",
                                         value=type(self.dataset).__name__,
                                         fix=SAME_SHAPE_FIX) from exc
                    raise
                now = clock()
                if timer is not None:
                    if on_host:
                        record.marks.append((DATA_SLOT, now))
                    else:
                        timer.mark("data")
                wait = now - t0
                nbytes = batch_nbytes(batch)
                self.last_data_wait_s = wait
                self.last_batch_bytes = nbytes
                if nbytes > self._max_batch_bytes:
                    self._max_batch_bytes = nbytes
                self._wait_total_s += wait
                if wait > self._wait_max_s:
                    self._wait_max_s = wait
                self._wall_total_s += now - last
                last = now
                self._num_batches += 1
                if self._num_checked < _NUM_CHECKED_BATCHES:
                    self._check_batch(batch)
                self._batches_in_iter += 1
                if self._batches_in_iter == 1 and self._watcher is not None \
                        and self.plan.num_workers:
                    self._watcher.start()   # after the first batch: workers are past start-up
                yield batch
                # the training loop owns the batch now: when it is freed (unmapping its shared
                # memory) is the loop's cost, not a wait for data
                del batch
        finally:
            if stage is not None and self._stage is stage:
                self._close_stage()

    def _check_batch(self, batch: Any) -> None:
        self._num_checked += 1
        sig = batch_signature(batch, shapes=self._collate_fn is None)
        if sig != self._probe_signature:
            raise InputError("dataset", f"batch {self._num_checked - 1} differs in type or shape "
                             f"from the first samples: {sig} vs {self._probe_signature}",
                             value=type(self.dataset).__name__, fix=SAME_SHAPE_FIX)

    def _finish_epoch(self) -> None:
        self._epoch += 1
        self._position = 0
        self._batches_base = 0
        self._batches_in_iter = 0

    def _batches_left(self, position: int) -> int:
        """Batches this rank still delivers in the current epoch from ``position``."""
        self._sampler.set_start(position)
        n = len(self._sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _current_position(self) -> int:
        consumed = self._batches_in_iter * self.batch_size * self.world_size
        return min(self.num_samples, self._position + consumed)

    def __len__(self) -> int:
        """Batches of a whole epoch on this rank."""
        per_rank = (self.num_samples // self.world_size if self.drop_last
                    else -(-self.num_samples // self.world_size))
        return per_rank // self.batch_size if self.drop_last else -(-per_rank // self.batch_size)

    # -- epoch and resume -----------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def batches_consumed(self) -> int:
        """Batches this rank has delivered in the current epoch (resumed ones included)."""
        return self._batches_base + self._batches_in_iter

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; a no-op for the current epoch (keeps a resume)."""
        _check_int("epoch", epoch, 0, "pass the epoch number, from 0")
        if epoch == self._epoch:
            return
        self._generation += 1           # a live iterator of the old epoch stops
        self._close_stage()
        self._epoch = epoch
        self._position = 0
        self._batches_base = 0
        self._batches_in_iter = 0

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands: enough to continue with no sample lost or repeated."""
        return {"epoch": self._epoch, "batches_consumed": self.batches_consumed,
                "samples_consumed": self._current_position(), "seed": self.seed,
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
        self._sampler.drop_last = self.drop_last
        position = state.get("samples_consumed")
        if position is None:
            position = (int(state["batches_consumed"]) * int(state.get("batch_size", self.batch_size))
                        * int(state.get("world_size", self.world_size)))
        self._generation += 1
        self._close_stage()
        self._epoch = int(state["epoch"])
        self._position = min(self.num_samples, int(position))
        self._batches_base = int(state["batches_consumed"])
        self._batches_in_iter = 0
        self._epoch_started = True

    # -- run-time controls ----------------------------------------------------------------------
    def set_device_prefetch_depth(self, depth: int) -> int:
        """Keep ``depth`` batches ready from the next batch on; returns the depth applied
        (lowered to what the host budget leaves when those batches are host memory)."""
        _check_int("device_prefetch_depth", depth, 0, "use 0 (off), 1 or 2")
        self._device_prefetch_depth = self._fit_device_depth(depth, warn=True)
        if self._stage is not None and \
                isinstance(self._stage, ThreadedPrefetcher) != self._wants_thread():
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
            _check_int("prefetch_factor", prefetch_factor, 1, "use 1 or more, or None")
        self._requested_prefetch = prefetch_factor
        plan = self._plan_or_keep(self._batch_bytes())
        changed = (plan.num_workers, plan.prefetch_factor) != (self.plan.num_workers,
                                                               self.plan.prefetch_factor)
        self.plan = plan
        if not changed:
            return
        self._replans += 1
        self._device_prefetch_depth = self._fit_device_depth(self._device_prefetch_depth,
                                                             warn=True)
        self._loader_stale = self._restart_pending = True
        logger.info("rank %d epoch %d: re-planned DataLoader on request: %s", self.world_rank,
                    self._epoch, plan.reason)

    def stats(self) -> dict[str, Any]:
        """Data-wait totals, batches, bytes in flight (estimate), re-plans."""
        batch = self._batch_bytes()
        workers = self.plan.num_workers * self.plan.prefetch_factor * batch * (
            2 if self._pin_memory else 1)
        has_stage = self.device is not None or self.plan.num_workers > 0
        stage = self._device_prefetch_depth * batch if has_stage else 0
        in_host = self._stage_in_host()
        host = workers + (stage if in_host else 0)
        watcher = self._watcher
        return {"epoch": self._epoch, "batches_consumed": self.batches_consumed,
                "batches": self._num_batches, "last_data_wait_s": self.last_data_wait_s,
                "data_wait_total_s": self._wait_total_s, "data_wait_max_s": self._wait_max_s,
                "wall_total_s": self._wall_total_s,
                "data_wait_frac": self._wait_total_s / self._wall_total_s
                if self._wall_total_s > 0 else 0.0,
                "last_batch_bytes": self.last_batch_bytes, "max_batch_bytes": self._max_batch_bytes,
                "bytes_in_flight_estimate": workers + stage, "host_bytes_in_flight_estimate": host,
                "device_bytes_in_flight_estimate": 0 if in_host else stage,
                "host_budget_bytes": self.plan.budget_bytes,
                "num_workers": self.plan.num_workers, "prefetch_factor": self.plan.prefetch_factor,
                "device_prefetch_depth": self._device_prefetch_depth, "replans": self._replans,
                "worker_private_bytes": watcher.last_private_bytes if watcher else 0,
                "copy_on_read_warned": bool(watcher and watcher.warned)}

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


def _check_int(name: str, value: Any, lo: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise InputError(name, f"must be an integer >= {lo}", value=value, fix=fix)


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
