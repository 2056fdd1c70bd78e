"""The guard inside a Lightning ``Trainer`` run by :class:`raytrain_guard.train.TorchTrainer`
with Ray's ``RayDDPStrategy``, ``RayLightningEnvironment`` and ``prepare_trainer``.

``Trainer(callbacks=[RayTrainReportCallback(), GuardCallback()], ...)``:

- the steps are timed as the drop-in times them (the worker's guard, the same gate,
  coordinator, metrics, ``get_guard()`` and ``result.guard``): the data wait from the end of
  one step to ``on_train_batch_start``; a forward hook on the strategy's DDP (whose forward runs
  ``training_step``) ends ``forward`` where backward starts; ``on_after_backward`` ends
  ``backward`` (DDP's last allreduce waited for included: Lightning runs the closure inside
  ``optimizer.step``, after its pre-hook); the optimizer's post-hook ends the step; DDP's
  communication is timed by its comm hook;
- the training DataLoader is held to the host budget (``host_prefetch_frac``, 5 % of host RAM
  per GPU) as the Hugging Face integration holds it. Lightning starts the first epoch's
  iterator before ``on_train_start``, so a change applies from the second epoch;
- a stop (``TorchTrainer.request_stop``, a CHECKPOINT_AND_STOP decision) sets
  ``trainer.should_stop`` at the step every rank agreed on, after Ray's
  ``RayTrainReportCallback`` saved and reported a checkpoint of that step (as
  ``ModelCheckpoint(every_n_train_steps=...)`` saves one: Lightning restores it as a restart
  inside the epoch). Lightning then ends the epoch early, and the epoch-end save of Ray's
  callback is skipped for that fit: it would record the unfinished epoch as trained;
- a resume (``trainer.fit(model, ckpt_path=...)``) continues where the checkpoint was saved:
  the loader's sampler is set to the resumed epoch and its first pass leaves out the batches
  that epoch already trained (:func:`position_resumed_loader`), so the two runs train each
  sample of each epoch once, in the order of an uninterrupted run. The guard counts from the
  restored step;
- a ``checkpoint`` decision (no stop) saves and reports a checkpoint at the agreed step through
  Ray's ``RayTrainReportCallback`` of the trainer, as it does at an epoch's end (the same
  ``checkpoint.ckpt`` layout, ``ray.train.report`` on every rank at the same step), and
  training goes on. Lightning has no "save now" signal of its own for a callback to set (the
  ``ModelCheckpoint`` triggers are steps, epochs or times fixed in advance), so without Ray's
  callback the decision (and the stop's checkpoint) is logged once and not honoured.

Under ``RayFSDPStrategy`` (Lightning's FSDP1) the contract is the same; FSDP1's gradient
reduction is timed through its communication hook (on the host clock: gloo). More:
docs/integrations.md.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import torch

from raytrain_guard.integrations import require
from raytrain_guard.integrations.trainer_loader import TrainerHooks
from raytrain_guard.runtime.guard.comm_timers import attach_comm_timers

_pl = require("lightning.pytorch", "lightning", "raytrain_guard.integrations.lightning")

logger = logging.getLogger(__name__)

__all__ = ["GuardCallback", "position_resumed_loader"]


class GuardCallback(TrainerHooks, _pl.Callback):
    """The guard's callback for a ``lightning.pytorch.Trainer`` (see the module docstring).

    ``fit_loader``: hold the training DataLoader to the host budget (default True).
    ``guard``: the worker's guard (default: ``get_guard()``). Every part fails open.
    """

    def __init__(self, *, fit_loader: bool = True, guard: Any = None) -> None:
        super().__init__(fit_loader=fit_loader, guard=guard)
        self._checkpoint_logged = self._stopped = False
        self._silenced: Any = None       # Ray's callback while its epoch-end save is skipped

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._stopped = False
        guard = self.guard
        guard.build()
        wrapped = trainer.strategy.model or pl_module
        guard.guard_model(wrapped)
        if guard.world_size > 1:
            attach_comm_timers(wrapped, guard.step_guard.timer, world_rank=guard.rank)
        if trainer.optimizers:
            guard.guard_optimizer(trainer.optimizers[0])
        guard.start_at(trainer.global_step)
        loader = trainer.train_dataloader
        self._fit(guard, None if isinstance(loader, (list, dict)) else loader)
        try:
            position_resumed_loader(trainer)
        except Exception:
            logger.warning("rank %s: the resumed loader was not positioned", guard.rank,
                           exc_info=True)
        self._restart_clock()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        self._batches_here()

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        # Lightning steps the optimizer before the closure runs: its pre-hook cannot end
        # backward after DDP's last allreduce as in the drop-in, so this hook does
        self.guard.mark("backward")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._step_ended()
        guard = self.guard
        if guard.should_stop():
            if not self._stopped:
                self._stopped = True
                logger.warning("rank %s step %d: checkpoint and stop: %s", guard.rank,
                               trainer.global_step, guard.stop_reason)
                self._checkpoint(trainer, pl_module, stopping=True)
            trainer.should_stop = True
        elif guard.should_checkpoint():
            self._checkpoint(trainer, pl_module)

    def _checkpoint(self, trainer: Any, pl_module: Any, *, stopping: bool = False) -> None:
        """Ray's callback saves and reports a checkpoint of this step (the same on every rank),
        as at an epoch's end. ``stopping``: the run's last; the epoch-end save that follows
        Lightning's early end of the epoch is skipped until the fit ends."""
        from ray.train.lightning import RayTrainReportCallback  # imports lightning: after require

        reporter = next((c for c in trainer.callbacks
                         if isinstance(c, RayTrainReportCallback)), None)
        if reporter is None:
            if not self._checkpoint_logged:
                self._checkpoint_logged = True
                logger.warning("rank %s step %d: the guard's checkpoint (a decision's or a "
                               "stop's) is not saved: the trainer has no "
                               "ray.train.lightning.RayTrainReportCallback to save and report "
                               "it", self.guard.rank, trainer.global_step)
            return
        logger.info("rank %s step %d: checkpoint (%s)", self.guard.rank, trainer.global_step,
                    "the stop's" if stopping else "a guard decision")
        reporter.on_train_epoch_end(trainer, pl_module)
        if stopping:
            # an instance attribute shadows the method; on_train_end removes it
            reporter.on_train_epoch_end = _skipped_after_stop
            self._silenced = reporter

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._silenced is not None:
            del self._silenced.on_train_epoch_end
            self._silenced = None

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        self._paused()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._paused()


