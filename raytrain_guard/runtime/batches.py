"""Cheap facts about a batch: its bytes, its shape signature, and moving it to a device.

A batch is what a DataLoader yields: a tensor, or a dict/list/tuple (named tuples included)
nesting tensors and plain values. The walks here allocate nothing beyond their result and
never synchronize a device, so they may run every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def batch_nbytes(batch: Any) -> int:
    """Bytes held by the tensors of ``batch`` (views counted at their own size)."""
    if isinstance(batch, torch.Tensor):
        return batch.element_size() * batch.numel()
    if isinstance(batch, dict):
        return sum(batch_nbytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(batch_nbytes(v) for v in batch)
    return 0


def batch_signature(batch: Any, *, shapes: bool = True) -> Any:
    """A hashable description of the batch's structure that ignores the batch dimension.

    Tensors become ``("tensor", dtype, trailing shape)``; containers keep their type and keys.
    Two batches of one well-formed dataset have equal signatures (the last, shorter batch
    included); a dataset whose samples change type or per-sample shape does not.
    ``shapes=False`` leaves shapes out (a collate_fn that pads to each batch's longest sample).
    """
    if isinstance(batch, torch.Tensor):
        return ("tensor", str(batch.dtype), tuple(batch.shape[1:]) if shapes else batch.dim())
    if isinstance(batch, dict):
        return ("dict", tuple((k, batch_signature(v, shapes=shapes)) for k, v in batch.items()))
    if isinstance(batch, (list, tuple)):
        if batch and not any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in batch):
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
