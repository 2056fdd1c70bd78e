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
  ``trainer.should_stop`` at the step every rank agreed on; Ray's ``RayTrainReportCallback``
  then saves and reports the checkpoint at the epoch's end (Lightning ends the epoch there).
  Resume with ``trainer.fit(model, ckpt_path=...)``: the guard counts from the restored step;
- a ``checkpoint`` decision (no stop) saves and reports a checkpoint at the agreed step through
  Ray's ``RayTrainReportCallback`` of the trainer, as it does at an epoch's end (the same
  ``checkpoint.ckpt`` layout, ``ray.train.report`` on every rank at the same step), and
  training goes on. Lightning has no "save now" signal of its own for a callback to set (the
  ``ModelCheckpoint`` triggers are steps, epochs or times fixed in advance), so without Ray's
  callback the decision is logged once and not honoured.

``RayFSDPStrategy`` is Lightning's FSDP1 and needs CUDA: not checked on gloo/CPU here.
docs/integrations.md.
"""

from __future__ import annotations

import logging
from typing import Any

from raytrain_guard.integrations import require
from raytrain_guard.integrations.trainer_loader import StepClock, fit_loader
from raytrain_guard.runtime.dropin.worker import current_guard
from raytrain_guard.runtime.guard.comm_timers import attach_comm_timers

_pl = require("lightning.pytorch", "lightning", "raytrain_guard.integrations.lightning")

logger = logging.getLogger(__name__)

__all__ = ["GuardCallback"]


class GuardCallback(_pl.Callback):
    """The guard's callback for a ``lightning.pytorch.Trainer`` (see the module docstring).

    ``fit_loader``: hold the training DataLoader to the host budget (default True).
    ``guard``: the worker's guard (default: ``get_guard()``). Every part fails open.
    """

    def __init__(self, *, fit_loader: bool = True, guard: Any = None) -> None:
        self.fit_loader = fit_loader
        self._guard = guard
        self._clock = StepClock()
        self.loader: Any = None
        self._stop_logged = self._checkpoint_logged = False

    @property
    def guard(self) -> Any:
        return self._guard if self._guard is not None else current_guard()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
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
        if self.fit_loader and loader is not None and not isinstance(loader, (list, dict)):
            try:
                self.loader = fit_loader(
                    loader, batch_size=int(loader.batch_size or 1), config=guard.config,
                    world_rank=guard.rank, world_size=guard.world_size,
                    gpus_per_node=max(1, guard.ctx.local_world_size),
                    pin_memory=bool(loader.pin_memory) and guard.device.type == "cuda")
            except Exception:
                logger.warning("rank %s: the DataLoader was not fitted", guard.rank,
                               exc_info=True)
            if self.loader is not None:
                guard.attach_loader(self.loader)
        self._clock.paused()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        self._clock.batches_here()
        self.guard.mark("data")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        # Lightning steps the optimizer before the closure runs: its pre-hook cannot end
        # backward after DDP's last allreduce as in the drop-in, so this hook does
        self.guard.mark("backward")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step_s = self._clock.step_ended()
        if self.loader is not None:
            self.loader.record_step(self._clock.wait_s, step_s)
        guard = self.guard
        if guard.should_stop():
            trainer.should_stop = True
            if not self._stop_logged:
                self._stop_logged = True
                logger.warning("rank %s step %d: checkpoint and stop: %s", guard.rank,
                               trainer.global_step, guard.stop_reason)
        elif guard.should_checkpoint():
            self._checkpoint(trainer, pl_module)

    def _checkpoint(self, trainer: Any, pl_module: Any) -> None:
        """A ``checkpoint`` decision at this step (the same on every rank): Ray's callback saves
        and reports one now, as at an epoch's end."""
        from ray.train.lightning import RayTrainReportCallback  # imports lightning: after require

        reporter = next((c for c in trainer.callbacks
                         if isinstance(c, RayTrainReportCallback)), None)
        if reporter is None:
            if not self._checkpoint_logged:
                self._checkpoint_logged = True
                logger.warning("rank %s step %d: a checkpoint decision is not honoured: the "
                               "trainer has no ray.train.lightning.RayTrainReportCallback to "
                               "save and report it", self.guard.rank, trainer.global_step)
            return
        logger.info("rank %s step %d: checkpoint (a guard decision)", self.guard.rank,
                    trainer.global_step)
        reporter.on_train_epoch_end(trainer, pl_module)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        self._paused()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._paused()

    def _paused(self) -> None:
        self.guard.note_pause()
        self._clock.paused()
