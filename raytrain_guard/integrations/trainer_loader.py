"""A DataLoader a trainer built itself (Hugging Face's ``get_train_dataloader``, Lightning's
``train_dataloader``), held to the host budget before its first iterator starts.

The rule is the drop-in's: ``num_workers x prefetch_factor x batch bytes`` (a batch and its
pinned copy) must fit ``host_prefetch_frac`` (5 %) of host RAM per GPU. Settings the user wrote
are kept when they fit and lowered with a warning naming the rule and the figures when they
do not (:func:`~raytrain_guard.runtime.dropin.loader.lower_to_budget`); ``num_workers=0``, both
trainers' default, is sized by the planner's rule
(:func:`~raytrain_guard.planner.dataloader_sizing.size_dataloader`). torch reads
``num_workers`` and ``prefetch_factor`` when an iterator starts, so setting them on the loader
before the epoch begins takes effect; a trainer that already iterates keeps its settings until
its next epoch.

:class:`TrainerHooks` is what the Hugging Face and Lightning callbacks share around it: the
worker's guard, the fit of the trainer's loader and each step's data wait.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.planner.dataloader_sizing import host_budget_bytes, size_dataloader
from raytrain_guard.runtime.data.loader import probe_batch, usable_cpus
from raytrain_guard.runtime.dropin.loader import lower_to_budget
from raytrain_guard.runtime.dropin.worker import current_guard
from raytrain_guard.runtime.host_memory import host_memory
from raytrain_guard.units import format_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoaderFit:
    """What the guard set on a trainer's loader, and why."""

    num_workers: int
    prefetch_factor: int          # 0 without workers
    batch_bytes: int
    budget_bytes: int
    reason: str
    lowered: tuple[str, ...] = ()


def fit_settings(*, num_workers: int, prefetch_factor: int | None, batch_bytes: int,
                 host_memory_bytes: int, gpus_per_node: int, cpus_per_node: int,
                 pin_memory: bool, config: GuardConfig) -> LoaderFit:
    """The settings a trainer's loader runs with (pure; see the module rule). ``num_workers``
    0: sized by the guard; otherwise kept, with ``prefetch_factor`` (None: torch's 2) lowered
    first when over the budget."""
    budget = host_budget_bytes(host_memory_bytes, gpus_per_node, config)
    cost = batch_bytes * (2 if pin_memory else 1)
    if num_workers == 0:
        plan = size_dataloader(batch_bytes=batch_bytes, host_memory_bytes=host_memory_bytes,
                               gpus_per_node=gpus_per_node, cpus_per_node=cpus_per_node,
                               pin_memory=pin_memory, config=config)
        return LoaderFit(plan.num_workers, plan.prefetch_factor, batch_bytes, budget,
                         "num_workers 0 (the default) sized by the guard: " + plan.reason)
    given = prefetch_factor or 2
    workers, prefetch, warning = lower_to_budget(num_workers, given, cost, budget, config)
    if warning is None:
        return LoaderFit(workers, prefetch, batch_bytes, budget,
                         f"num_workers {workers} and prefetch_factor {prefetch} as given: "
                         f"{format_bytes(workers * prefetch * cost)} in flight within the host "
                         f"budget of {format_bytes(budget)} (host_prefetch_frac "
                         f"{config.host_prefetch_frac:.0%} of host RAM per GPU)")
    return LoaderFit(workers, prefetch, batch_bytes, budget, warning, (warning,))


class TrainerLoader:
    """A trainer's torch DataLoader as the guard's summary and decisions see it: its settings,
    the data wait the integration times (:meth:`record_step`), and a SET_PREFETCH decision
    (:meth:`request_prefetch_factor`, from the loader's next iterator on)."""

    def __init__(self, loader: Any, fit: LoaderFit, *, batch_size: int, world_size: int) -> None:
        self._loader = loader
        self.fit = fit
        self.batch_size = batch_size
        self.world_size = world_size
        self.plan = fit                      # ``plan.num_workers`` / ``plan.prefetch_factor``
        self._wait_s = 0.0
        self._step_s = 0.0
        self._batches = 0
        self._requested: int | None = None

    def record_step(self, wait_s: float, step_s: float) -> None:
        """One step: ``wait_s`` of it waiting for its batches."""
        self._wait_s += max(0.0, wait_s)
        self._step_s += max(0.0, step_s)
        self._batches += 1

    def request_prefetch_factor(self, prefetch_factor: int | None) -> None:
        """Cap the prefetch (never above the fit), from the loader's next iterator on."""
        self._requested = prefetch_factor
        if self.fit.num_workers and prefetch_factor is not None:
            self._loader.prefetch_factor = max(1, min(int(prefetch_factor),
                                                      self.fit.prefetch_factor))

    def settings(self) -> dict[str, Any]:
        loader = self._loader
        workers = int(loader.num_workers)
        return {"batch_size": self.batch_size, "num_workers": workers,
                "prefetch_factor": loader.prefetch_factor if workers else None,
                "persistent_workers": bool(getattr(loader, "persistent_workers", False)),
                "multiprocessing_context": None, "world_size": self.world_size,
                "reason": self.fit.reason, "lowered": list(self.fit.lowered)}

    def stats(self) -> dict[str, Any]:
        frac = self._wait_s / self._step_s if self._step_s > 0 else 0.0
        return {"data_wait_frac": frac, "data_wait_total_s": self._wait_s,
                "batches": self._batches}


