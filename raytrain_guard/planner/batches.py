"""Cheap facts about a batch: its bytes, its shape signature, and moving it to a device.

A batch is what a DataLoader yields: a tensor, a numpy array, or a dict/list/tuple (named
tuples included) nesting them and plain values (plain values such as strings and ints hold no
buffer a loader would queue or pin, and count 0 bytes). numpy arrays are recognized by their
``nbytes``/``dtype``/``shape`` attributes, without importing numpy. The walks here allocate
nothing beyond their result and never synchronize a device, so they may run every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _is_array(value: Any) -> bool:
    """A numpy array (or anything array-like with integer ``nbytes``, ``dtype`` and ``shape``)."""
    return isinstance(getattr(value, "nbytes", None), int) and hasattr(value, "dtype") \
        and hasattr(value, "shape")


def batch_nbytes(batch: Any) -> int:
    """Bytes held by the tensors and arrays of ``batch`` (views counted at their own size)."""
    # once per batch on the training thread: tensors first, containers without a generator
    if isinstance(batch, torch.Tensor):
        return batch.nbytes
    if isinstance(batch, (list, tuple, dict)):
        total = 0
        for value in (batch.values() if isinstance(batch, dict) else batch):
            total += value.nbytes if isinstance(value, torch.Tensor) else batch_nbytes(value)
        return total
    if _is_array(batch):
        return batch.nbytes
    return 0


def leading_batch_size(batch: Any) -> int | None:
    """The first dimension of the first tensor or array with one, depth first."""
    if isinstance(batch, torch.Tensor) or _is_array(batch):
        return int(batch.shape[0]) if len(batch.shape) else None
    children = batch.values() if isinstance(batch, dict) else \
        batch if isinstance(batch, (list, tuple)) else ()
    for child in children:
        size = leading_batch_size(child)
        if size is not None:
            return size
    return None


def batch_signature(batch: Any, *, shapes: bool = True) -> Any:
    """A hashable description of the batch's structure that ignores the batch dimension.

    Tensors become ``("tensor", dtype, trailing shape)``; containers keep their type and keys.
    Two batches of one well-formed dataset have equal signatures (the last, shorter batch
    included); a dataset whose samples change type or per-sample shape does not.
    ``shapes=False`` leaves shapes out (a collate_fn that pads to each batch's longest sample).
    """
    if isinstance(batch, torch.Tensor):
        return ("tensor", str(batch.dtype), tuple(batch.shape[1:]) if shapes else batch.dim())
    if _is_array(batch):
        return ("array", str(batch.dtype), tuple(batch.shape[1:]) if shapes
                else len(batch.shape))
    if isinstance(batch, dict):
        return ("dict", tuple((k, batch_signature(v, shapes=shapes)) for k, v in batch.items()))
    if isinstance(batch, (list, tuple)):
        if batch and not any(isinstance(v, (torch.Tensor, dict, list, tuple)) or _is_array(v)
                             for v in batch):
            # one plain value per sample (default_collate keeps strings as a list): its length
            # is the batch size, so only the element types count
            return (type(batch).__name__, "per-sample", tuple(sorted({type(v).__name__
                                                                      for v in batch})))
        return (type(batch).__name__, tuple(batch_signature(v, shapes=shapes) for v in batch))
    return (type(batch).__name__,)


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` with ``fn`` applied to every tensor, containers rebuilt with their own type."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return type(batch)((k, map_tensors(v, fn)) for k, v in batch.items()) \
            if type(batch) is not dict else {k: map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # named tuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def iter_tensors(batch: Any):
    """Every tensor of ``batch``, depth first."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from iter_tensors(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from iter_tensors(v)
