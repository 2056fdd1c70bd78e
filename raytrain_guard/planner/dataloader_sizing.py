"""DataLoader ``num_workers`` and ``prefetch_factor`` from cores, host RAM and batch bytes (pure).

The rule:

- ``num_workers`` = ``cpus_per_node // gpus_per_node`` minus one core for the training process,
  clamped to ``[config.min_workers_per_gpu, config.max_workers_per_gpu]``.
- Budget per GPU = ``config.host_prefetch_frac x host_memory_bytes / gpus_per_node``.
- A batch in flight costs its bytes, twice when ``pin_memory`` (the pinned copy).
  With ``num_workers = W`` and ``prefetch_factor = P`` exactly ``W x P`` batches are in flight.
- ``prefetch_factor`` = the largest ``P <= config.max_prefetch_factor`` with
  ``W x P x batch cost <= budget``; if even ``P = 1`` does not fit, fewer workers.
- One batch alone over the budget: :class:`PlanInputError` naming both and the fix.
- Given ``num_workers`` / ``prefetch_factor`` are kept; ``prefetch_cap`` lowers the prefetch.

The planner calls it before launch; the worker runtime calls it again with measured batch bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import PlanInputError, check_int
from raytrain_guard.units import format_bytes


@dataclass(frozen=True)
class DataLoaderPlan:
    """DataLoader settings per GPU (per training process) and the host bytes they hold."""

    num_workers: int
    prefetch_factor: int          # 0 when num_workers is 0 (pass None to torch then)
    host_bytes: int               # batches in flight, pinned copies included
    budget_bytes: int             # host_prefetch_frac x host RAM / gpus_per_node
    reason: str
    warnings: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict:
        return {"num_workers": self.num_workers, "prefetch_factor": self.prefetch_factor,
                "host_bytes": self.host_bytes, "budget_bytes": self.budget_bytes,
                "reason": self.reason, "warnings": list(self.warnings)}


def host_budget_bytes(host_memory_bytes: int, gpus_per_node: int, config: GuardConfig) -> int:
    """Host bytes one GPU's prefetched batches may hold: ``host_prefetch_frac x RAM / GPUs``."""
    return int(config.host_prefetch_frac * host_memory_bytes / gpus_per_node)


def workers_per_gpu(cpus_per_node: int, gpus_per_node: int, config: GuardConfig) -> int:
    """``cpus // gpus - 1`` (one core for the training process), clamped to the config's range."""
    return _workers_rule(cpus_per_node, gpus_per_node, config)[2]


def _workers_rule(cpus_per_node: int, gpus_per_node: int,
                  config: GuardConfig) -> tuple[int, int, int]:
    """(cores per GPU, cores - 1, that clamped to the config's range)."""
    cores = cpus_per_node // gpus_per_node
    wanted = max(cores - 1, 0)
    return cores, wanted, min(max(wanted, config.min_workers_per_gpu), config.max_workers_per_gpu)


