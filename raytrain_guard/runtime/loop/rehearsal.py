"""What the experiment and rehearsals add to the loop: injected faults, a simulated card, the
hang watchdog, the per-rank trace and the audit of consumed sample ids."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger("raytrain_guard.runtime.train_loop")



_HANG_EXIT_CODE = 75     # EX_TEMPFAIL: the watchdog ended a hung process; Ray restarts the group
#: the least time between a hang being named and the process ending: the other ranks' watchdogs
#: (which check every 0.5 s) name theirs too before this rank's exit breaks their collectives
_HANG_EXIT_PAUSE_S = 1.0


def _fault_injector(faults: Mapping[str, Any], rank: int, factory: Callable[..., Any]) -> Any:
    """``faults = {"delay": [{"seconds", "phase", "ranks", "steps": [lo, hi)}],
    "ballast_bytes": {"<rank>": n}, "memory": [{"rank", "step", "frac"}]}`` -> a FaultInjector
    (None when empty). ``memory`` fills the rank's memory to ``frac`` of its budget at ``step``."""
    if not faults:
        return None
    injector = factory(world_rank=rank)
    for spec in faults.get("delay", ()):
        steps = spec.get("steps")
        injector.delay(float(spec["seconds"]), phase=spec.get("phase", "forward"),
                       ranks=spec.get("ranks"), steps=range(*steps) if steps else None)
    ballast = dict(faults.get("ballast_bytes", {})).get(str(rank))
    if ballast:
        injector.allocate_ballast(int(ballast))
    return injector


class RehearsalMixin:
    """The experiment's seams; all off in a plain run but the watchdog."""

    def _build_faults(self, device: Any) -> None:
        """Injected faults (``faults["inject"]``: FaultSpec dicts) and the card they count on:
        ``device_memory_bytes`` simulates one on CPU and caps the real one on CUDA. The card
        that prices micro-batches (``self.card``): the simulated one, or CUDA's allocator."""
        import torch

        from raytrain_guard.core.faults import FaultSpec
        from raytrain_guard.runtime.faults import FaultRuntime, SimulatedDevice

        cfg = self.config
        if cfg.device_memory_bytes is not None:
            if device.type == "cuda":
                total = torch.cuda.get_device_properties(device).total_memory
                torch.cuda.set_per_process_memory_fraction(
                    min(1.0, cfg.device_memory_bytes / total), device)
            else:
                self.sim_device = SimulatedDevice(cfg.device_memory_bytes, world_rank=self.rank)
        if self.sim_device is not None:
            self.card = self.sim_device
        elif device.type == "cuda" and cfg.split_spikes:
            from raytrain_guard.runtime.cuda_card import CudaCard
            self.card = CudaCard(device, cfg.device_memory_bytes)
        if cfg.faults.get("device_step_s"):
            from raytrain_guard.experiment.device_time import DeviceTime
            self.device_time = DeviceTime(float(cfg.faults["device_step_s"]))
        specs = [FaultSpec.from_dict(d) for d in cfg.faults.get("inject", ())]
        if specs:
            self.fault_runtime = FaultRuntime(
                specs, world_rank=self.rank, marker_dir=cfg.faults.get("marker_dir"),
                device=self.sim_device, torch_device=device, device_time=self.device_time)

    def _trace_event(self, kind: str, **fields: Any) -> None:
        if self._trace is None:
            return
        try:
            self._trace.write(json.dumps({"t": kind, "attempt": self.attempt,
                                          "wall": time.time(), **fields}, default=str) + "\n")
            self._trace.flush()
        except Exception:
            logger.debug("rank %d: trace write failed", self.rank, exc_info=True)

    def _start_watchdog(self) -> None:
        from raytrain_guard.runtime.watchdog import StepWatchdog

        guard = self.config.guard
        try:
            self.watchdog = StepWatchdog(floor_s=guard.hang_floor_s,
                                         step_multiple=guard.hang_step_multiple,
                                         on_hang=self._on_hang, world_rank=self.rank,
                                         node_id=self.ctx.node_id or "",
                                         world_size=self.world_size)
        except Exception:
            logger.warning("rank %d: no hang watchdog", self.rank, exc_info=True)

    def _on_hang(self, record: Mapping[str, Any]) -> None:
        """The watchdog's call (on its thread): write the hang down, send it to the coordinator
        (which names the hung rank from every rank's record), and, when the guard acts, end this
        process so that Ray restarts the group from the last checkpoint (the hung step never
        returns). The send waits at most ``HANG_REPORT_TIMEOUT_S`` (1.5 s): a slow or dead
        coordinator does not hold the exit longer."""
        fired = time.monotonic()
        logger.error("hang: %s", record["reason"])
        self._trace_event("hang", **record, acted=self.config.act)
        verdict = self._report_hang(record)
        if verdict is not None:
            logger.error("hang: the coordinator says so far: %s", verdict.get("reason"))
            self._trace_event("hang_verdict", **verdict)
        if self.config.act:
            time.sleep(max(0.0, _HANG_EXIT_PAUSE_S - (time.monotonic() - fired)))
            logging.shutdown()
            os._exit(_HANG_EXIT_CODE)

    def _report_hang(self, record: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """The record to the decision source's coordinator, when it has one (fail open)."""
        report = getattr(self.config.decision_source, "report_hang", None)
        if not callable(report):
            return None
        try:
            return report(record)
        except Exception:
            logger.warning("rank %d: the hang record did not reach the coordinator", self.rank,
                           exc_info=True)
            return None

    def _fill_memory(self, step: int) -> None:
        """Rehearsal (``faults["memory"]``): hold ballast so this rank's memory reading reaches
        ``frac`` of its budget at ``step``."""
        for spec in [m for m in self.memory_faults if int(m["step"]) == step]:
            if self.guard.probe is None or self.faults is None:
                continue
            # on the rank's device (a CUDA ballast tensor on GPU), counting reserved memory
            self.faults.fill_to(self.guard.probe, float(spec["frac"]), device=self.device)
            logger.warning("rank %d step %d: fault injected: memory filled to %.2f of the "
                           "budget", self.rank, step, float(spec["frac"]))

    def _log_ids(self, step: int, batch: Any) -> None:
        ids = batch.get(self.config.sample_id_key) if isinstance(batch, Mapping) else None
        if ids is None:
            return
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        self._audit.write(json.dumps({"step": step, "epoch": self.loader.epoch, "ids": ids,
                                      "resumed_from": self.resumed_from,
                                      "attempt": self.attempt}) + "\n")
        self._audit.flush()
