"""The device-prefetch stage: the next batches are copied to the device before they are asked for.

On CUDA the copies run on a side stream (``non_blocking`` from pinned memory), so they overlap
the current step's compute. Correctness when the training loop takes a batch:

* ``current_stream.wait_stream(side)``: the step's kernels wait, on the GPU, for the copy to
  finish; the host does not block (no synchronization on the hot path).
* ``tensor.record_stream(current_stream)`` for every tensor of the batch: the tensors were
  allocated on the side stream, so without it the caching allocator could hand their memory to
  the next copy while the step still reads them.

Elsewhere (CPU, or a device without streams) the stage moves batches with ``.to(device)`` and
keeps ``depth`` of them ready, which is harmless and keeps the same behaviour to test.
``depth`` 0 turns the stage off (each batch is moved when it is taken).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import torch

from raytrain_guard.runtime.batches import iter_tensors, map_tensors


class DevicePrefetcher:
    """Pulls batches from ``source`` and keeps up to ``depth`` of them already on ``device``."""

    def __init__(self, source: Iterator[Any], device: torch.device, depth: int = 1) -> None:
        self._source = source
        self._device = torch.device(device)
        self._depth = max(0, int(depth))
        self._ready: collections.deque[Any] = collections.deque()
        self._exhausted = False
        self._stream = None
        if self._device.type == "cuda" and torch.cuda.is_available():
            self._stream = torch.cuda.Stream(device=self._device)

    @property
    def depth(self) -> int:
        return self._depth

    def set_depth(self, depth: int) -> None:
        """Change how many batches are kept ahead; takes effect from the next batch taken."""
        self._depth = max(0, int(depth))

    @property
    def num_ready(self) -> int:
        return len(self._ready)

    def _move(self, batch: Any) -> Any:
        if self._stream is None:
            return map_tensors(batch, lambda t: t.to(self._device))
        with torch.cuda.stream(self._stream):
            return map_tensors(batch, lambda t: t.to(self._device, non_blocking=True))

    def _fill(self, target: int) -> None:
        while not self._exhausted and len(self._ready) < target:
            try:
                batch = next(self._source)
            except StopIteration:
                self._exhausted = True
                break
            self._ready.append(self._move(batch))

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> Any:
        self._fill(1)
        if not self._ready:
            raise StopIteration
        batch = self._ready.popleft()
        if self._stream is not None:
            current = torch.cuda.current_stream(self._device)
            current.wait_stream(self._stream)
            for t in iter_tensors(batch):
                if t.device.type == "cuda":
                    t.record_stream(current)
        self._fill(self._depth)  # start the next copies before the step runs
        return batch
