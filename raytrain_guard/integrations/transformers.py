"""The guard inside a Hugging Face ``Trainer`` run by :class:`raytrain_guard.train.TorchTrainer`.

``trainer.add_callback(GuardCallback())`` beside Ray's ``RayTrainReportCallback``:

- the steps are timed as the drop-in times them (the worker's :class:`WorkerGuard`, the same
  gate, coordinator, metrics, ``get_guard()`` and ``result.guard``): the data wait from the end
  of one optimizer step to ``on_step_begin`` (the Trainer fetches a step's batches there), a
  forward hook on the model ends ``forward`` where backward starts, the optimizer's step hooks
  end ``backward`` and the step;
- the Trainer's DataLoader (built before ``on_train_begin``, iterated after it) keeps
  ``dataloader_num_workers``/``dataloader_prefetch_factor`` when they fit the host budget
  (``host_prefetch_frac``, 5 % of host RAM per GPU) and is lowered with a warning when they do
  not; the default ``dataloader_num_workers=0`` is sized by the guard
  (:mod:`~raytrain_guard.integrations.trainer_loader`);
- a stop (``TorchTrainer.request_stop``, ``get_guard().request_stop``, a CHECKPOINT_AND_STOP
  decision) sets ``control.should_save`` and ``control.should_training_stop`` at the step every
  rank agreed on; a ``checkpoint`` decision sets ``should_save``. Resume with
  ``trainer.train(resume_from_checkpoint=...)``: the guard counts from the restored global step.

:func:`plan_batch_size` gives ``per_device_train_batch_size`` and
``gradient_accumulation_steps`` for a global batch, as ``raytrain-guard plan`` does.
docs/integrations.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from raytrain_guard.cluster.planning import plan_machine
from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import InputError, check_int
from raytrain_guard.integrations import require
from raytrain_guard.integrations.trainer_loader import TrainerHooks
from raytrain_guard.integrations.wrapped import time_wrapper_communication
from raytrain_guard.planner.memory_model import TrainingSetup
from raytrain_guard.planner.plan import plan
from raytrain_guard.planner.trace import trace_model

_transformers = require("transformers", "transformers", "raytrain_guard.integrations.transformers")
TrainerCallback = _transformers.TrainerCallback

logger = logging.getLogger(__name__)

__all__ = ["BatchPlan", "GuardCallback", "plan_batch_size"]


class GuardCallback(TrainerHooks, TrainerCallback):
    """The guard's callback for a ``transformers.Trainer`` (see the module docstring).

    ``fit_loader``: hold the Trainer's DataLoader to the host budget (default True).
    ``guard``: the worker's guard (default: ``get_guard()``, the one ``TorchTrainer``
    installed). Every part fails open: the Trainer trains on if the guard's parts fail.
    """

    def __init__(self, *, fit_loader: bool = True, guard: Any = None) -> None:
        super().__init__(fit_loader=fit_loader, guard=guard)
        self._stop_logged = False

    # -- events ----------------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, train_dataloader: Any = None, **kwargs: Any) -> None:
        guard = self.guard
        guard.build()
        if model is not None:
            guard.guard_model(model)
            if guard.world_size > 1:
                time_wrapper_communication(model, guard)
        if optimizer is not None:
            guard.guard_optimizer(optimizer)
        guard.start_at(state.global_step)
        self._fit(guard, train_dataloader, batch_size=args.per_device_train_batch_size,
                  pin_memory=bool(args.dataloader_pin_memory))
        self._restart_clock()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._batches_here()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step_ended()
        guard = self.guard
        if guard.should_stop():
            control.should_save = True
            control.should_training_stop = True
            if not self._stop_logged:
                self._stop_logged = True
                logger.warning("rank %s step %d: checkpoint and stop: %s", guard.rank,
                               state.global_step, guard.stop_reason)
        elif guard.should_checkpoint():
            control.should_save = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._paused()

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._paused()


# -- the batch plan --------------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchPlan:
    """``TrainingArguments`` fields for a global batch: ``per_device_train_batch_size x
    gradient_accumulation_steps x num_workers = global batch``."""

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    fits: bool
    reason: str
    plan: Any

    def training_args(self) -> dict[str, int]:
        """The two fields, for ``TrainingArguments(**...)``."""
        return {"per_device_train_batch_size": self.per_device_train_batch_size,
                "gradient_accumulation_steps": self.gradient_accumulation_steps}


def plan_batch_size(model_factory: Any, sample_factory: Any, *, global_batch: int,
                    num_workers: int, use_gpu: bool = False,
                    device_memory_bytes: int | None = None, optimizer: str = "adamw",
                    precision: str = "fp32", config: GuardConfig | None = None) -> BatchPlan:
    """The largest micro-batch that fits each device, and the accumulation that reaches
    ``global_batch`` (the planner's rule: 15 % headroom, an exact divisor of the per-rank batch
    when one is at least half as large; docs/planner.md). The model is traced on the fake
    device at one sample batch (``sample_factory() -> batch``, a dict of the model's keyword
    arguments, e.g. ``input_ids`` and ``labels``), as ``raytrain-guard plan`` does. On CPU the
    device is the node's RAM per rank; a GPU run gives ``device_memory_bytes``."""
    check_int("global_batch", global_batch, at_least=1, fix="give the global batch in samples")
    check_int("num_workers", num_workers, at_least=1, fix="give the Ray Train workers")
    config = config or GuardConfig()
    machine = plan_machine(num_workers=num_workers, use_gpu=use_gpu)
    if device_memory_bytes is None:
        if use_gpu:
            raise InputError("device_memory_bytes", "unknown for a GPU run", value=None,
                             fix="pass the memory of one GPU, e.g. 80 * 2**30")
        device_memory_bytes = config.cpu_memory_budget_bytes or machine.memory_per_worker_bytes
    traced = trace_model(model_factory, sample_factory, optimizer=optimizer, precision=precision)
    result = plan(model=traced.model_stats, activations=traced.activations,
                  setup=TrainingSetup(strategy="ddp", optimizer=optimizer, micro_batch=1,
                                      grad_accum=1, world_size=num_workers, precision=precision,
                                      foreach=bool(use_gpu)),
                  device_memory_bytes=int(device_memory_bytes),
                  host_memory_bytes=machine.host_memory_bytes,
                  cpus_per_node=machine.cpus_per_node, gpus_per_node=machine.gpus_per_node,
                  global_batch=global_batch, config=config, auto_micro_batch=True)
    reason = (f"micro_batch {result.micro_batch} x grad_accum {result.grad_accum} x "
              f"{num_workers} workers = {result.global_batch} (asked {global_batch}); "
              + ("fits" if result.fits else "DOES NOT FIT") + f": {result.arithmetic}")
    return BatchPlan(result.micro_batch, result.grad_accum, result.fits, reason, result)