def _skipped_after_stop(trainer: Any, pl_module: Any) -> None:
    logger.info("step %d: the epoch ended early for the guard's stop: its checkpoint of this "
                "step is the run's last, the epoch-end save is skipped", trainer.global_step)


class _LeaveOutFirst:
    """A sampler whose next pass leaves out its first ``count`` indices; then it is ``sampler``."""

    def __init__(self, sampler: Any, count: int) -> None:
        self.sampler = sampler
        self.count = count

    def __iter__(self) -> Iterator[Any]:
        indices = iter(self.sampler)
        if self.count:
            indices, self.count = itertools.islice(indices, self.count, None), 0
        return indices

    def __len__(self) -> int:
        return len(self.sampler)


def position_resumed_loader(trainer: Any) -> int:
    """Point a restored fit's training loader where its checkpoint was saved; returns the
    batches of the epoch it leaves out.

    Lightning restores a checkpoint saved inside an epoch (the guard's stop or ``checkpoint``
    decision, ``ModelCheckpoint(every_n_train_steps=...)``) with the epoch's batch count, but
    iterates a plain DataLoader from the epoch's start, and it started that iterator before
    ``set_epoch`` gave the sampler the resumed epoch. Here the sampler gets the epoch, the
    batch sampler's next pass leaves out the batches already trained (``batches x
    batch_size`` indices of this rank's order), and Lightning's data fetcher starts a new
    iterator, as it does at each epoch's start. A loader this cannot position (an iterable
    dataset, a batch sampler of the user's) is warned about and trains the epoch from its start.
    """
    fit_loop = trainer.fit_loop
    if not fit_loop.restarting or fit_loop._data_fetcher is None:
        return 0
    done = int(fit_loop.epoch_loop.batch_progress.current.processed)
    if not fit_loop.restarted_mid_epoch or done >= trainer.num_training_batches:
        done = 0
    loaders = fit_loop._combined_loader.flattened
    for loader in loaders:
        if callable(getattr(getattr(loader, "sampler", None), "set_epoch", None)):
            loader.sampler.set_epoch(trainer.current_epoch)
    batch_samplers = [getattr(loader, "batch_sampler", None) for loader in loaders]
    if done and not all(isinstance(b, torch.utils.data.BatchSampler) for b in batch_samplers):
        logger.warning("resumed at step %d, %d batches into epoch %d: the training loader has "
                       "no torch BatchSampler to position; Lightning trains the epoch from its "
                       "start", trainer.global_step, done, trainer.current_epoch)
        done = 0
    if done:
        for batches in batch_samplers:
            batches.sampler = _LeaveOutFirst(batches.sampler, done * batches.batch_size)
        logger.info("resumed at step %d: %d batches of epoch %d were trained before the "
                    "checkpoint, the loader starts after them", trainer.global_step, done,
                    trainer.current_epoch)
    iter(fit_loop._data_fetcher)      # Lightning's fetcher starts a new iterator of the loader
    return done
