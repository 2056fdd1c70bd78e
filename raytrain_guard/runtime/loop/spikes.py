"""Batches too large for the card: priced before their forward, run in pieces."""

from __future__ import annotations

import itertools
import logging
import statistics
from typing import Any

from raytrain_guard.core.memory_model import Strategy
from raytrain_guard.runtime.loop.steps import _batch_elements

logger = logging.getLogger("raytrain_guard.runtime.train_loop")



#: a batch this many times larger than the median batch so far is a spike in the data
_SPIKE_FACTOR = 1.25


class SpikesMixin:
    """On a simulated card: activation bytes per batch element are learned from the batches so far;
    a batch larger than those (a spike in the data) that would take the card past the watermark
    runs in pieces within the same optimizer step, each weighted by its samples."""

    def _learn_activations(self, batch: Any) -> None:
        """Activation bytes per batch element, the largest seen: what prices the next batch."""
        elements = _batch_elements(batch)
        if elements:
            self._batch_elements.append(elements)
            per_elem = self.sim_device.last_activation_bytes / elements
            if self._act_per_elem is None or per_elem > self._act_per_elem:
                self._act_per_elem = per_elem

    def _pieces(self, batch: Any) -> Any:
        """``((batch, 1.0),)``, or the batch in ``k`` pieces with their sample weights when it
        is larger than the batches so far (a spike in the data: longer sequences) and its
        activations, priced per element before the forward, would take the card past the
        watermark. Memory that grows under normal batches is the memory rules' to handle (a
        checkpoint before the out-of-memory). Only under DDP or ZeRO-1 (a rank may run extra
        forwards alone there; under FSDP every rank would have to agree first) and only when
        the guard acts."""
        from raytrain_guard.runtime.batches import leading_batch_size, map_tensors

        sim, per_elem = self.sim_device, self._act_per_elem
        if per_elem is None:
            return ((batch, 1.0),)
        elements = _batch_elements(batch)
        if elements <= _SPIKE_FACTOR * statistics.median(self._batch_elements):
            return ((batch, 1.0),)
        predicted = per_elem * elements
        room = sim.capacity_bytes * self.config.guard.memory_watermark_frac - sim.base_bytes
        if predicted <= room:
            return ((batch, 1.0),)
        size = leading_batch_size(batch) or 1
        pieces = min(size, max(2, -(-int(predicted) // max(1, int(room)))))
        fits = self.config.strategy in (Strategy.DDP, Strategy.ZERO1) and room > 0
        predicted_frac = (sim.base_bytes + predicted) / sim.capacity_bytes
        piece_frac = (sim.base_bytes + predicted / pieces) / sim.capacity_bytes
        reason = (f"rank {self.rank} step {self.step}: this micro-batch's activations are "
                  f"priced at {predicted / 2**20:.1f} MiB before its forward ({per_elem:.1f} "
                  f"bytes per element), which takes the card to {predicted_frac:.0%} "
                  f"(watermark {self.config.guard.memory_watermark_frac:.0%})")
        act = self.config.act and fits
        entry = {
            "action": "split_micro_batch", "step": self.step, "applied_at": self.step,
            "scope": "rank", "cause": "device_memory", "world_rank": self.rank,
            "decision_id": 0, "applied": act,
            "reason": reason + (f"; run in {pieces} pieces of the same optimizer step" if act
                                else "; not split (the guard observes only)" if fits else
                                "; not split (FSDP ranks would have to agree)"),
            "params": {"pieces": pieces if act else 1, "micro_batch": size},
            "predicted": {"peak_frac": round(piece_frac if act else predicted_frac, 4)}}
        if not act:                    # seen coming, written down now: the step may not end
            self.decisions.append(entry)
            self._trace_event("decision", **entry)
            return ((batch, 1.0),)
        self._split_pending.append(entry)
        bounds = [size * i // pieces for i in range(pieces + 1)]
        return tuple((map_tensors(batch, lambda t, lo=lo, hi=hi: t[lo:hi]), (hi - lo) / size)
                     for lo, hi in itertools.pairwise(bounds) if hi > lo)

    def _measure_splits(self) -> None:
        """The step's measured peak beside each split's prediction, then into the results."""
        peak = self.sim_device.step_peak_bytes / self.sim_device.capacity_bytes
        for entry in self._split_pending:
            entry["measured"] = {"peak_frac": round(peak, 4)}
            self.decisions.append(entry)
            self._trace_event("decision", **entry)
            logger.warning("%s (measured peak %.0f%%)", entry["reason"], 100 * peak)
        self._split_pending = []
