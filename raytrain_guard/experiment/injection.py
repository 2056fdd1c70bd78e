"""Injected faults inside a training worker: :class:`FaultRuntime`, the shared train loop's
rehearsal (:class:`~raytrain_guard.runtime.loop.rehearsal.Rehearsal`), applies one rank's
:class:`~raytrain_guard.experiment.faults.FaultSpec` values where a real failure would show
(docs/experiment.md, "Faults").
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from raytrain_guard.experiment.card import SimulatedDevice, SimulatedDeviceProbe
from raytrain_guard.experiment.faults import FaultSpec
from raytrain_guard.planner.batches import iter_tensors, map_tensors
from raytrain_guard.runtime.host_memory import host_memory
from raytrain_guard.runtime.loop.rehearsal import Rehearsal
from raytrain_guard.units import format_bytes

logger = logging.getLogger(__name__)


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
import os, sys
try:
    with open("/proc/self/oom_score_adj", "w") as fh:
        fh.write("0")
except OSError:
    pass
blocks = []
while True:
    line = sys.stdin.readline()         # a size to hold, each step; "" once the rank is gone
    if not line:
        break
    while len(blocks) * (1 << 20) < int(line):
        blocks.append(bytearray(b"\\x01") * (1 << 20))   # written: resident pages
"""


