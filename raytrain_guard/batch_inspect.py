"""What the planner needs from a user's data (torch adapter): bytes of a real batch, and whether
the dataset keeps its samples in Python lists.

A batch is what a DataLoader yields: a tensor, a numpy array, or a dict/list/tuple nesting them
(plain values such as strings and ints hold no buffer a loader would pin, and count 0).

List-backed datasets matter because of copy-on-read: a forked DataLoader worker that reads a
Python object writes its reference count, so the page holding it is copied into the worker.
Over an epoch each worker grows towards a private copy of every Python object it touched;
numpy arrays and tensors keep their data in one buffer whose pages are never written.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from raytrain_guard.errors import PlanInputError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchMeasure:
    """Bytes of one measured batch and its leading (batch) dimension."""

    batch_bytes: int
    batch_size: int | None          # None: no tensor with a batch dimension
    source: str                     # "sample" | "dataset"

    @property
    def bytes_per_sample(self) -> float:
        return self.batch_bytes / (self.batch_size or 1)


def batch_bytes(batch: Any) -> int:
    """Bytes held by the tensors and arrays of ``batch`` (what a loader queues and pins)."""
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.element_size() * batch.numel()
    nbytes = getattr(batch, "nbytes", None)      # numpy arrays, without importing numpy
    if isinstance(nbytes, int) and hasattr(batch, "dtype"):
        return nbytes
    if isinstance(batch, dict):
        return sum(batch_bytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(batch_bytes(v) for v in batch)
    return 0


def leading_batch_size(batch: Any) -> int | None:
    """The first dimension of the first tensor or array with one, depth first."""
    shape = getattr(batch, "shape", None)
    if shape is not None and hasattr(batch, "dtype"):
        return int(shape[0]) if len(shape) else None
    children = batch.values() if isinstance(batch, dict) else \
        batch if isinstance(batch, (list, tuple)) else ()
    for child in children:
        size = leading_batch_size(child)
        if size is not None:
            return size
    return None


def measure_batch(batch: Any) -> BatchMeasure:
    """Measure one batch as the user's sample factory returned it."""
    size = batch_bytes(batch)
    if size <= 0:
        raise PlanInputError("--sample", "the batch holds no tensor or array",
                             value=type(batch).__name__,
                             fix="return a tensor, or a dict/tuple of tensors, as a DataLoader "
                                 "would yield it")
    return BatchMeasure(size, leading_batch_size(batch), "sample")


def measure_dataset(dataset: Any, *, num_samples: int = 8,
                    collate: Callable[[list], Any] | None = None) -> BatchMeasure:
    """Collate the first ``num_samples`` samples of a map-style dataset and measure them."""
    from torch.utils.data import default_collate

    try:
        count = min(num_samples, len(dataset))
        samples = [dataset[i] for i in range(count)]
        batch = (collate or default_collate)(samples)
    except Exception as exc:  # the user's dataset raised: report it, no traceback
        raise PlanInputError("--dataset", f"reading samples failed ({type(exc).__name__}: "
                             f"{exc})", fix="make dataset[i] and len(dataset) work for the "
                             "first samples") from None
    if count == 0:
        raise PlanInputError("--dataset", "is empty", value=0, fix="return a non-empty dataset")
    size = batch_bytes(batch)
    if size <= 0:
        raise PlanInputError("--dataset", "its samples hold no tensor or array",
                             value=type(samples[0]).__name__,
                             fix="return tensors or numpy arrays from __getitem__")
    return BatchMeasure(size, count, "dataset")


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