def torch_loader(loader: Any) -> Any:
    """The torch DataLoader inside a trainer's (accelerate keeps it as ``base_dataloader``)."""
    from torch.utils.data import DataLoader

    inner = getattr(loader, "base_dataloader", loader)
    return inner if isinstance(inner, DataLoader) else None


def fit_loader(loader: Any, *, batch_size: int, config: GuardConfig, world_rank: int,
               world_size: int, gpus_per_node: int, pin_memory: bool = False) -> TrainerLoader | None:
    """Measure a batch of ``loader`` (its first samples, collated by its own ``collate_fn``,
    scaled to ``batch_size``), fit its settings (:func:`fit_settings`) and set them on it.
    None when it is not a map-style torch DataLoader (an iterable one is left as it is)."""
    from torch.utils.data import IterableDataset

    inner = torch_loader(loader)
    if inner is None or isinstance(inner.dataset, IterableDataset):
        logger.info("rank %d: the trainer's loader is not a map-style torch DataLoader: its "
                    "settings are left as they are", world_rank)
        return None
    _, batch_bytes = probe_batch(inner.dataset, batch_size, inner.collate_fn, config,
                                 field="train_dataset")
    total, _ = host_memory()
    fit = fit_settings(num_workers=int(inner.num_workers), prefetch_factor=inner.prefetch_factor,
                       batch_bytes=batch_bytes, host_memory_bytes=total,
                       gpus_per_node=gpus_per_node, cpus_per_node=usable_cpus(),
                       pin_memory=pin_memory, config=config)
    if fit.lowered:
        logger.warning("rank %d: DataLoader %s", world_rank, fit.lowered[0])
    else:
        logger.info("rank %d: DataLoader %s", world_rank, fit.reason)
    inner.num_workers = fit.num_workers
    inner.prefetch_factor = fit.prefetch_factor or None
    return TrainerLoader(inner, fit, batch_size=batch_size, world_size=world_size)


class TrainerHooks:
    """What the Hugging Face and Lightning callbacks share: the worker's guard (``guard``,
    default ``get_guard()``), the trainer's loader held to the host budget (``fit_loader``,
    :meth:`_fit`), and each step's data wait: from the end of one step (:meth:`_step_ended`) to
    where the trainer starts the next with its batches fetched (:meth:`_batches_here`); a pause
    (a checkpoint, an evaluation: :meth:`_paused`) restarts it."""

    def __init__(self, *, fit_loader: bool = True, guard: Any = None) -> None:
        self.fit_loader = fit_loader
        self._guard = guard
        self.loader: TrainerLoader | None = None
        self._ended: float | None = None
        self._began: float | None = None
        self._wait_s = 0.0

    @property
    def guard(self) -> Any:
        return self._guard if self._guard is not None else current_guard()

    def _fit(self, guard: Any, loader: Any, *, batch_size: int | None = None,
             pin_memory: bool | None = None) -> None:
        """Hold ``loader`` to the host budget (:func:`fit_loader`; ``batch_size`` and
        ``pin_memory``: the loader's own when None). It fails open: a loader that cannot be
        fitted trains with its settings, and a warning says so."""
        self.loader = None
        if not self.fit_loader or loader is None:
            return
        try:
            pinned = loader.pin_memory if pin_memory is None else pin_memory
            self.loader = fit_loader(
                loader, batch_size=int(batch_size or loader.batch_size or 1),
                config=guard.config, world_rank=guard.rank, world_size=guard.world_size,
                gpus_per_node=max(1, guard.ctx.local_world_size),
                pin_memory=bool(pinned) and guard.device.type == "cuda")
        except Exception:
            logger.warning("rank %s: the DataLoader was not fitted; it trains with its own "
                           "settings", guard.rank, exc_info=True)
        if self.loader is not None:
            guard.attach_loader(self.loader)

    def _batches_here(self) -> None:
        now = time.perf_counter()
        self._began = now
        self._wait_s = now - self._ended if self._ended is not None else 0.0
        self.guard.mark("data")

    def _step_ended(self) -> None:
        """The step's wall time and data wait to the loader's figures."""
        now = time.perf_counter()
        began = self._began
        step_s = (now - began) + self._wait_s if began is not None else 0.0
        self._ended, self._began = now, None
        if self.loader is not None:
            self.loader.record_step(self._wait_s, step_s)

    def _restart_clock(self) -> None:
        self._ended = time.perf_counter()

    def _paused(self) -> None:
        self.guard.note_pause()
        self._restart_clock()
