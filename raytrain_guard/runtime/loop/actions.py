"""What the shared train loop applies at a step boundary that only a loop can: a smaller
micro-batch, more loader workers, a prefetch cap that survives a rebuilt loader."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping
from typing import Any

from raytrain_guard.core.decisions import Decision
from raytrain_guard.planner.dataloader_sizing import loader_workers_needed
from raytrain_guard.runtime.guard.boundary import BoundaryActions, set_prefetch
from raytrain_guard.runtime.loop.layout import BatchLayout, shrink_verdict

logger = logging.getLogger(__name__)


class LoopActions(BoundaryActions):
    """The loop's :class:`BoundaryActions` on its :class:`BatchLayout`. ``guard``: the step
    guard (its window prices more workers; a new loader opens its steps); ``control``: the
    control plane (a shrink is applied by every rank or none); ``log``: the decision log."""

    def __init__(self, layout: BatchLayout, *, guard: Any, control: Any, metrics: Any,
                 log: Any) -> None:
        super().__init__(layout.rank)
        self.layout = layout
        self.guard = guard
        self.control = control
        self.metrics = metrics
        self.log = log
        self._workers_at: int | None = None      # step of the last loader-worker change

    def set_prefetch(self, params: Mapping[str, Any]) -> None:
        if "prefetch_factor" in params:       # a rebuilt loader asks it too
            self.layout.requested_prefetch = params["prefetch_factor"]
        set_prefetch(self.layout.loader, params)

    def shrink(self, step: int, decision: Decision) -> None:
        """Apply a SHRINK_MICRO_BATCH, or refuse it with the reason (logged, and kept in the
        layout's changes). Every rank decides alike (same layout, same dataset length) and
        builds its new loader; one round of the control plane then says whether every rank
        could. If one could not, every rank keeps its layout: a rank left on the old one would
        break exactly-once delivery under DDP and mismatch the collectives under FSDP."""
        layout = self.layout
        old = (layout.micro_batch, layout.grad_accum)
        entry = {"step": step, "decision_id": decision.decision_id,
                 "from_micro_batch": old[0], "from_grad_accum": old[1],
                 "micro_batch": decision.params.get("micro_batch"),
                 "grad_accum": decision.params.get("grad_accum")}
        verdict = shrink_verdict(*old, decision.params, samples_per_rank=layout.samples_per_rank)
        if isinstance(verdict, str):
            logger.warning("rank %d step %d: shrink refused: %s", self.rank, step, verdict)
            layout.changes.append({**entry, "applied": False, "reason": verdict})
            return
        new, failure = None, None
        try:
            new = layout.new_loader(verdict[0])
        except Exception as exc:
            failure = repr(exc)
            logger.warning("rank %d step %d: cannot re-batch: %s", self.rank, step, failure,
                           exc_info=True)
        if self.control.all_reduce_max(0 if failure is None else 1, 0)[0]:
            if new is not None:
                new.close()
            reason = (f"this rank could not re-batch: {failure}" if failure else
                      "another rank could not re-batch")
            logger.warning("rank %d step %d: shrink dropped on every rank, keeping micro_batch "
                           "%d x grad_accum %d: %s", self.rank, step, *old, reason)
            layout.changes.append({**entry, "applied": False, "reason": reason})
            return
        self._replace(new, *verdict)
        logger.warning("rank %d step %d: micro_batch %d -> %d, grad_accum %d -> %d (global batch "
                       "%d unchanged, loader rebuilt at sample %d of epoch %d): %s", self.rank,
                       step, old[0], verdict[0], old[1], verdict[1],
                       old[0] * old[1] * layout.world_size, new.samples_consumed, new.epoch,
                       decision.reason)
        layout.changes.append({**entry, "applied": True, "reason": decision.reason})

    def add_loader_workers(self, step: int, decision: Decision) -> None:
        """Slow steps caused by data on this rank: a loader at the same position with the
        workers that keep up with the step (:func:`loader_workers_needed` from the last slow
        steps, at most ``max_workers_per_gpu``: the loader keeps prefetch inside the host
        budget), at most once per ``decision_cooldown_steps``. Rank-local: the batches and
        their order do not change, only who reads them."""
        layout = self.layout
        cfg = layout.config.guard
        if self._workers_at is not None and step - self._workers_at < cfg.decision_cooldown_steps:
            return
        workers = layout.loader.plan.num_workers
        recent = self.guard.gate.window[-cfg.num_slow_steps:]
        wait = statistics.median(s.data_wait_s for s in recent) if recent else 0.0
        rest = statistics.median(s.total_s - s.data_wait_s for s in recent) if recent else 0.0
        new_workers = min(cfg.max_workers_per_gpu,
                          loader_workers_needed(workers, wait, rest, least=cfg.min_workers_per_gpu))
        if new_workers <= workers:
            return
        self._workers_at = step
        try:
            new = layout.new_loader(layout.micro_batch, num_workers=new_workers)
        except Exception:
            logger.warning("rank %d: loader with more workers failed", self.rank, exc_info=True)
            return
        self._replace(new, layout.micro_batch, layout.grad_accum)
        plan = new.plan
        if self.metrics is not None:
            self.metrics.record_loader(plan.num_workers, plan.prefetch_factor)
        entry = {"action": "add_loader_workers", "step": step, "applied_at": step,
                 "scope": "rank", "cause": "data", "world_rank": self.rank, "decision_id": 0,
                 "applied": True, "params": {"num_workers": new_workers,
                                             "prefetch_factor": plan.prefetch_factor},
                 "reason": (f"rank {self.rank} step {step}: data wait made its steps slow "
                            f"({decision.reason}); DataLoader workers {workers} -> "
                            f"{new_workers}, prefetch_factor {plan.prefetch_factor} "
                            f"(host budget {plan.budget_bytes / 2**20:.0f} MiB)")}
        self.log.append(entry)
        logger.warning("%s", entry["reason"])

    def _replace(self, new: Any, micro_batch: int, grad_accum: int) -> None:
        self.layout.replace(new, micro_batch, grad_accum)
        if self.guard.loader_attached:        # the same timer opens the new loader's steps
            self.guard.attach_loader(new)
