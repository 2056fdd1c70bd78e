"""The batch layout of the shared train loop: micro-batch, accumulation and the loader that
delivers them, changed by a shrink, a resume on another world size, or more loader workers."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping
from typing import Any

from raytrain_guard.core.decisions import Decision
from raytrain_guard.errors import InputError, check_int

logger = logging.getLogger("raytrain_guard.runtime.train_loop")



def shrink_verdict(micro_batch: int, grad_accum: int, params: Mapping[str, Any], *,
                   samples_per_rank: int) -> tuple[int, int] | str:
    """``(new micro_batch, new grad_accum)`` of a SHRINK_MICRO_BATCH, or why it is refused.

    Accepted only when both are positive integers, the new micro-batch is smaller and divides
    the old one, the global batch is kept (``new_mb x new_ga == micro_batch x grad_accum``) and
    an epoch of ``samples_per_rank`` still holds ``new_ga`` micro-batches. Pure: every rank
    computes the same verdict from the same figures.
    """
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


class LayoutMixin:
    """Who reads the batches and how they are grouped into steps. Every change keeps the global
    batch and the position in the epoch's permutation, so every sample is consumed once."""

    def _steps_per_epoch(self, loader: Any, grad_accum: int) -> int:
        """Steps of an epoch: its micro-batches in steps of ``grad_accum``; the leftover ones
        make a shorter last step (``epoch_tail="short_step"``) or are dropped."""
        if self.config.epoch_tail == "drop":
            return len(loader) // grad_accum
        return -(-len(loader) // grad_accum)

    def _make_loader(self, dataset: Any, micro_batch: int, num_workers: int | None = None) -> Any:
        from raytrain_guard.runtime.loader import GuardedDataLoader

        cfg = self.config
        return GuardedDataLoader(
            dataset, micro_batch, shuffle=True, seed=cfg.seed, config=cfg.guard,
            world_rank=self.rank, world_size=self.world_size, device=self.device,
            num_workers=cfg.num_workers if num_workers is None else num_workers)

    def _resume_batch_layout(self, saved: Mapping[str, Any] | None, saved_world: int) -> None:
        """Continue with the checkpoint's micro_batch/grad_accum (a shrink before the restart)
        when they keep this config's global batch; otherwise keep the config's, with a warning.
        On another world size (a restore with another ScalingConfig, an elastic resize) the
        checkpoint's global batch is kept: micro-batch and accumulation are laid out again
        (:func:`relayout`), or the resume is refused unless ``allow_global_batch_change``."""
        if saved:
            self.batch_changes = [dict(c) for c in saved.get("changes", ())]
        if saved_world != self.world_size:
            mb, ga = ((int(saved["micro_batch"]), int(saved["grad_accum"])) if saved
                      else (self.micro_batch, self.grad_accum))
            self._resume_on_other_world(mb, ga, saved_world)
            return
        if not saved:
            return
        mb, ga = int(saved["micro_batch"]), int(saved["grad_accum"])
        if (mb, ga) == (self.micro_batch, self.grad_accum):
            return
        if mb * ga != self.micro_batch * self.grad_accum:
            logger.warning("rank %d: checkpoint ran with micro_batch %d x grad_accum %d, this "
                           "config asks %d x %d (another global batch): keeping the config's",
                           self.rank, mb, ga, self.micro_batch, self.grad_accum)
            return
        logger.info("rank %d: resuming with the checkpoint's micro_batch %d and grad_accum %d "
                    "(config: %d and %d)", self.rank, mb, ga, self.micro_batch, self.grad_accum)
        self._rebatch(mb, ga)

    def _resume_on_other_world(self, mb: int, ga: int, saved_world: int) -> None:
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
        entry = {"step": None, "kind": "world_size", "from_world_size": saved_world,
                 "world_size": self.world_size, "from_micro_batch": mb, "from_grad_accum": ga,
                 "micro_batch": new_mb, "grad_accum": new_ga, "applied": True,
                 "global_batch": new_mb * new_ga * self.world_size,
                 "reason": f"resumed on {self.world_size} workers (checkpoint: {saved_world}): "
                           f"micro_batch {new_mb} x grad_accum {new_ga} "
                           + ("changes the global batch from "
                              f"{global_batch} to {new_mb * new_ga * self.world_size} "
                              "(allow_global_batch_change)" if changed
                              else f"keeps the global batch {global_batch}")}
        (logger.warning if changed else logger.info)("rank %d: %s", self.rank, entry["reason"])
        self.batch_changes.append(entry)
        if (new_mb, new_ga) != (self.micro_batch, self.grad_accum):
            self._rebatch(new_mb, new_ga)
        self.steps_per_epoch = self._steps_per_epoch(self.loader, new_ga)
        self.total_steps = self.steps_per_epoch * self.config.epochs
        if self.config.max_steps is not None:
            self.total_steps = min(self.total_steps, self.config.max_steps)

    def _micro_batch_cap(self) -> int:
        """The largest micro-batch a new layout may take: the config's (the plan's fit), or
        the smallest an applied shrink chose (memory asked for it); not the checkpoint's, which
        a world size that shares the global batch unevenly may have lowered (8 -> 6 -> 4 over
        resizes between 2 and 3 workers of a global batch of 24)."""
        shrunk = [c["micro_batch"] for c in self.batch_changes
                  if c.get("applied") and "decision_id" in c and c.get("micro_batch")]
        return min([self.config.micro_batch, *shrunk])

    def _shrink(self, decision: Decision) -> None:
        """Apply a SHRINK_MICRO_BATCH at this boundary, or refuse it with the reason (logged and
        kept in ``batch_changes``). Every rank decides alike (same layout, same dataset length)
        and applies it or none does: each rank builds its new loader, then one round of the
        control plane says whether every rank could; if one could not, every rank keeps its
        layout (a rank left on the old one would break exactly-once delivery under DDP and
        mismatch the collectives under FSDP)."""
        old = (self.micro_batch, self.grad_accum)
        entry = {"step": self.step, "decision_id": decision.decision_id,
                 "from_micro_batch": old[0], "from_grad_accum": old[1],
                 "micro_batch": decision.params.get("micro_batch"),
                 "grad_accum": decision.params.get("grad_accum")}
        samples_per_rank = -(-self.loader.num_samples // self.world_size)
        verdict = shrink_verdict(old[0], old[1], decision.params,
                                 samples_per_rank=samples_per_rank)
        if isinstance(verdict, str):
            logger.warning("rank %d step %d: shrink refused: %s", self.rank, self.step, verdict)
            self.batch_changes.append({**entry, "applied": False, "reason": verdict})
            return
        new, failure = None, None
        try:
            new = self._prepare_loader(verdict[0])
        except Exception as exc:
            failure = repr(exc)
            logger.warning("rank %d step %d: cannot re-batch: %s", self.rank, self.step,
                           failure, exc_info=True)
        failed_anywhere, _ = self.control.all_reduce_max(0 if failure is None else 1, 0)
        if failed_anywhere:
            if new is not None:
                new.close()
            reason = (f"this rank could not re-batch: {failure}" if failure else
                      "another rank could not re-batch")
            logger.warning("rank %d step %d: shrink dropped on every rank, keeping micro_batch "
                           "%d x grad_accum %d: %s", self.rank, self.step, old[0], old[1], reason)
            self.batch_changes.append({**entry, "applied": False, "reason": reason})
            return
        self._commit_loader(new, *verdict)
        logger.warning("rank %d step %d: micro_batch %d -> %d, grad_accum %d -> %d (global batch "
                       "%d unchanged, loader rebuilt at sample %d of epoch %d): %s", self.rank,
                       self.step, old[0], verdict[0], old[1], verdict[1],
                       old[0] * old[1] * self.world_size,
                       self.loader.samples_consumed, self.loader.epoch,
                       decision.reason)
        self.batch_changes.append({**entry, "applied": True, "reason": decision.reason})

    def _rebatch(self, micro_batch: int, grad_accum: int) -> None:
        """Replace the loader by one of ``micro_batch`` at the same epoch position; from the
        next step on, ``grad_accum`` micro-batches make a step."""
        self._commit_loader(self._prepare_loader(micro_batch), micro_batch, grad_accum)

    def _prepare_loader(self, micro_batch: int) -> Any:
        """A loader of ``micro_batch`` at the current loader's position and settings."""
        old = self.loader
        new = self._make_loader(old.dataset, micro_batch)
        try:
            new.load_state_dict(old.state_dict())
            if new.device_prefetch_depth != old.device_prefetch_depth:
                new.set_device_prefetch_depth(old.device_prefetch_depth)
            if self._requested_prefetch is not None:
                new.request_prefetch_factor(self._requested_prefetch)
        except Exception:
            new.close()
            raise
        return new

    def _commit_loader(self, new: Any, micro_batch: int, grad_accum: int) -> None:
        old = self.loader
        old.close()                    # its live iterator ends; _micro_batches reads the new one
        self.loader = new
        guard = getattr(self, "guard", None)       # none yet while a resume lays out
        if guard is not None and guard.loader_attached:     # the same timer, the new loader
            guard.attach_loader(new)
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        steps_per_epoch = self._steps_per_epoch(new, grad_accum)
        if steps_per_epoch != self.steps_per_epoch:
            logger.warning("rank %d: %d steps per epoch with micro_batch %d x grad_accum %d "
                           "(was %d: the epoch's last partial micro-batch splits differently); "
                           "the run keeps its %d steps", self.rank, steps_per_epoch,
                           micro_batch, grad_accum, self.steps_per_epoch, self.total_steps)
        self.steps_per_epoch = steps_per_epoch

    def _add_loader_workers(self, step: int, decision: Decision) -> None:
        """Slow steps caused by data on this rank: rebuild its loader at the same position with
        the workers that keep up with the step (:func:`loader_workers_needed` from the last slow
        steps; at most ``max_workers_per_gpu``: the loader keeps prefetch inside the host
        budget), at most once per ``decision_cooldown_steps``. Rank-local: the batches and their
        order do not change, only who reads them."""
        from raytrain_guard.core.dataloader_sizing import loader_workers_needed

        guard = self.config.guard
        if self._loader_workers_at is not None and \
                step - self._loader_workers_at < guard.decision_cooldown_steps:
            return
        old = self.loader
        workers = old.plan.num_workers
        recent = self.guard.gate.window[-guard.num_slow_steps:]
        wait = statistics.median(s.data_wait_s for s in recent) if recent else 0.0
        rest = statistics.median(s.total_s - s.data_wait_s for s in recent) if recent else 0.0
        new_workers = min(guard.max_workers_per_gpu,
                          loader_workers_needed(workers, wait, rest, least=guard.min_workers_per_gpu))
        if new_workers <= workers:
            return
        self._loader_workers_at = step
        try:
            new = self._make_loader(old.dataset, self.micro_batch, num_workers=new_workers)
            new.load_state_dict(old.state_dict())
        except Exception:
            logger.warning("rank %d: loader with more workers failed", self.rank, exc_info=True)
            return
        old.close()
        self.loader = new
        if self.guard.loader_attached:
            self.guard.attach_loader(new)
        self.metrics.record_loader(new.plan.num_workers, new.plan.prefetch_factor)
        entry = {"action": "add_loader_workers", "step": step, "applied_at": step,
                 "scope": "rank", "cause": "data", "world_rank": self.rank, "decision_id": 0,
                 "applied": True, "params": {"num_workers": new_workers,
                                             "prefetch_factor": new.plan.prefetch_factor},
                 "reason": (f"rank {self.rank} step {step}: data wait made its steps slow "
                            f"({decision.reason}); DataLoader workers {workers} -> "
                            f"{new_workers}, prefetch_factor {new.plan.prefetch_factor} "
                            f"(host budget {new.plan.budget_bytes / 2**20:.0f} MiB)")}
        self.decisions.append(entry)
        self._trace_event("decision", **entry)
        logger.warning("%s", entry["reason"])

    def setup(self) -> dict[str, Any]:
        """The batch layout and memory this rank runs with now (what the coordinator's policy
        prices its actions with: :mod:`raytrain_guard.core.effects`). Read when the client
        reports, not per step; the CUDA counters are the allocator's, no synchronization."""
        import torch

        prefetch = self.loader.plan.prefetch_factor
        plan = self.loader.plan
        setup = {"micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
                 "prefetch_factor": prefetch if prefetch and prefetch > 0 else None,
                 "device": self.device.type, "num_workers": plan.num_workers,
                 "batch_bytes": self.loader.probe_batch_bytes}
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else \
                torch.cuda.current_device()
            setup.update(device_index=index,
                         allocated_bytes=torch.cuda.memory_allocated(index),
                         reserved_bytes=torch.cuda.memory_reserved(index),
                         device_total_bytes=torch.cuda.get_device_properties(index).total_memory)
        elif self.sim_device is not None:   # a simulated card: no cache, nothing to release
            used = self.sim_device.base_bytes
            setup.update(device="simulated", allocated_bytes=used, reserved_bytes=used,
                         device_total_bytes=self.sim_device.capacity_bytes)
        return setup
