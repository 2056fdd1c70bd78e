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

The planner calls it before launch; the worker runtime calls it again with measured batch bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import PlanInputError
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


def _positive(name: str, value: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanInputError(name, "must be a positive integer", value=value, fix=fix)
    return value


def host_budget_bytes(host_memory_bytes: int, gpus_per_node: int, config: GuardConfig) -> int:
    """Host bytes one GPU's prefetched batches may hold: ``host_prefetch_frac x RAM / GPUs``."""
    return int(config.host_prefetch_frac * host_memory_bytes / gpus_per_node)


def workers_per_gpu(cpus_per_node: int, gpus_per_node: int, config: GuardConfig) -> int:
    """``cpus // gpus - 1`` (one core for the training process), clamped to the config's range."""
    wanted = max(cpus_per_node // gpus_per_node - 1, 0)
    return min(max(wanted, config.min_workers_per_gpu), config.max_workers_per_gpu)


def size_dataloader(*, batch_bytes: int, host_memory_bytes: int, gpus_per_node: int,
                    cpus_per_node: int, pin_memory: bool, config: GuardConfig,
                    list_backed_dataset: bool = False) -> DataLoaderPlan:
    """Size one training process's DataLoader (see the module rule)."""
    _positive("batch_bytes", batch_bytes, "measure one batch (--sample) or give --batch-bytes")
    _positive("host_memory_bytes", host_memory_bytes, "give the node's RAM, e.g. --host-mem 512GiB")
    _positive("gpus_per_node", gpus_per_node, "give the GPUs (training processes) per node")
    _positive("cpus_per_node", cpus_per_node, "give the node's CPU cores")
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

    cores = cpus_per_node // gpus_per_node
    wanted = max(cores - 1, 0)
    workers = workers_per_gpu(cpus_per_node, gpus_per_node, config)
    why = (f"{cpus_per_node} cores // {gpus_per_node} GPUs = {cores} per GPU, - 1 for training "
           f"= {wanted} workers" + (f", clamped to {workers}" if workers != wanted else ""))
    if wanted < config.min_workers_per_gpu:
        warnings.append(f"only {cores} cores per GPU: {workers} workers (min_workers_per_gpu) "
                        f"share them with the training process")
    if workers == 0:
        return DataLoaderPlan(0, 0, per_batch, budget, why + "; loading in the training process",
                              _with_list_warning(warnings, list_backed_dataset))
    prefetch = min(config.max_prefetch_factor, budget // (workers * per_batch))
    if prefetch >= 1:
        why += (f"; prefetch_factor {prefetch}: {workers} x {prefetch} x "
                f"{format_bytes(batch_bytes)}{pinned} = "
                f"{format_bytes(workers * prefetch * per_batch)} within "
                f"{format_bytes(budget)} ({config.host_prefetch_frac:.0%} of host RAM per GPU)")
    else:
        fewer = budget // per_batch          # >= 1: one batch fits (checked above)
        prefetch = 1
        warnings.append(f"num_workers lowered from {workers} to {fewer}: {workers} batches of "
                        f"{format_bytes(per_batch)} in flight exceed the "
                        f"{format_bytes(budget)} host budget")
        workers = fewer
        why += (f"; lowered to {workers} with prefetch_factor 1 so {workers} x "
                f"{format_bytes(batch_bytes)}{pinned} fits {format_bytes(budget)}")
    host = workers * prefetch * per_batch
    return DataLoaderPlan(workers, prefetch, host, budget, why,
                          _with_list_warning(warnings, list_backed_dataset))


def _with_list_warning(warnings: list[str], list_backed_dataset: bool) -> tuple[str, ...]:
    if list_backed_dataset:
        warnings.append(
            "the dataset keeps its samples in Python lists: every forked worker touches their "
            "reference counts and copies those pages (copy-on-read), so worker memory grows "
            "towards a full copy per worker; store samples in numpy arrays or tensors instead")
    return tuple(warnings)
