"""The stage ahead of the loop: the next batches made ready before the loop asks for them,
on the device (:class:`DevicePrefetcher`) or taken from the workers' queue by a background
thread (:class:`ThreadedPrefetcher`). Where the guarded DataLoader uses them:
docs/train_loop.md ("The guarded DataLoader").
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from raytrain_guard.planner.batches import iter_tensors, map_tensors


class DevicePrefetcher:
    """Pulls batches from ``source`` and keeps up to ``depth`` of them already on ``device``
    (0: each batch moves when it is taken).

    On CUDA the copies run on a side stream (``non_blocking`` from pinned memory); a batch
    taken makes the current stream wait for its copy (``wait_stream``: the host does not
    block), and ``record_stream`` keeps the allocator from handing its memory to the next copy
    while the step reads it. Elsewhere batches move with ``.to(device)`` in the calling thread.
    """

    def __init__(self, source: Iterator[Any], device: torch.device, depth: int = 1) -> None:
        self._source = source
        self._device = torch.device(device)
        self._depth = max(0, int(depth))
        self._ready: collections.deque[Any] = collections.deque()
        self._exhausted = False
        self._stream = None
        if self._device.type == "cuda" and torch.cuda.is_available():
            self._stream = torch.cuda.Stream(device=self._device)

    def set_depth(self, depth: int) -> None:
        """Change how many batches are kept ahead; takes effect from the next batch taken."""
        self._depth = max(0, int(depth))

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


_END = object()          # the source is exhausted


class _Raised:
    """An exception raised by the source, handed to the consumer to re-raise."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class ThreadedPrefetcher:
    """Pulls batches from ``source`` on a background thread and keeps up to ``depth`` (at
    least 1) taken and not yet handed out; ``move`` is applied to each on that thread.

    Batches still queued at :meth:`close` were never delivered. The source's StopIteration and
    errors reach the consumer in order. :meth:`close` joins the thread (after the
    ``next(source)`` it is in); only then may the source be reset or shut down.
    """

    def __init__(self, source: Iterator[Any], depth: int = 1,
                 move: Callable[[Any], Any] | None = None) -> None:
        self._source = source
        self._move = move
        self._depth = max(1, int(depth))
        self._ready: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="raytrain_guard-batches",
                                        daemon=True)
        self._thread.start()

    def set_depth(self, depth: int) -> None:
        """Change how many batches are kept ahead (at least 1); takes effect at once."""
        with self._cond:
            self._depth = max(1, int(depth))
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and len(self._ready) >= self._depth:
                    self._cond.wait()
                if self._stopped:
                    return
            try:
                item = next(self._source)
                if self._move is not None:
                    item = self._move(item)
            except StopIteration:
                item = _END
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                item = _Raised(exc)
            with self._cond:
                if self._stopped:
                    return
                self._ready.append(item)
                self._cond.notify_all()
            if item is _END or isinstance(item, _Raised):
                return

    def __iter__(self) -> ThreadedPrefetcher:
        return self

    def __next__(self) -> Any:
        with self._cond:
            while not self._ready:
                if self._stopped:
                    raise StopIteration
                self._cond.wait()
            item = self._ready[0]
            if item is _END:
                raise StopIteration            # left in place: a later next() ends too
            self._ready.popleft()
            self._cond.notify_all()
        if isinstance(item, _Raised):
            raise item.exc
        return item

    def close(self) -> None:
        """Stop the thread, wait for it, and drop the batches it had ready (never delivered)."""
        with self._cond:
            self._stopped = True
            self._ready.clear()
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
