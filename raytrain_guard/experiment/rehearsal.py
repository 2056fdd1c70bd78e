"""The experiment's rehearsal of the shared train loop: :func:`build_rehearsal` turns
``LoopConfig.faults`` (``{"inject": [FaultSpec dicts], "marker_dir", "device_step_s",
"node_ids": [the experiment's Ray node ids, node 0 first], "delay":
[{"seconds", "phase", "ranks", "steps": [lo, hi)}], "ballast_bytes": {"<rank>": n}, "memory":
[{"rank", "step", "frac"}]}``) into one rank's
:class:`~raytrain_guard.experiment.injection.FaultRuntime`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from raytrain_guard.coordination.context import current_context
from raytrain_guard.errors import InputError
from raytrain_guard.experiment.card import SimulatedDevice
from raytrain_guard.experiment.device_time import DeviceTime
from raytrain_guard.experiment.faults import FaultSpec
from raytrain_guard.experiment.injection import FaultRuntime
from raytrain_guard.runtime.guard.timing import PHASE_FIELDS

logger = logging.getLogger(__name__)


def build_rehearsal(config: Any, *, world_rank: int, device: Any) -> FaultRuntime:
    """One rank's rehearsal of ``config.faults`` (a :class:`~raytrain_guard.runtime.loop.
    config.LoopConfig`) on ``device``."""
    faults = config.faults
    card = None
    if config.device_memory_bytes is not None and device.type != "cuda":
        card = SimulatedDevice(config.device_memory_bytes, world_rank=world_rank)
    injector = None
    if faults.get("delay") or faults.get("ballast_bytes") or faults.get("memory"):
        injector = FaultInjector(world_rank=world_rank)
        for spec in faults.get("delay", ()):
            steps = spec.get("steps")
            injector.delay(float(spec["seconds"]), phase=spec.get("phase", "forward"),
                           ranks=spec.get("ranks"), steps=range(*steps) if steps else None)
        ballast = dict(faults.get("ballast_bytes", {})).get(str(world_rank))
        if ballast:
            injector.allocate_ballast(int(ballast))
    specs = [FaultSpec.from_dict(d) for d in faults.get("inject", ())]
    return FaultRuntime(
        specs, world_rank=world_rank, node_index=node_index(faults.get("node_ids"))
        if any(s.node is not None for s in specs) else None,
        marker_dir=faults.get("marker_dir"), card=card, torch_device=device,
        device_time=DeviceTime(float(faults["device_step_s"]))
        if faults.get("device_step_s") else None, injector=injector,
        memory=[m for m in faults.get("memory", ()) if int(m.get("rank", 0)) == world_rank])


def node_index(node_ids: Any) -> int | None:
    """This process's node's place in ``node_ids`` (the experiment's nodes in the order the
    driver started them); None where it is not among them."""
    ids, own = list(node_ids or ()), current_context().node_id
    index = ids.index(own) if own in ids else None
    logger.info("rank on Ray node %s: the experiment's node %s", own[:12], index)
    return index


class FaultInjector:
    """Delays in a phase on chosen ranks and steps, and ballast memory. The step guard calls
    :meth:`on_mark` before each phase mark, so an injected delay counts as that phase."""

    def __init__(self, *, world_rank: int = 0, sleep: Callable[[float], None] = time.sleep) -> None:
        self.world_rank = world_rank
        self._sleep = sleep
        self._delays: list[tuple[float, str, frozenset[int] | None, Any]] = []
        self._ballast: list[Any] = []
        self.num_delays = 0

    def delay(self, seconds: float, *, phase: str = "forward",
              ranks: Iterable[int] | None = None, steps: Any = None) -> None:
        """Sleep ``seconds`` at the end of ``phase`` on ``ranks`` (all when None) during
        ``steps`` (a container of step numbers such as ``range(10, 20)``; all when None)."""
        if phase not in PHASE_FIELDS:
            raise InputError("phase", "unknown phase", value=phase,
                             fix=f"use one of {', '.join(sorted(PHASE_FIELDS))}")
        if seconds < 0:
            raise InputError("seconds", "must be >= 0", value=seconds, fix="pass a delay in s")
        self._delays.append((float(seconds), phase,
                             None if ranks is None else frozenset(ranks), steps))

    def on_mark(self, step: int, phase: str) -> None:
        for seconds, d_phase, ranks, steps in self._delays:
            if d_phase != phase or (ranks is not None and self.world_rank not in ranks):
                continue
            if steps is not None and step not in steps:
                continue
            self.num_delays += 1
            self._sleep(seconds)

    def allocate_ballast(self, num_bytes: int, *, device: Any = "cpu") -> None:
        """Hold ``num_bytes`` of resident memory (on a CUDA device, a tensor of that size)."""
        if num_bytes <= 0:
            raise InputError("num_bytes", "must be > 0", value=num_bytes, fix="pass a size")
        if str(device).startswith("cuda"):
            self._ballast.append(torch.ones(num_bytes, dtype=torch.uint8, device=device))
        else:
            self._ballast.append(bytearray(b"\x01") * num_bytes)   # written: resident pages

    def fill_to(self, probe: Any, frac: float, *, device: Any = "cpu") -> int:
        """Allocate ballast until ``probe`` reads about ``frac`` of its total (nothing when it
        reads that much already). Returns the bytes allocated."""
        if not 0 < frac < 1.5:
            raise InputError("frac", "must be in (0, 1.5)", value=frac,
                             fix="pass a fraction of the probe's total, e.g. 0.95")
        reading = probe.read()
        missing = int(frac * reading.total_bytes) - max(reading.used_bytes,
                                                        reading.reserved_bytes)
        if missing > 0:
            self.allocate_ballast(missing, device=device)
        return max(0, missing)
