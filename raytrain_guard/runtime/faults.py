"""Injected faults inside a training worker, and a simulated card for CPU runs.

:class:`FaultRuntime` applies the :class:`~raytrain_guard.core.faults.FaultSpec` values of one
rank where a real failure would show: a slower device time, or without one a sleep after
backward (a slow GPU), a delay on the
completion of the DDP allreduce (a slow link), a sleep in the dataset's ``__getitem__`` in the
DataLoader workers (slow storage), device memory held step after step (a leak), longer
sequences in the batch (long documents), a process holding host RAM, a crash, a hang.

:class:`SimulatedDevice` gives a CPU rank a card of a fixed size: the model's parameters,
gradients and optimizer state, the tensors autograd saves in forward (counted through
``torch.autograd.graph.saved_tensors_hooks``) and held fault memory are real tensors counted
against that size, and an allocation past it raises ``torch.OutOfMemoryError`` inside the step,
the exception CUDA raises. :class:`SimulatedDeviceProbe` reads each step's peak from it.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from raytrain_guard.core.decisions import Cause
from raytrain_guard.core.faults import FaultSpec
from raytrain_guard.runtime.batches import map_tensors
from raytrain_guard.runtime.probes import MemoryReading
from raytrain_guard.units import format_bytes

logger = logging.getLogger(__name__)


# -- the simulated card ----------------------------------------------------------------------------

class SimulatedDevice:
    """A card of ``capacity_bytes`` for a CPU rank (see the module docstring).

    ``static_bytes``: parameters + gradients + optimizer state, measured from the tensors
    (:meth:`measure_static`); gradients are counted whole from the start, as they are at the
    peak early in backward. ``held_bytes``: fault memory (:meth:`hold`). Activations: bytes of
    the distinct storages saved for backward while :meth:`tracking` is open.
    """

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
        """Parameters, their gradients (trainable ones, counted whole) and optimizer state:
        this rank's shards under FSDP2 (DTensors count their local part)."""
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

    def release_held(self) -> None:
        self._held.clear()
        self.held_bytes = 0

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        """Count the tensors saved for backward inside the block (forward and backward of one
        micro-batch); they are freed when backward is done, so the count ends at zero."""
        self._storages.clear()
        self.activation_bytes = 0
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                yield
        finally:
            self.last_activation_bytes = self.activation_bytes
            self.activation_bytes = 0
            self._storages.clear()

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
            raise torch.OutOfMemoryError(
                f"simulated card of rank {self.world_rank} is out of memory: tried to allocate "
                f"{format_bytes(num_bytes)} ({what}) with {format_bytes(used)} of "
                f"{format_bytes(self.capacity_bytes)} in use (parameters, gradients and "
                f"optimizer state {format_bytes(self.static_bytes)}, fault memory "
                f"{format_bytes(self.held_bytes)}, activations "
                f"{format_bytes(self.activation_bytes)})")

    def _note_peak(self, used: int) -> None:
        self.step_peak_bytes = max(self.step_peak_bytes, used)

    def new_step(self) -> None:
        """Nothing: the probe takes each step's peak (:meth:`take_step_peak`)."""

    def take_step_peak(self) -> int:
        """The peak since the last call; the next step's peak starts from what is held now."""
        peak, self.step_peak_bytes = self.step_peak_bytes, self.base_bytes
        return peak


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


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


# -- faults ------------------------------------------------------------------------------------------

class InjectedCrash(RuntimeError):
    """The ``crash`` fault: this rank's process fails at its step."""


class SlowDataset(torch.utils.data.Dataset):
    """``dataset`` whose ``__getitem__`` sleeps ``seconds`` while the loop's current step (a
    shared value the loop sets, read in the DataLoader workers) is inside ``spec``'s window."""

    def __init__(self, dataset: Any, spec: FaultSpec, step: Any) -> None:
        self.dataset = dataset
        self.seconds = float(spec.params["seconds"])
        self.spec = spec
        self._step = step

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        if self.spec.active(self._step.value):
            time.sleep(self.seconds)
        return self.dataset[index]


_HOG = """
import os, sys, time
parent = os.getppid()
block = bytearray(b"\\x01") * int(sys.argv[1])   # written: resident pages
while os.getppid() == parent:
    time.sleep(0.5)
"""