def size_dataloader(*, batch_bytes: int, host_memory_bytes: int, gpus_per_node: int,
                    cpus_per_node: int, pin_memory: bool, config: GuardConfig,
                    list_backed_dataset: bool = False, num_workers: int | None = None,
                    prefetch_factor: int | None = None,
                    prefetch_cap: int | None = None) -> DataLoaderPlan:
    """Size one training process's DataLoader (see the module rule).

    ``num_workers`` given (the user's choice): kept, with the largest prefetch that fits the
    budget (at least 1). ``prefetch_factor`` given: kept as is. ``prefetch_cap`` (a run-time
    request, e.g. a SET_PREFETCH decision): the prefetch is lowered to it, never raised. A
    given setting over the budget is kept and warned about, not refused.
    """
    for name, value, fix in (
            ("batch_bytes", batch_bytes, "measure one batch (--sample) or give --batch-bytes"),
            ("host_memory_bytes", host_memory_bytes, "give the node's RAM, e.g. --host-mem 512GiB"),
            ("gpus_per_node", gpus_per_node, "give the GPUs (training processes) per node"),
            ("cpus_per_node", cpus_per_node, "give the node's CPU cores")):
        check_int(name, value, at_least=1, fix=fix, error=PlanInputError)
    if num_workers is not None:
        check_int("num_workers", num_workers, fix="use None to let the guard size it",
                  error=PlanInputError)
    for name, value in (("prefetch_factor", prefetch_factor), ("prefetch_cap", prefetch_cap)):
        if value is not None:
            check_int(name, value, at_least=1, fix="use 1 or more, or None", error=PlanInputError)
    warnings: list[str] = []
    budget = host_budget_bytes(host_memory_bytes, gpus_per_node, config)
    per_batch = batch_bytes * (2 if pin_memory else 1)
    pinned = " x 2 (pinned copy)" if pin_memory else ""
    if per_batch > budget:
        raise PlanInputError(
            "batch_bytes", f"one batch{' and its pinned copy' if pin_memory else ''} "
            f"({format_bytes(per_batch)}) exceeds the host prefetch budget of "
            f"{format_bytes(budget)} ({config.host_prefetch_frac:.0%} of "
            f"{format_bytes(host_memory_bytes)} / {gpus_per_node} GPUs)", value=batch_bytes,
            fix="use a smaller micro-batch, more host RAM, a larger host_prefetch_frac"
                + (", or pin_memory=False" if pin_memory else ""))

    cores, wanted, workers = _workers_rule(cpus_per_node, gpus_per_node, config)
    why = (f"{cpus_per_node} cores // {gpus_per_node} GPUs = {cores} per GPU, - 1 for training "
           f"= {wanted} workers" + (f", clamped to {workers}" if workers != wanted else ""))
    if num_workers is None and wanted < config.min_workers_per_gpu:
        warnings.append(f"only {cores} cores per GPU: {workers} workers (min_workers_per_gpu) "
                        f"share them with the training process")
    if num_workers is not None and num_workers != workers:
        workers = num_workers
        why += f"; num_workers {workers} as given"
    if workers == 0:
        return DataLoaderPlan(0, 0, per_batch, budget, why + "; loading in the training process",
                              _with_list_warning(warnings, list_backed_dataset))
    prefetch = min(config.max_prefetch_factor, budget // (workers * per_batch))
    if prefetch >= 1:
        why += (f"; prefetch_factor {prefetch}: {workers} x {prefetch} x "
                f"{format_bytes(batch_bytes)}{pinned} = "
                f"{format_bytes(workers * prefetch * per_batch)} within "
                f"{format_bytes(budget)} ({config.host_prefetch_frac:.0%} of host RAM per GPU)")
    elif num_workers is not None:
        prefetch = 1                         # the given workers stay; warned below
        why += "; prefetch_factor 1 (the given workers exceed the budget even at 1)"
    else:
        fewer = budget // per_batch          # >= 1: one batch fits (checked above)
        prefetch = 1
        warnings.append(f"num_workers lowered from {workers} to {fewer}: {workers} batches of "
                        f"{format_bytes(per_batch)} in flight exceed the "
                        f"{format_bytes(budget)} host budget")
        workers = fewer
        why += (f"; lowered to {workers} with prefetch_factor 1 so {workers} x "
                f"{format_bytes(batch_bytes)}{pinned} fits {format_bytes(budget)}")
    if prefetch_factor is not None:
        prefetch = prefetch_factor
        why += f"; prefetch_factor {prefetch} as given"
    if prefetch_cap is not None and prefetch > prefetch_cap:
        prefetch = prefetch_cap
        why += f"; prefetch_factor capped at {prefetch} by request"
    host = workers * prefetch * per_batch
    if host > budget:
        warnings.append(f"{workers} workers x prefetch {prefetch} x {format_bytes(per_batch)} "
                        f"= {format_bytes(host)} exceed the host prefetch budget of "
                        f"{format_bytes(budget)}")
    return DataLoaderPlan(workers, prefetch, host, budget, why,
                          _with_list_warning(warnings, list_backed_dataset))


def _with_list_warning(warnings: list[str], list_backed_dataset: bool) -> tuple[str, ...]:
    if list_backed_dataset:
        warnings.append(
            "the dataset keeps its samples in Python lists: every forked worker touches their "
            "reference counts and copies those pages (copy-on-read), so worker memory grows "
            "towards a full copy per worker; store samples in numpy arrays or tensors instead")
    return tuple(warnings)


def loader_workers_needed(workers: int, data_wait_s: float, rest_s: float, *,
                          least: int = 2) -> int:
    """DataLoader workers that fetch a batch per step (pure). A step is ``rest_s`` of work
    plus ``data_wait_s`` of waiting for data. Without workers the fetch is the wait; with
    ``W`` busy workers a batch arrives every ``rest_s + data_wait_s``, so one fetch takes
    ``W x (rest_s + data_wait_s)``. Keeping up takes ``fetch / rest_s`` workers, plus one
    for the jitter; at least ``least``."""
    fetch = data_wait_s if workers == 0 else workers * (rest_s + data_wait_s)
    return max(least, math.ceil(fetch / max(rest_s, 1e-4)) + 1)
