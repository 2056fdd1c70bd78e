"""The batch layout of the shared train loop: micro-batch, accumulation and the loader that
delivers them. Every change (a shrink, a resume on another world size, more loader workers)
keeps the global batch and the position in the epoch's permutation, so every sample is consumed
once."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

from raytrain_guard.errors import InputError, check_int
from raytrain_guard.runtime.data.loader import GuardedDataLoader
from raytrain_guard.runtime.loop.config import LoopConfig

logger = logging.getLogger(__name__)


def shrink_verdict(micro_batch: int, grad_accum: int, params: Mapping[str, Any], *,
                   samples_per_rank: int) -> tuple[int, int] | str:
    """``(new micro_batch, new grad_accum)`` of a SHRINK_MICRO_BATCH, or why it is refused:
    both positive integers, the new micro-batch smaller and dividing the old one, the global
    batch kept and an epoch of ``samples_per_rank`` holding ``new_ga`` micro-batches. Pure:
    every rank computes the same verdict."""
    try:
        mb, ga = (check_int(f"params[{name!r}]", params.get(name), at_least=1,
                            fix="a shrink carries the new micro_batch and grad_accum")
                  for name in ("micro_batch", "grad_accum"))
    except InputError as err:
        return str(err)
    if mb >= micro_batch:
        return f"micro_batch {mb} is not smaller than the current {micro_batch}"
    if micro_batch % mb:
        return (f"micro_batch {mb} does not divide the current {micro_batch}, so its "
                f"micro-batches would not tile the old ones")
    if mb * ga != micro_batch * grad_accum:
        return (f"micro_batch {mb} x grad_accum {ga} = {mb * ga} samples per rank and step, not "
                f"the current {micro_batch} x {grad_accum} = {micro_batch * grad_accum}: the "
                f"global batch (and so the mathematics) would change")
    per_epoch = -(-samples_per_rank // mb)
    if ga > per_epoch:
        return (f"grad_accum {ga} exceeds the {per_epoch} micro-batches of {mb} in an epoch "
                f"of {samples_per_rank} samples per rank")
    return mb, ga


def relayout(global_batch: int, world_size: int, micro_batch: int) -> tuple[int, int] | None:
    """``(micro_batch, grad_accum)`` that keep ``global_batch`` on ``world_size`` ranks: the
    largest micro-batch up to ``micro_batch`` (the one the plan fits) that divides a rank's
    share; None when the ranks cannot share it evenly (pure)."""
    if global_batch % world_size:
        return None
    per_rank = global_batch // world_size
    mb = max(d for d in range(1, min(micro_batch, per_rank) + 1) if per_rank % d == 0)
    return mb, per_rank // mb


class BatchLayout:
    """One rank's :attr:`loader`, :attr:`micro_batch` x :attr:`grad_accum`,
    :attr:`steps_per_epoch`, the run's :attr:`total_steps`, and :attr:`changes` (applied and
    refused: the results' ``batch_changes``). With ``global_batch`` the first layout is that of
    the global batch on this many ranks (:func:`relayout`): any size of an elastic range trains
    the same steps."""

    def __init__(self, config: LoopConfig, dataset: Any, *, world_rank: int, world_size: int,
                 device: Any) -> None:
        self.config = config
        self.rank, self.world_size, self.device = world_rank, world_size, device
        self.micro_batch, self.grad_accum = config.micro_batch, config.grad_accum
        if config.global_batch is not None:
            layout = relayout(config.global_batch, world_size, config.micro_batch)
            if layout is None:
                raise InputError(
                    "global_batch", f"{config.global_batch} samples cannot be shared evenly by "
                    f"{world_size} workers", value=config.global_batch,
                    fix="use a global batch that every worker count the run may have divides "
                        "(e.g. a multiple of the least common multiple of min..max)")
            self.micro_batch, self.grad_accum = layout
        self.changes: list[dict[str, Any]] = []
        self.requested_prefetch: int | None = None     # the last SET_PREFETCH cap, kept
        self.loader = self.new_loader(self.micro_batch, dataset=dataset)
        self.steps_per_epoch = self._steps_per_epoch(self.loader, self.grad_accum)
        if self.steps_per_epoch == 0 or self.grad_accum > len(self.loader):
            raise InputError("grad_accum", f"exceeds the {len(self.loader)} micro-batches of "
                             f"an epoch on each rank", value=config.grad_accum,
                             fix="use a smaller grad_accum or micro_batch, or more data")
        self.total_steps = self._total_steps()

    @property
    def samples_per_rank(self) -> int:
        """The samples of an epoch on every rank (the sampler pads to the same count)."""
        return -(-self.loader.num_samples // self.world_size)

    def new_loader(self, micro_batch: int, *, num_workers: int | None = None,
                   dataset: Any = None) -> GuardedDataLoader:
        """A loader of ``micro_batch``; without ``dataset``, at the current loader's position,
        prefetch depth and requested prefetch cap."""
        old = None if dataset is not None else self.loader
        cfg = self.config
        new = GuardedDataLoader(
            dataset if old is None else old.dataset, micro_batch, shuffle=True, seed=cfg.seed,
            config=cfg.guard, world_rank=self.rank, world_size=self.world_size,
            device=self.device, num_workers=cfg.num_workers if num_workers is None
            else num_workers)
        if old is None:
            return new
        try:
            new.load_state_dict(old.state_dict())
            if new.device_prefetch_depth != old.device_prefetch_depth:
                new.set_device_prefetch_depth(old.device_prefetch_depth)
            if self.requested_prefetch is not None:
                new.request_prefetch_factor(self.requested_prefetch)
        except Exception:
            new.close()
            raise
        return new

    def replace(self, new: GuardedDataLoader, micro_batch: int, grad_accum: int) -> None:
        """Read from ``new`` from the next step on (the old loader's iterator ends,
        :meth:`micro_batches` goes on with the new one)."""
        self.loader.close()
        self.loader = new
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        steps_per_epoch = self._steps_per_epoch(new, grad_accum)
        if steps_per_epoch != self.steps_per_epoch:
            logger.warning("rank %d: %d steps per epoch with micro_batch %d x grad_accum %d "
                           "(was %d: the epoch's last partial micro-batch splits differently); "
                           "the run keeps its %d steps", self.rank, steps_per_epoch,
                           micro_batch, grad_accum, self.steps_per_epoch, self.total_steps)
        self.steps_per_epoch = steps_per_epoch

    def micro_batches(self) -> Iterator[Any]:
        """Micro-batches across epochs (the loader moves to the next epoch by itself); after a
        :meth:`replace`, from the new loader at the position the old one reached."""
        delivered = True
        while delivered:
            delivered = False
            for batch in self.loader:
                delivered = True
                yield batch

    def step_weights(self, micro_batches: Iterator[Any]) -> list[float]:
        """Each micro-batch's share of the next step's samples (the step's loss is the mean over
        its samples): ``grad_accum`` micro-batches, fewer at an epoch's end (with ``epoch_tail=
        "drop"`` those are read and skipped). A rank holds ``ceil(N / world_size)`` samples an
        epoch (the sampler pads), the last micro-batch shorter."""
        loader, mb = self.loader, self.micro_batch
        per_epoch = len(loader)
        # the position in samples of all ranks: right also after a resume on another layout
        position = -(-loader.samples_consumed // (mb * self.world_size)) % per_epoch \
            if per_epoch else 0
        left = per_epoch - position
        if left < self.grad_accum and self.config.epoch_tail == "drop":
            for _ in range(left):
                next(micro_batches)
            position, left = 0, per_epoch
        per_rank = -(-loader.num_samples // self.world_size)
        sizes = [max(0, min(mb, per_rank - (position + j) * mb))
                 for j in range(min(self.grad_accum, left))]
        total = sum(sizes) or 1
        return [size / total for size in sizes]

    def resume(self, saved: Mapping[str, Any] | None, saved_world: int) -> None:
        """The checkpoint's layout (``saved``) when it keeps this config's global batch, else the
        config's (a warning). On another world size the checkpoint's global batch is laid out
        again (:func:`relayout`), or the resume is refused unless
        ``allow_global_batch_change``."""
        mb, ga = self.micro_batch, self.grad_accum
        if saved:
            self.changes = [dict(c) for c in saved.get("changes", ())]
            mb, ga = int(saved["micro_batch"]), int(saved["grad_accum"])
        if saved_world != self.world_size:
            self.resume_on_other_world(mb, ga, saved_world)
        elif mb * ga != self.micro_batch * self.grad_accum:
            logger.warning("rank %d: checkpoint ran with micro_batch %d x grad_accum %d, this "
                           "config asks %d x %d (another global batch): keeping the config's",
                           self.rank, mb, ga, self.micro_batch, self.grad_accum)
        elif (mb, ga) != (self.micro_batch, self.grad_accum):
            logger.info("rank %d: resuming with the checkpoint's micro_batch %d and grad_accum "
                        "%d (config: %d and %d)", self.rank, mb, ga, self.micro_batch,
                        self.grad_accum)
            self.replace(self.new_loader(mb), mb, ga)

    def resume_on_other_world(self, mb: int, ga: int, saved_world: int) -> None:
        global_batch = mb * ga * saved_world
        layout = relayout(global_batch, self.world_size, self._micro_batch_cap())
        changed = layout is None
        if changed:
            if not self.config.allow_global_batch_change:
                raise InputError(
                    "world_size", f"resumed on {self.world_size} workers, but the checkpoint's "
                    f"global batch {global_batch} (micro_batch {mb} x grad_accum {ga} x "
                    f"{saved_world} workers) is no multiple of {self.world_size}",
                    value=self.world_size, fix="resume on a number of workers that divides "
                    "it, or set allow_global_batch_change=True to accept another global batch")
            layout = (mb, max(1, round(global_batch / (mb * self.world_size))))
        new_mb, new_ga = layout
        now = new_mb * new_ga * self.world_size
        reason = (f"resumed on {self.world_size} workers (checkpoint: {saved_world}): "
                  f"micro_batch {new_mb} x grad_accum {new_ga} " +
                  (f"changes the global batch from {global_batch} to {now} "
                   "(allow_global_batch_change)" if changed
                   else f"keeps the global batch {global_batch}"))
        (logger.warning if changed else logger.info)("rank %d: %s", self.rank, reason)
        self.changes.append({"step": None, "kind": "world_size", "from_world_size": saved_world,
                             "world_size": self.world_size, "from_micro_batch": mb,
                             "from_grad_accum": ga, "micro_batch": new_mb, "grad_accum": new_ga,
                             "applied": True, "global_batch": now, "reason": reason})
        if (new_mb, new_ga) != (self.micro_batch, self.grad_accum):
            self.replace(self.new_loader(new_mb), new_mb, new_ga)
        self.steps_per_epoch = self._steps_per_epoch(self.loader, new_ga)
        self.total_steps = self._total_steps()

    def _micro_batch_cap(self) -> int:
        """The largest micro-batch a new layout may take: the config's, or the smallest an
        applied shrink chose; not the checkpoint's, which an uneven world size may have lowered
        (8 -> 6 -> 4 over resizes between 2 and 3 workers of a global batch of 24)."""
        shrunk = [c["micro_batch"] for c in self.changes
                  if c.get("applied") and "decision_id" in c and c.get("micro_batch")]
        return min([self.config.micro_batch, *shrunk])

    def _steps_per_epoch(self, loader: Any, grad_accum: int) -> int:
        n = len(loader)
        return n // grad_accum if self.config.epoch_tail == "drop" else -(-n // grad_accum)

    def _total_steps(self) -> int:
        total = self.steps_per_epoch * self.config.epochs
        return total if self.config.max_steps is None else min(total, self.config.max_steps)