class FaultRuntime:
    """The faults of one rank (``specs`` filtered to it), applied at the loop's seams.

    ``marker_dir``: where ``crash`` and ``hang`` leave a marker when they fire, so that they
    fire once per run (a restarted group finds it). ``device``: the rank's
    :class:`SimulatedDevice`, or None on a real card (fault memory is then a tensor there).
    """

    def __init__(self, specs: Sequence[FaultSpec], *, world_rank: int, marker_dir: str | None,
                 device: SimulatedDevice | None = None, torch_device: Any = "cpu",
                 device_time: Any = None, sleep: Any = time.sleep) -> None:
        self.world_rank = world_rank
        self.specs = [s for s in specs if s.on(world_rank)]
        self.marker_dir = marker_dir
        self.device = device
        self.torch_device = torch_device
        self.device_time = device_time
        self._sleep = sleep
        self.step = 0
        self.shared_step = multiprocessing.Value("l", 0, lock=False) if any(
            s.kind == "slow_data" for s in self.specs) else None
        self._held: list[torch.Tensor] = []
        self._hog: subprocess.Popen | None = None
        self._comm_slept_step = -1
        self.num_injected = 0

    def of(self, kind: str) -> list[FaultSpec]:
        return [s for s in self.specs if s.kind == kind]

    # -- seams --------------------------------------------------------------------------------
    def wrap_dataset(self, dataset: Any) -> Any:
        for spec in self.of("slow_data"):
            dataset = SlowDataset(dataset, spec, self.shared_step)
        return dataset

    def begin_step(self, step: int) -> None:
        """At the start of a step: crash, held memory, the host-memory process."""
        self.step = step
        if self.shared_step is not None:
            self.shared_step.value = step
        if self.device_time is not None:      # a slow GPU: its device time stretches
            self.device_time.factor = 1.0
            for spec in self.of("slow_compute"):
                if spec.active(step):
                    self.num_injected += 1
                    self.device_time.factor *= float(spec.params["factor"])
        for spec in self.of("crash"):
            if spec.start == step and self._first_time(spec):
                raise InjectedCrash(f"injected crash on rank {self.world_rank} at step {step}")
        for spec in self.of("memory_growth"):
            if spec.active(step):
                self._hold(int(spec.params["per_step"]))
        for spec in self.of("host_memory"):
            if spec.active(step) and self._hog is None:
                self._start_hog(int(spec.params["size"]))
            elif not spec.active(step) and self._hog is not None and step >= spec.start:
                self.close()

    def transform(self, batch: Any) -> Any:
        """Before the forward: a hang blocks here; a spike makes the batch longer."""
        for spec in self.of("hang"):
            if spec.active(self.step) and self._first_time(spec):
                logger.warning("rank %d step %d: fault injected: hanging", self.world_rank,
                               self.step)
                threading.Event().wait()
        for spec in self.of("activation_spike"):
            if spec.start <= self.step < spec.start + int(spec.params["steps"]):
                self.num_injected += 1
                batch = lengthen(batch, int(spec.params["factor"]))
        return batch

    def after_backward(self, elapsed_s: float) -> None:
        """A slow GPU without a device-time model: forward and backward took ``elapsed_s``;
        make it ``factor`` times."""
        if self.device_time is not None:
            return
        for spec in self.of("slow_compute"):
            if spec.active(self.step):
                self.num_injected += 1
                self._sleep((float(spec.params["factor"]) - 1.0) * elapsed_s)

    def delay_comm(self) -> None:
        """A slow link under FSDP2: the first reduce-scatter of a step while a ``comm_delay``
        is active starts ``seconds`` late (the peers wait for it inside the collective)."""
        seconds = sum(float(s.params["seconds"]) for s in self.of("comm_delay")
                      if s.active(self.step))
        if not seconds or self._comm_slept_step == self.step:
            return
        self._comm_slept_step = self.step
        self.num_injected += 1
        self._sleep(seconds)

    def comm_hook(self) -> Any:
        """A DDP communication hook (allreduce) whose futures complete ``seconds`` late once
        per step while a ``comm_delay`` is active; None without one."""
        specs = self.of("comm_delay")
        if not specs:
            return None
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def delayed_allreduce(state, bucket):  # unannotated: DDP checks hook annotations
            future = allreduce_hook(state, bucket)
            seconds = sum(float(s.params["seconds"]) for s in specs if s.active(self.step))
            if not seconds or self._comm_slept_step == self.step:
                return future
            self._comm_slept_step = self.step
            self.num_injected += 1

            def late(fut: Any) -> Any:
                self._sleep(seconds)
                return fut.value()

            return future.then(late)

        return delayed_allreduce

    # -- helpers -------------------------------------------------------------------------------
    def _hold(self, num_bytes: int) -> None:
        self.num_injected += 1
        if self.device is not None:
            self.device.hold(num_bytes, reason="memory_growth fault")
        else:
            self._held.append(torch.ones(num_bytes, dtype=torch.uint8, device=self.torch_device))

    def _start_hog(self, num_bytes: int) -> None:
        self.num_injected += 1
        logger.warning("rank %d step %d: fault injected: a process holds %s of host RAM",
                       self.world_rank, self.step, format_bytes(num_bytes))
        self._hog = subprocess.Popen([sys.executable, "-c", _HOG, str(num_bytes)])

    def _first_time(self, spec: FaultSpec) -> bool:
        """True the first time in the run (a marker file in ``marker_dir``)."""
        if self.marker_dir is None:
            return True
        path = os.path.join(self.marker_dir, f"fired-{spec.kind}-rank{self.world_rank}-"
                                             f"step{spec.start}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.close(fd)
        self.num_injected += 1
        return True

    def close(self) -> None:
        if self._hog is not None:
            self._hog.kill()
            self._hog.wait()
            self._hog = None


def lengthen(batch: Any, factor: int) -> Any:
    """``batch`` with its sequence dimension ``factor`` times longer: every tensor of two or more
    dimensions whose dimension 1 has the length of the first such tensor's is repeated along
    it (tokens and labels alike; a ``(batch, 1)`` target is left alone)."""
    from raytrain_guard.runtime.batches import iter_tensors

    lengths = [t.shape[1] for t in iter_tensors(batch) if t.dim() >= 2 and t.shape[1] > 1]
    if not lengths:
        return batch
    seq = lengths[0]

    def longer(t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 2 and t.shape[1] == seq:
            return t.repeat(1, factor, *([1] * (t.dim() - 2)))
        return t

    return map_tensors(batch, longer)
