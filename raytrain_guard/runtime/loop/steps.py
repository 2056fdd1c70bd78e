"""The steps of the shared train loop: micro-batches, accumulation, the optimizer, the
boundary."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from raytrain_guard.runtime.loop.config import LoopConfig, check_loss


class StepLoop:
    """``grad_accum`` micro-batches a step (fewer at an epoch's end), each one's forward and
    backward weighted by its share of the step's samples (so the step's loss and gradient are
    the mean over its samples), clipping, the optimizer and the scheduler; then the step
    boundary, and a checkpoint every ``checkpoint_every_steps``. The hooks of ``rehearsal``,
    ``watchdog`` and ``splitter`` (a card that prices) run only where they are set."""

    def __init__(self, config: LoopConfig, *, layout: Any, model: Any, guard: Any,
                 boundary: Any, checkpointer: Any, recorder: Any, card: Any, splitter: Any,
                 rehearsal: Any, watchdog: Any) -> None:
        self.config = config
        self.layout, self.model, self.guard, self.boundary = layout, model, guard, boundary
        self.checkpointer, self.recorder = checkpointer, recorder
        self.card, self.splitter, self.rehearsal, self.watchdog = card, splitter, rehearsal, watchdog
        self.step = 0
        self.resumed_from: int | None = None
        self.last_loss: Any = None
        self.grad_norm: Any = None       # the last step's norm before clipping
        self.restart_reason: str | None = None

    def run(self) -> None:
        """Train until the last step or a stop (:attr:`boundary`'s ``stop_reason``); with
        ``restart_after_stop`` a stop before the last step sets :attr:`restart_reason`."""
        cfg, layout, guard, boundary = self.config, self.layout, self.guard, self.boundary
        watchdog, rehearsal, card = self.watchdog, self.rehearsal, self.card
        audit = self.recorder.audit is not None
        total, every_checkpoint = layout.total_steps, cfg.every_checkpoint
        optimizer, scheduler = self.model.optimizer, self.model.scheduler
        micro_batches = layout.micro_batches()
        while self.step < total:
            step = self.step
            if watchdog is not None:
                watchdog.begin(step)
            if rehearsal is not None:
                rehearsal.begin_step(step, guard.probe)
            if not guard.loader_attached:      # else the loader opens the step
                guard.begin_step(step)
            if card is not None:
                card.new_step()
            weights = layout.step_weights(micro_batches)
            step_loss = None
            for micro, weight in enumerate(weights):
                batch = next(micro_batches)
                if not guard.loader_attached:  # else the loader marked it
                    guard.mark("data")
                if watchdog is not None:
                    watchdog.enter("forward")
                if rehearsal is not None:
                    batch = rehearsal.transform(batch)
                if audit:
                    self.recorder.sample_ids(step, layout.loader.epoch, batch,
                                             self.resumed_from)
                loss = self._micro_step(batch, weight, micro == len(weights) - 1)
                step_loss = loss if step_loss is None else step_loss + loss
            if watchdog is not None:
                watchdog.enter("optimizer")
            if cfg.max_grad_norm is not None:    # every rank alike: the gradients are reduced
                params = [p for p in self.model.planned.module.parameters() if p.grad is not None]
                self.grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            # no optimizer mark: from the last backward mark to end_step is the optimizer's
            self.last_loss = step_loss
            self.step = step + 1
            if self.splitter is not None and self.splitter.pending:
                self.splitter.measure()
                guard.note_reshaped(step)     # its time is the spike's, told by the split
            local = guard.end_step(step)
            if watchdog is not None:
                watchdog.end()
            boundary.at(self.step, local, read_stats=self.step >= total
                        or self.step % every_checkpoint == 0)
            if boundary.stop_reason is not None:
                if cfg.restart_after_stop and self.step < total:
                    self.restart_reason = boundary.stop_reason
                break
            if boundary.checkpoint_now or (self.step % every_checkpoint == 0
                                           and self.step < total):
                self.checkpointer.save(self, {"kind": "periodic"})
        boundary.finish()

    def _micro_step(self, batch: Any, weight: float, last: bool) -> Any:
        """Forward and backward of one micro-batch; its loss x ``weight``, detached. A spike
        the splitter prices too large for the card runs in pieces, each weighted by its
        samples: the gradient and the global batch are those of the whole micro-batch."""
        guard, rehearsal, card, splitter = self.guard, self.rehearsal, self.card, self.splitter
        model = self.model
        pieces = splitter.pieces(batch, self.step) if splitter is not None else ((batch, 1.0),)
        total = None
        for i, (piece, share) in enumerate(pieces):
            started = time.perf_counter() if rehearsal is not None else 0.0
            with model.planned.grad_sync(last and i == len(pieces) - 1), \
                    (card.tracking() if card is not None else contextlib.nullcontext()):
                with model.forward_precision():
                    loss = self.config.loss_fn(model.planned.module, piece)
                check_loss(loss, self.step)
                guard.mark("forward")
                if self.watchdog is not None:
                    self.watchdog.enter("backward")
                scaled = loss * (weight * share)
                scaled.backward()
                if rehearsal is not None:
                    rehearsal.after_backward(time.perf_counter() - started)
            guard.mark("backward")
            if splitter is not None:
                splitter.learn(piece)
            total = scaled.detach() if total is None else total + scaled.detach()
        return total
