"""The DataLoader of the drop-in (:func:`raytrain_guard.train.prepare_data_loader`).

A :class:`~raytrain_guard.runtime.data.loader.GuardedDataLoader` rebuilt from the user's torch
DataLoader, with what a Ray Train loop expects of it (``loader.sampler.set_epoch``), and the
user's ``num_workers``/``prefetch_factor`` kept unless they exceed the host budget
(:func:`lower_to_budget`, pure). :func:`unguardable` says which DataLoaders it cannot rebuild.
"""

from __future__ import annotations

import logging
from typing import Any

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    default_collate,
)

from raytrain_guard.config import GuardConfig
from raytrain_guard.runtime.data.loader import GuardedDataLoader
from raytrain_guard.units import format_bytes

logger = logging.getLogger(__name__)


# -- the user's settings against the host budget (pure) --------------------------------------------

def lower_to_budget(num_workers: int, prefetch_factor: int, batch_cost_bytes: int,
                    budget_bytes: int, config: GuardConfig) -> tuple[int, int, str | None]:
    """``(num_workers, prefetch_factor, warning)``: the user's settings, or the largest that fit.

    ``num_workers x prefetch_factor x batch_cost_bytes`` (a batch and its pinned copy) must
    fit ``budget_bytes`` (``host_prefetch_frac`` of host RAM per GPU). Over it, the prefetch is
    lowered first (the workers stay); when even 1 does not fit, the workers too. The warning
    names the rule and the figures; None when nothing was lowered.
    """
    held = num_workers * prefetch_factor * batch_cost_bytes
    if num_workers == 0 or held <= budget_bytes:
        return num_workers, prefetch_factor, None
    workers, prefetch = num_workers, budget_bytes // (num_workers * batch_cost_bytes)
    if prefetch >= 1:
        what = f"prefetch_factor {prefetch_factor} lowered to {prefetch}"
    else:
        workers, prefetch = max(1, budget_bytes // batch_cost_bytes), 1
        what = (f"num_workers {num_workers} lowered to {workers} and prefetch_factor "
                f"{prefetch_factor} to 1")
    return workers, prefetch, (
        f"{what}: {num_workers} workers x prefetch_factor {prefetch_factor} x "
        f"{format_bytes(batch_cost_bytes)} per batch = {format_bytes(held)} in flight exceed the "
        f"host prefetch budget of {format_bytes(budget_bytes)} (rule: host_prefetch_frac "
        f"{config.host_prefetch_frac:.0%} of host RAM per GPU); {workers} x {prefetch} x "
        f"{format_bytes(batch_cost_bytes)} = {format_bytes(workers * prefetch * batch_cost_bytes)}"
        f" fits")


class DropInDataLoader(GuardedDataLoader):
    """The loader :func:`raytrain_guard.train.prepare_data_loader` returns.

    A :class:`GuardedDataLoader` (sharded, sized, timed, resumable; ``prefetch_factor``,
    ``persistent_workers`` and ``multiprocessing_context`` kept) with what a Ray Train loop
    expects of its DataLoader: ``loader.sampler.set_epoch(epoch)``. Build it with
    :meth:`keeping_settings`: settings the user wrote are kept unless they exceed the host
    budget, then lowered with a warning (:func:`lower_to_budget`).
    """

    def __init__(self, *args: Any, lowered: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lowered = list(lowered)
        self._given = {"persistent_workers": bool(kwargs.get("persistent_workers", True)),
                       "multiprocessing_context": kwargs.get("multiprocessing_context")}

    @classmethod
    def keeping_settings(cls, dataset: Any, batch_size: int, *, num_workers: int | None,
                         prefetch_factor: int | None, config: GuardConfig,
                         **kwargs: Any) -> DropInDataLoader:
        """The loader with the user's ``num_workers``/``prefetch_factor`` (None: sized by the
        guard), lowered to the host budget when they exceed it. The budget and the batch's bytes
        come from a first loader without workers (no process started: it measures a batch)."""
        lowered: tuple[str, ...] = ()
        if num_workers and prefetch_factor:
            probe = GuardedDataLoader(dataset, batch_size, config=config, num_workers=0,
                                      watch_worker_memory=False,
                                      **{k: v for k, v in kwargs.items()
                                         if k not in ("persistent_workers", "watch_worker_memory",
                                                      "multiprocessing_context")})
            cost = probe.probe_batch_bytes * (2 if probe.pin_memory else 1)
            budget = probe.plan.budget_bytes
            probe.close()
            num_workers, prefetch_factor, warning = lower_to_budget(
                num_workers, prefetch_factor, cost, budget, config)
            if warning is not None:
                logger.warning("rank %s: DataLoader %s", kwargs.get("world_rank", "?"), warning)
                lowered = (warning,)
        return cls(dataset, batch_size, config=config, num_workers=num_workers,
                   prefetch_factor=prefetch_factor, lowered=lowered, **kwargs)

    @classmethod
    def rebuilt_from(cls, loader: Any, *, config: GuardConfig, world_rank: int,
                     world_size: int, gpus_per_node: int, device: Any, add_dist_sampler: bool,
                     move_to_device: bool, auto_transfer: bool) -> DropInDataLoader:
        """The torch DataLoader ``loader`` (one :func:`unguardable` accepts) rebuilt with its
        settings kept (:meth:`keeping_settings`); the other arguments are Ray's
        ``prepare_data_loader``'s."""
        given_workers = loader.num_workers or None        # 0: torch's default, sized here
        generator = loader.generator
        return cls.keeping_settings(
            loader.dataset, loader.batch_size,
            shuffle=isinstance(loader.sampler, RandomSampler),
            seed=int(generator.initial_seed()) if generator is not None else 0,
            drop_last=loader.drop_last,
            collate_fn=None if loader.collate_fn is default_collate else loader.collate_fn,
            config=config,
            world_rank=world_rank if add_dist_sampler else 0,
            world_size=world_size if add_dist_sampler else 1,
            gpus_per_node=gpus_per_node,
            device=device if move_to_device else None,
            num_workers=given_workers,
            prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
            persistent_workers=bool(loader.persistent_workers) or given_workers is None,
            multiprocessing_context=loader.multiprocessing_context,
            device_prefetch_depth=1 if auto_transfer or not move_to_device else 0)

    @property
    def sampler(self) -> _EpochSampler:
        """The distributed sampler; its ``set_epoch`` is the loader's (a no-op for the current
        epoch, which the loader moves on by itself)."""
        return _EpochSampler(self)

    def settings(self) -> dict[str, Any]:
        """The DataLoader settings in force (what the summary reports)."""
        plan = self.plan
        return {"batch_size": self.batch_size, "num_workers": plan.num_workers,
                "prefetch_factor": plan.prefetch_factor or None,
                "persistent_workers": self._given["persistent_workers"] and plan.num_workers > 0,
                "multiprocessing_context": _context_name(
                    self._given["multiprocessing_context"]),
                "world_size": self.world_size, "reason": plan.reason,
                "lowered": list(self.lowered)}


class _EpochSampler:
    """``loader.sampler`` of a :class:`DropInDataLoader`: ``set_epoch`` moves the loader, the
    rest reads the real sampler."""

    def __init__(self, loader: DropInDataLoader) -> None:
        self._loader = loader

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self._sampler())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sampler(), name)

    def _sampler(self) -> Any:
        return self._loader._sampler


def _context_name(context: Any) -> str | None:
    if context is None or isinstance(context, str):
        return context
    get = getattr(context, "get_start_method", None)
    return get() if callable(get) else str(context)


def unguardable(loader: Any) -> str | None:
    """Why a DataLoader cannot be rebuilt as a guarded one (None: it can)."""
    if not isinstance(loader, DataLoader):
        return f"not a torch DataLoader ({type(loader).__name__})"
    if isinstance(loader.dataset, IterableDataset):
        return "an IterableDataset has no length to shard by index"
    if loader.batch_size is None:
        return "no automatic batching (batch_size=None)"
    if type(loader.sampler) not in (RandomSampler, SequentialSampler):
        return f"a custom sampler ({type(loader.sampler).__name__})"
    if type(loader.batch_sampler) is not BatchSampler:
        return f"a custom batch_sampler ({type(loader.batch_sampler).__name__})"
    return None
