"""A simulated card for CPU runs: :class:`SimulatedDevice` and its probe.

Parameters, gradients and optimizer state, the tensors autograd saves in forward and held fault
memory are counted against a fixed size; an allocation past it raises
``torch.OutOfMemoryError`` inside the step, as CUDA does. It gives the real card's figures
(:class:`~raytrain_guard.runtime.guard.cuda_card.CudaCard`), so the loop prices micro-batches on
either.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from raytrain_guard.core.decisions import Cause
from raytrain_guard.runtime.guard.probes import MemoryReading
from raytrain_guard.units import format_bytes


class SimulatedDevice:
    """A card of ``capacity_bytes`` for a CPU rank. ``static_bytes``: parameters, gradients
    and optimizer state (:meth:`measure_static`; gradients counted whole from the start, as at
    the peak early in backward). ``held_bytes``: fault memory (:meth:`hold`). Activations: the
    distinct storages saved for backward while :meth:`tracking` is open."""

    def __init__(self, capacity_bytes: int, *, world_rank: int = 0) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self.world_rank = world_rank
        self.static_bytes = 0
        self.held_bytes = 0
        self._held: list[torch.Tensor] = []
        self.activation_bytes = 0
        self.last_activation_bytes = 0   # saved by the last tracked forward
        self._storages: set[int] = set()
        self._parameter_storages: set[int] = set()   # saved weights are no activations
        self.step_peak_bytes = 0

    @property
    def base_bytes(self) -> int:
        """What the card holds outside a forward: static state and fault memory."""
        return self.static_bytes + self.held_bytes

    def measure_static(self, model: Any, optimizer: Any) -> int:
        """Parameters, their gradients and optimizer state (under FSDP2: this rank's shards)."""
        params = grads = 0
        local = [_local(p) for p in model.parameters()]
        self._parameter_storages = {t.untyped_storage().data_ptr() for t in local}
        for p, t in zip(model.parameters(), local):
            size = t.numel() * t.element_size()
            params += size
            grads += size if p.requires_grad else 0
        state = sum(_local(t).numel() * t.element_size() for s in optimizer.state.values()
                    for t in s.values() if isinstance(t, torch.Tensor))
        self.static_bytes = params + grads + state
        self._note_peak(self.base_bytes)
        return self.static_bytes

    def hold(self, num_bytes: int, *, reason: str) -> None:
        """Hold ``num_bytes`` more (a real tensor), or raise OutOfMemoryError past capacity."""
        self._check(num_bytes, reason)
        self._held.append(torch.ones(int(num_bytes), dtype=torch.uint8))
        self.held_bytes += int(num_bytes)
        self._note_peak(self.base_bytes + self.activation_bytes)

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        """Count the tensors saved for backward inside the block (one micro-batch)."""
        self._storages.clear()
        self.activation_bytes = 0
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            self.last_activation_bytes = self.activation_bytes
            self.activation_bytes = 0
            self._storages.clear()

    def new_step(self) -> None:
        """Nothing: the probe takes each step's peak (:meth:`take_step_peak`)."""

    def take_step_peak(self) -> int:
        """The peak since the last call; the next step's peak starts from what is held now."""
        peak, self.step_peak_bytes = self.step_peak_bytes, self.base_bytes
        return peak

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._storages and key not in self._parameter_storages:
            self._storages.add(key)
            size = storage.nbytes()
            self._check(size, "activations")
            self.activation_bytes += size
            self._note_peak(self.base_bytes + self.activation_bytes)
        return tensor

    def _check(self, num_bytes: int, what: str) -> None:
        used = self.base_bytes + self.activation_bytes
        if used + num_bytes > self.capacity_bytes:
            error = torch.OutOfMemoryError(
                f"simulated card of rank {self.world_rank} is out of memory: tried to allocate "
                f"{format_bytes(num_bytes)} ({what}) with {format_bytes(used)} of "
                f"{format_bytes(self.capacity_bytes)} in use (parameters, gradients and "
                f"optimizer state {format_bytes(self.static_bytes)}, fault memory "
                f"{format_bytes(self.held_bytes)}, activations "
                f"{format_bytes(self.activation_bytes)})")
            # what the card would have held had it fitted: the trace's error record keeps it
            error.needed_bytes, error.capacity_bytes = used + num_bytes, self.capacity_bytes
            raise error

    def _note_peak(self, used: int) -> None:
        self.step_peak_bytes = max(self.step_peak_bytes, used)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: a DTensor's local shard, else the tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


class SimulatedDeviceProbe:
    """The step's peak on a :class:`SimulatedDevice` against its capacity (device memory)."""

    cause = Cause.DEVICE_MEMORY

    def __init__(self, device: SimulatedDevice) -> None:
        self.device = device

    def read(self) -> MemoryReading:
        peak = self.device.take_step_peak()
        return MemoryReading(used_bytes=peak, reserved_bytes=peak,
                             total_bytes=self.device.capacity_bytes)
