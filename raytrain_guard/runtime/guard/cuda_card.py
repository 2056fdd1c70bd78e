"""The real card's figures for pricing a micro-batch before its forward (CUDA): PyTorch's
caching allocator counters (no device synchronization), where on CPU a simulated card counts.

The peak counter is reset before each micro-batch, so a loop that reads
``max_memory_allocated`` per step sees the last micro-batch's peak. A micro-batch's measure
includes the gradients it allocates: the price errs high.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class CudaCard:
    """The simulated card's figures from the allocator's counters for ``device``:
    :attr:`base_bytes`, :meth:`tracking` (leaving :attr:`last_activation_bytes`),
    :attr:`step_peak_bytes`; ``capacity_bytes``: the card, or the run's cap."""

    def __init__(self, device: Any, capacity_bytes: int | None = None, *, cuda: Any = None) -> None:
        self._cuda = cuda or torch.cuda      # tests pass a fake one
        self.device = device
        self.capacity_bytes = int(capacity_bytes if capacity_bytes is not None
                                  else self._cuda.get_device_properties(device).total_memory)
        self.last_activation_bytes = 0
        self._step_peak = 0

    @property
    def base_bytes(self) -> int:
        """What the allocator holds now: parameters, gradients, optimizer state, the rest."""
        return int(self._cuda.memory_allocated(self.device))

    @property
    def step_peak_bytes(self) -> int:
        """The highest allocation of the micro-batches tracked since the last :meth:`new_step`."""
        return max(self._step_peak, int(self._cuda.max_memory_allocated(self.device)))

    def new_step(self) -> None:
        self._step_peak = 0

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        """Measure what the block (one micro-batch's forward and backward) allocates beyond
        what was held before it: its activations and their transients."""
        base = self.base_bytes
        self._cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            peak = int(self._cuda.max_memory_allocated(self.device))
            self._step_peak = max(self._step_peak, peak)
            self.last_activation_bytes = max(0, peak - base)
