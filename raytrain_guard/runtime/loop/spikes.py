"""Batches too large for the card: priced before their forward, run in pieces."""

from __future__ import annotations

import itertools
import logging
import statistics
from typing import Any

from raytrain_guard.core.memory_model import Strategy
from raytrain_guard.runtime.batches import batch_nbytes, leading_batch_size, map_tensors
from raytrain_guard.runtime.loop.steps import _batch_elements

logger = logging.getLogger("raytrain_guard.runtime.train_loop")



#: a batch this many times larger than the median batch so far is a spike in the data
_SPIKE_FACTOR = 1.25


class SpikesMixin:
    """On a card that prices (``self.card``: simulated, or CUDA's allocator): activation bytes
    per batch element are learned from the batches so far; a batch larger than those (a spike
    in the data) that would take the card past the watermark runs in pieces within the same
    optimizer step, each weighted by its samples."""

    def _learn_activations(self, batch: Any) -> None:
        """Activation bytes per batch element, the largest seen: what prices the next batch."""
        elements = _batch_elements(batch)
        if elements:
            self._batch_elements.append(elements)
            per_elem = self.card.last_activation_bytes / elements
            if self._act_per_elem is None or per_elem > self._act_per_elem:
                self._act_per_elem = per_elem

    def _pieces(self, batch: Any) -> Any:
        """``((batch, 1.0),)``, or the batch in ``k`` pieces with their sample weights when it
        is larger than the batches so far (a spike in the data: longer sequences) and its
        activations, priced per element before the forward, would take the card past the
        watermark. Memory that grows under normal batches is the memory rules' to handle (a
        checkpoint before the out-of-memory). Only when the guard acts. Under FSDP every rank
        must run the same forwards (each one gathers and scatters with the others): the ranks
        agree on the most pieces any of them needs (:meth:`_agreed_pieces`) and all split."""
        size = leading_batch_size(batch) or 1
        wanted, entry = self._priced_pieces(batch, size)
        pieces = wanted
        if self._split_agreement:
            pieces, smallest = self._agreed_pieces(wanted, size)
            pieces = min(pieces, -smallest)   # no empty piece on any rank
            if pieces > 1 and entry is None:
                entry = self._split_entry(
                    size, f"rank {self.rank} step {self.step}: another rank's micro-batch is "
                          f"too large for its card; FSDP ranks run the same forwards")
        if entry is None:
            return ((batch, 1.0),)
        if pieces <= 1:                # seen coming, not split: written down now (the step
            entry["applied"] = False   # may not end)
            entry["reason"] += ("; not split (the guard observes only)" if not self.config.act
                                else "; not split (no room on the card for any piece)")
            self.decisions.append(entry)
            self._trace_event("decision", **entry)
            return ((batch, 1.0),)
        entry["reason"] += f"; run in {pieces} pieces of the same optimizer step"
        entry["params"]["pieces"] = pieces
        peak_bytes = self.card.base_bytes + self._piece_bytes(batch, pieces)
        entry["predicted"] = {"peak_frac": round(peak_bytes / self.card.capacity_bytes, 4)}
        self._split_pending.append(entry)
        bounds = [size * i // pieces for i in range(pieces + 1)]
        return tuple((map_tensors(batch, lambda t, lo=lo, hi=hi: t[lo:hi]), (hi - lo) / size)
                     for lo, hi in itertools.pairwise(bounds))

    def _agreed_pieces(self, wanted: int, size: int) -> tuple[int, int]:
        """MAX over the ranks of (pieces wanted, -micro-batch size): a collective, so a rank's
        wait for the others is communication, not the forward it precedes (host clock; on
        CUDA the host wait lands in the forward's events)."""
        timer = self.guard.timer
        start = timer.now()
        agreed = self.control.all_reduce_max(wanted, -size)
        if timer.on_host:
            timer.record_collective(start, timer.now())
        return agreed

    @property
    def _split_agreement(self) -> bool:
        """Whether the ranks agree on each micro-batch's pieces: under FSDP, acting, with more
        than one rank. The same answer on every rank (config and world size only)."""
        return (self.config.act and self.config.split_spikes and self.world_size > 1
                and self.config.strategy not in (Strategy.DDP, Strategy.ZERO1))

    def _priced_pieces(self, batch: Any, size: int) -> tuple[int, dict | None]:
        """The pieces this rank's batch needs (1: none) and, for a spike past the watermark,
        the decision entry that says so."""
        card, per_elem = self.card, self._act_per_elem
        if per_elem is None:
            return 1, None
        elements = _batch_elements(batch)
        if elements <= _SPIKE_FACTOR * statistics.median(self._batch_elements):
            return 1, None
        predicted = per_elem * elements
        room = card.capacity_bytes * self.config.guard.memory_watermark_frac - card.base_bytes
        if predicted <= room:
            return 1, None
        entry = self._split_entry(
            size, f"rank {self.rank} step {self.step}: this micro-batch's activations are "
                  f"priced at {predicted / 2**20:.1f} MiB before its forward ({per_elem:.1f} "
                  f"bytes per element), which takes the card to "
                  f"{(card.base_bytes + predicted) / card.capacity_bytes:.0%} (watermark "
                  f"{self.config.guard.memory_watermark_frac:.0%})")
        entry["predicted"] = {"peak_frac": round((card.base_bytes + predicted)
                                                 / card.capacity_bytes, 4)}
        held = batch_nbytes(batch)
        if not self.config.act or room <= held:
            return 1, entry
        # the whole batch stays on the card while its pieces run: only the rest divides
        pieces = max(2, -(-int(predicted - held) // int(room - held)))
        return min(size, pieces), entry

    def _piece_bytes(self, batch: Any, pieces: int) -> float:
        """A piece's activation bytes at its peak: the batch itself (on the card in full, the
        pieces are views of it) and its share of the rest."""
        held = batch_nbytes(batch)
        rest = max(0.0, (self._act_per_elem or 0.0) * _batch_elements(batch) - held)
        return held + rest / pieces

    def _split_entry(self, size: int, reason: str) -> dict:
        return {"action": "split_micro_batch", "step": self.step, "applied_at": self.step,
                "scope": "rank", "cause": "device_memory", "world_rank": self.rank,
                "decision_id": 0, "applied": True, "reason": reason,
                "params": {"pieces": 1, "micro_batch": size}}

    def _measure_splits(self) -> None:
        """The step's measured peak beside each split's prediction, then into the results."""
        peak = self.card.step_peak_bytes / self.card.capacity_bytes
        for entry in self._split_pending:
            entry["measured"] = {"peak_frac": round(peak, 4)}
            self.decisions.append(entry)
            self._trace_event("decision", **entry)
            logger.warning("%s (measured peak %.0f%%)", entry["reason"], 100 * peak)
        self._split_pending = []
