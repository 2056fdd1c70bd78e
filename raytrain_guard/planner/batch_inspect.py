"""What the planner needs from a user's data (torch adapter): bytes of a real batch, and whether
the dataset keeps its samples in Python lists.

The batch walkers are :mod:`raytrain_guard.planner.batches`'s; the guarded DataLoader's probe
is :func:`measure_dataset` and its copy-on-read check :func:`is_list_backed`, so the CLI's plan
and the running loader measure a dataset alike.

List-backed datasets matter because of copy-on-read: a forked DataLoader worker that reads a
Python object writes its reference count, so the page holding it is copied into the worker.
Over an epoch each worker grows towards a private copy of every Python object it touched;
numpy arrays and tensors keep their data in one buffer whose pages are never written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import InputError, PlanInputError
from raytrain_guard.planner.batches import batch_nbytes, batch_signature, leading_batch_size

log = logging.getLogger(__name__)

SAME_SHAPE_FIX = ("make __getitem__ return the same structure, dtype and per-sample shape for "
                  "every sample, or pass a collate_fn that pads")


@dataclass(frozen=True)
class BatchMeasure:
    """Bytes of one measured batch, its leading (batch) dimension and its signature."""

    batch_bytes: int
    batch_size: int | None          # None: no tensor with a batch dimension
    source: str                     # "sample" | "dataset"
    signature: Any = None           # batch_signature of the collated samples ("dataset")

    @property
    def bytes_per_sample(self) -> float:
        return self.batch_bytes / (self.batch_size or 1)


def measure_batch(batch: Any) -> BatchMeasure:
    """Measure one batch as the user's sample factory returned it."""
    size = batch_nbytes(batch)
    if size <= 0:
        raise PlanInputError("--sample", "the batch holds no tensor or array",
                             value=type(batch).__name__,
                             fix="return a tensor, or a dict/tuple of tensors, as a DataLoader "
                                 "would yield it")
    return BatchMeasure(size, leading_batch_size(batch), "sample")


def measure_dataset(dataset: Any, *, num_samples: int | None = None,
                    collate: Callable[[list], Any] | None = None,
                    config: GuardConfig = GuardConfig(), field: str = "--dataset",
                    error: type[InputError] = PlanInputError,
                    require_bytes: bool = True) -> BatchMeasure:
    """Collate the first ``num_samples`` (default ``config.loader_probe_samples``) samples of a
    map-style dataset and measure them.

    Without a ``collate`` (torch's default_collate), every sample must agree with sample 0 in
    type and per-sample shape. Bad input raises ``error`` naming ``field``: a dataset that is
    empty or raises, samples that differ or cannot be collated, and (``require_bytes``) samples
    that hold no tensor or array.
    """
    from torch.utils.data import default_collate

    count = config.loader_probe_samples if num_samples is None else num_samples
    name = type(dataset).__name__
    try:
        count = min(count, len(dataset))
        samples = [dataset[i] for i in range(count)]
    except Exception as exc:  # the user's dataset raised: report it in one line
        raise error(field, f"reading samples failed ({type(exc).__name__}: {exc})", value=name,
                    fix="make dataset[i] and len(dataset) work for the first samples") from exc
    if count == 0:
        raise error(field, "is empty", value=0, fix="return a non-empty dataset")
    if collate is None:
        first = batch_signature(default_collate([samples[0]]))
        for i, sample in enumerate(samples[1:], start=1):
            sig = batch_signature(default_collate([sample]))
            if sig != first:
                raise error(field, f"sample {i} differs from sample 0 in type or shape: {sig} "
                            f"vs {first}", value=name, fix=SAME_SHAPE_FIX)
    try:
        batch = (collate or default_collate)(samples)
    except (RuntimeError, TypeError) as exc:
        raise error(field, f"samples 0..{count - 1} cannot be collated into a batch ({exc})",
                    value=name, fix=SAME_SHAPE_FIX) from exc
    size = batch_nbytes(batch)
    if size <= 0 and require_bytes:
        raise error(field, "its samples hold no tensor or array", value=type(samples[0]).__name__,
                    fix="return tensors or numpy arrays from __getitem__")
    return BatchMeasure(size, count, "dataset", batch_signature(batch, shapes=collate is None))


def list_backed_attributes(dataset: Any, *, min_items: int, _depth: int = 0) -> list[str]:
    """Attributes of ``dataset`` that are Python lists, tuples or dicts of ``min_items`` or more.

    Wrapper datasets are followed one level: ``Subset.dataset``, ``ConcatDataset.datasets``.
    """
    found: list[str] = []
    try:
        attrs = vars(dataset)
    except TypeError:       # no __dict__ (slots or a builtin): nothing to inspect
        return found
    for name, value in attrs.items():
        if isinstance(value, (list, tuple, dict)) and len(value) >= min_items:
            found.append(name)
    if _depth < 2:
        inner: Sequence[Any] = ()
        if hasattr(dataset, "datasets") and isinstance(dataset.datasets, (list, tuple)):
            inner = dataset.datasets
            found = [n for n in found if n not in ("datasets", "cumulative_sizes")]
        elif hasattr(dataset, "dataset"):
            inner = (dataset.dataset,)
            if isinstance(attrs.get("indices"), (list, tuple)):
                found = [n for n in found if n != "indices"]   # Subset's own index list
        for i, child in enumerate(inner):
            found += [f"dataset[{i}].{n}" for n in
                      list_backed_attributes(child, min_items=min_items, _depth=_depth + 1)]
    return found


def is_list_backed(dataset: Any, *, min_items: int) -> bool:
    """True when the dataset keeps samples in Python containers (copy-on-read risk)."""
    found = list_backed_attributes(dataset, min_items=min_items)
    if found:
        log.info("dataset %s keeps samples in Python containers: %s",
                 type(dataset).__name__, ", ".join(found))
    return bool(found)
