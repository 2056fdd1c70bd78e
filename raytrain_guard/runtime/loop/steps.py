"""The epoch loop and gradient accumulation of the shared train loop."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from raytrain_guard.core.decisions import Decision
from raytrain_guard.core.steps import StepStats
from raytrain_guard.runtime.loop.config import _check_loss

logger = logging.getLogger("raytrain_guard.runtime.train_loop")



def _clip_grad_norm(module: Any, max_norm: float) -> Any:
    """Clip the global gradient norm (every rank alike: DDP and ZeRO-1 hold the all-reduced
    gradients, FSDP2's DTensor gradients are reduced across their shards by torch)."""
    import torch
    params = [p for p in module.parameters() if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def _batch_elements(batch: Any) -> int:
    from raytrain_guard.runtime.batches import iter_tensors
    return sum(t.numel() for t in iter_tensors(batch))


class StepsMixin:
    """The steps: micro-batches in steps of ``grad_accum`` (a shorter one at an epoch's end), each
    micro-batch's forward and backward with its share of the step's samples, clipping, the
    optimizer and the scheduler, then the boundary (:class:`~raytrain_guard.runtime.loop.
    decisions.DecisionsMixin`)."""

    def _train(self) -> None:
        """The steps. The guard's StepStats are read (:meth:`_stats_due`) only at some
        boundaries and go, in order, to the gauges and the decision source; whatever a stop at
        another boundary leaves goes to the gauges after the loop, and to the decision source's
        ``finish`` (when it has one: the cluster client's last, partial report)."""
        cfg = self.config
        micro_batches = self._micro_batches()
        guard = self.guard
        watchdog, faults = self.watchdog, self.fault_runtime
        while self.step < self.total_steps:
            step = self.step
            if watchdog is not None:
                watchdog.begin(step)
            if faults is not None:
                faults.begin_step(step)
            if self.memory_faults:
                self._fill_memory(step)
            if not guard.loader_attached:      # else the loader opens the step (attach_loader)
                guard.begin_step(step)
            if self.card is not None:
                self.card.new_step()
            weights = self._step_weights(micro_batches)   # per micro-batch: its share
            step_loss = None                   # the step's loss: mean over its samples
            for micro, weight in enumerate(weights):
                batch = next(micro_batches)
                if not guard.loader_attached:  # else the loader marked it
                    guard.mark("data")
                if watchdog is not None:
                    watchdog.enter("forward")
                if faults is not None:
                    batch = faults.transform(batch)
                if self._audit is not None:
                    self._log_ids(step, batch)
                loss = self._micro_step(batch, weight, micro == len(weights) - 1)
                step_loss = loss if step_loss is None else step_loss + loss
            if watchdog is not None:
                watchdog.enter("optimizer")
            if cfg.max_grad_norm is not None:
                self._grad_norm = _clip_grad_norm(self.planned.module, cfg.max_grad_norm)
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            # no optimizer mark: from the last backward mark to end_step is the optimizer's
            self._last_loss = step_loss
            self.step = step + 1
            if self._split_pending:
                self._measure_splits()
            decisions = guard.end_step(step)
            if watchdog is not None:
                watchdog.end()
            new_stats = (guard.drain_stats() if self._stats_due(self.step, decisions)
                         else [])
            if new_stats:
                self.metrics.record(new_stats)
            if self._trace is not None:
                self._trace_steps(new_stats)
            if self._boundary(self.step, decisions, new_stats):
                break
        left = guard.drain_stats()          # a stop the source decided at another step
        if left:
            self.metrics.record(left)
        if self._trace is not None:
            self._trace_steps(left)
        finish = getattr(cfg.decision_source, "finish", None)
        if callable(finish):
            try:
                finish(left)
            except Exception:
                logger.warning("rank %d: decision source finish failed", self.rank,
                               exc_info=True)

    def _step_weights(self, micro_batches: Iterator[Any]) -> list[float]:
        """Each micro-batch's share of this step's samples, so that the step's loss (and
        gradient) is the mean over its samples: ``grad_accum`` micro-batches, fewer at an
        epoch's end (``epoch_tail="short_step"``; with ``"drop"`` the leftover ones are read
        and skipped). Sizes follow from the epoch's position: every rank holds
        ``ceil(N / world_size)`` samples an epoch (the sampler pads), in micro-batches of
        ``micro_batch``, the last one shorter."""
        loader, mb = self.loader, self.micro_batch
        per_epoch = len(loader)
        # the position in samples of all ranks: right also after a resume on another layout
        consumed = loader.samples_consumed
        position = -(-consumed // (mb * self.world_size)) % per_epoch if per_epoch else 0
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

    def _micro_step(self, batch: Any, weight: float, last: bool) -> Any:
        """Forward and backward of one micro-batch; its loss x ``weight`` (its share of the
        step's samples), detached. On a simulated card an oversized batch runs in pieces
        (:meth:`_pieces`), each weighted by its samples, so the gradient and the global batch
        are those of the whole micro-batch."""
        guard, faults, card = self.guard, self.fault_runtime, self.card
        pieces = self._pieces(batch) if card is not None and self.config.split_spikes \
            else ((batch, 1.0),)
        total = None
        for i, (piece, share) in enumerate(pieces):
            started = time.perf_counter() if faults is not None else 0.0
            with self.planned.grad_sync(last and i == len(pieces) - 1), \
                    (card.tracking() if card is not None else contextlib.nullcontext()):
                with self._forward_precision():
                    loss = self.config.loss_fn(self.planned.module, piece)
                _check_loss(loss, self.step)
                guard.mark("forward")
                if self.watchdog is not None:
                    self.watchdog.enter("backward")
                scaled = loss * (weight * share)
                scaled.backward()
                if faults is not None:
                    faults.after_backward(time.perf_counter() - started)
            guard.mark("backward")
            if card is not None:
                self._learn_activations(piece)
            total = scaled.detach() if total is None else total + scaled.detach()
        return total

    def _forward_precision(self) -> Any:
        """Autocast to bf16 under ``precision="amp-bf16"``; nothing otherwise (FSDP2's
        mixed-precision policies cast inside the wrapped model)."""
        if not self._autocast:
            return contextlib.nullcontext()
        import torch
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def _micro_batches(self) -> Iterator[Any]:
        """Micro-batches across epochs (the loader moves to the next epoch by itself). After a
        rebuild (:meth:`_rebatch`) the old loader's iterator ends and the next pass reads
        ``self.loader`` anew, at the position the old one reached."""
        while True:
            delivered = False
            for batch in self.loader:
                delivered = True
                yield batch
            if not delivered:
                return

    def _stats_due(self, step: int, local: list[Decision]) -> bool:
        """Whether the boundary after ``step`` steps reads the guard's StepStats: every
        ``report_every_steps`` steps (the guard keeps max(step_window, report_every_steps) of
        them, so none is lost), where the gate decided something, and where the run may stop or
        checkpoint: the last step, an agreement step (lockstep and stop flag), a checkpoint step,
        a pending cluster decision due now. A read does not feed the guard's waiting steps to
        its gate (:meth:`StepGuard.drain_stats`): the gate batches stay ``gate_batch_steps``."""
        if local or step >= self.total_steps:
            return True
        for every in self._stats_every:
            if step % every == 0:
                return True
        return any(d.step is not None and d.step <= step for d in self.pending)

    def _trace_steps(self, stats: list[StepStats]) -> None:
        for s in stats:
            self._trace_event("step", step=s.step, total_s=round(s.total_s, 6),
                              data_wait_s=round(s.data_wait_s, 6),
                              compute_s=round(s.compute_s, 6),
                              comm_wait_s=round(s.comm_wait_s, 6), memory_frac=s.memory_frac,
                              cpu_wait_s=_rounded(s.cpu_wait_s),
                              peer_cpu_wait_s=_rounded(s.peer_cpu_wait_s),
                              peer_work_s=_rounded(s.peer_work_s),
                              micro_batch=self.micro_batch, grad_accum=self.grad_accum)


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)