class FaultRuntime(Rehearsal):
    """The faults of one rank (``specs`` filtered to it), applied at the loop's seams.

    ``marker_dir``: where ``crash`` and ``hang`` leave a marker when they fire, so that they
    fire once per run. ``card``: the rank's simulated card, where fault memory is held (None: a
    tensor on ``torch_device``). ``injector``: a
    :class:`~raytrain_guard.experiment.rehearsal.FaultInjector` for phase delays and for
    ``memory`` (``{"step", "frac"}``: the memory probe filled to ``frac`` at ``step``).
    ``node_index``: the experiment's node this rank runs on (None: not known), for the faults
    scoped to a node; of a node's ``host_memory``, one rank of the node holds the RAM (a lock
    in ``marker_dir``).
    """

    def __init__(self, specs: Sequence[FaultSpec], *, world_rank: int, marker_dir: str | None,
                 card: SimulatedDevice | None = None, torch_device: Any = "cpu",
                 device_time: Any = None, injector: Any = None, memory: Sequence[Any] = (),
                 sleep: Any = time.sleep, node_index: int | None = None) -> None:
        self.world_rank = world_rank
        self.node_index = node_index
        self.specs = [s for s in specs if s.on(world_rank, node_index)]
        self._node_locks: dict[str, int] = {}       # lock file name -> its open fd
        self._kinds: dict[str, list[FaultSpec]] = {}
        for spec in self.specs:
            self._kinds.setdefault(spec.kind, []).append(spec)
        self.marker_dir = marker_dir
        self.card = card
        self.torch_device = torch_device
        self.device_time = device_time
        self.marks = self.injector = injector
        self.memory = list(memory)
        self._sleep = sleep
        self.step = 0
        self.shared_step = multiprocessing.Value("l", 0, lock=False) if self.of("slow_data") \
            else None
        self._held: list[torch.Tensor] = []
        self._hog: subprocess.Popen | None = None
        self._hog_from = 0
        self._hog_size = 0
        self._comm_slept_step = -1
        self.num_injected = 0

    def of(self, kind: str) -> list[FaultSpec]:
        return self._kinds.get(kind, [])

    @property
    def num_applied(self) -> int:
        return self.num_injected + (self.injector.num_delays if self.injector else 0)

    # -- the rehearsal's hooks ---------------------------------------------------------------
    def probe(self) -> Any:
        return SimulatedDeviceProbe(self.card) if self.card is not None else None

    def wrap_dataset(self, dataset: Any) -> Any:
        for spec in self.of("slow_data"):
            dataset = SlowDataset(dataset, spec, self.shared_step)
        return dataset

    def attach(self, model: Any) -> None:
        if self.device_time is not None:
            self.device_time.attach(model)

    def measure(self, module: Any, optimizer: Any) -> None:
        if self.card is not None:
            self.card.measure_static(module, optimizer)

    def begin_step(self, step: int, probe: Any = None) -> None:
        """At the start of a step: the device time, a crash, held memory, the host-memory
        process, memory fills."""
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
            if spec.active(step) and (self._hog is not None or self._holds_node_ram(spec)):
                self._hold_host_memory(spec, step)
            elif not spec.active(step) and self._hog is not None and step >= spec.start:
                self.close()
        for fill in self.memory:
            if int(fill["step"]) == step and probe is not None and self.injector is not None:
                # on the rank's device (a CUDA ballast tensor on GPU), counting reserved memory
                self.injector.fill_to(probe, float(fill["frac"]), device=self.torch_device)
                logger.warning("rank %d step %d: fault injected: memory filled to %.2f of the "
                               "budget", self.world_rank, step, float(fill["frac"]))

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

    def _comm_delay_s(self) -> float:
        """The delay of this step's first communication while a ``comm_delay`` is active; 0
        for the step's later ones."""
        seconds = sum(float(s.params["seconds"]) for s in self.of("comm_delay")
                      if s.active(self.step))
        if not seconds or self._comm_slept_step == self.step:
            return 0.0
        self._comm_slept_step = self.step
        self.num_injected += 1
        return seconds

    def delay_comm(self) -> None:
        """A slow link under FSDP2: the step's first reduce-scatter starts late (the peers wait
        for it inside the collective)."""
        seconds = self._comm_delay_s()
        if seconds:
            self._sleep(seconds)

    def comm_hook(self) -> Any:
        """A DDP communication hook (allreduce) whose future completes late once per step while
        a ``comm_delay`` is active; None without one."""
        if not self.of("comm_delay"):
            return None
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def delayed_allreduce(state, bucket):  # unannotated: DDP checks hook annotations
            future = allreduce_hook(state, bucket)
            seconds = self._comm_delay_s()
            if not seconds:
                return future

            def late(fut: Any) -> Any:
                self._sleep(seconds)
                return fut.value()

            return future.then(late)

        return delayed_allreduce

    def _hold(self, num_bytes: int) -> None:
        self.num_injected += 1
        if self.card is not None:
            self.card.hold(num_bytes, reason="memory_growth fault")
        else:
            self._held.append(torch.ones(num_bytes, dtype=torch.uint8, device=self.torch_device))

    def _hold_host_memory(self, spec: FaultSpec, step: int) -> None:
        """The ``host_memory`` process holds ``size`` of RAM from the step it started (in this
        process: a restarted group starts over), or with ``frac`` as much as fills this host
        (the tightest cgroup over the process) to that fraction, if more; and ``per_step``
        more at each later step. It is not a Ray worker, so the kernel's OOM killer picks a
        Ray worker before it (Ray sets theirs to oom_score_adj 1000)."""
        size, per_step = int(spec.params["size"]), int(spec.params["per_step"])
        frac = float(spec.params["frac"])
        if self._hog is None:
            self._hog_from = step
            if frac:
                total, available = host_memory()
                self._hog_size = max(size, int(frac * total) - (total - available))
            else:
                self._hog_size = size
            self._hog = subprocess.Popen([sys.executable, "-c", _HOG], stdin=subprocess.PIPE,
                                         text=True)
            logger.warning("rank %d step %d: fault injected: a process holds %s of host RAM%s",
                           self.world_rank, step, format_bytes(self._hog_size),
                           f", {format_bytes(per_step)} more a step" if per_step else "")
        held = self._hog_size + per_step * (step - self._hog_from)
        self.num_injected += 1
        try:
            self._hog.stdin.write(f"{held}\n")
            self._hog.stdin.flush()
        except OSError:                  # it was killed (by the OOM killer): training goes on
            pass

    def _holds_node_ram(self, spec: FaultSpec) -> bool:
        """Whether this rank holds ``spec``'s RAM: every rank of a rank fault; of a node fault,
        the one rank of the node that takes its lock in ``marker_dir`` (held while this
        process lives, so a restarted group's rank takes it again)."""
        if spec.node is None or self.marker_dir is None:
            return True
        name = f"holds-{spec.kind}-node{spec.node}-step{spec.start}"
        fd = self._node_locks.get(name)
        if fd is None:
            fd = self._node_locks[name] = os.open(os.path.join(self.marker_dir, name),
                                                  os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False          # another rank of the node holds it
        return True

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
            with contextlib.suppress(OSError):
                self._hog.stdin.close()
            self._hog.kill()
            self._hog.wait()
            self._hog = None
        for fd in self._node_locks.values():
            os.close(fd)                              # releases the node's lock
        self._node_locks.clear()


def lengthen(batch: Any, factor: int) -> Any:
    """``batch`` with its sequence dimension ``factor`` times longer: every tensor of two or more
    dimensions whose dimension 1 has the length of the first such tensor's is repeated along
    it (tokens and labels alike; a ``(batch, 1)`` target is left alone)."""
    lengths = [t.shape[1] for t in iter_tensors(batch) if t.dim() >= 2 and t.shape[1] > 1]
    if not lengths:
        return batch
    seq = lengths[0]

    def longer(t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 2 and t.shape[1] == seq:
            return t.repeat(1, factor, *([1] * (t.dim() - 2)))
        return t

    return map_tensors(batch, longer)
