"""Spikes in the data (longer sequences, say): micro-batches priced on the card before their
forward, and an oversized one run in pieces within the same optimizer step."""

from __future__ import annotations

import itertools
import logging
import statistics
from collections import deque
from typing import Any

from raytrain_guard.planner.batches import (
    batch_nbytes,
    iter_tensors,
    leading_batch_size,
    map_tensors,
)
from raytrain_guard.planner.memory_model import Strategy
from raytrain_guard.runtime.loop.config import LoopConfig

logger = logging.getLogger(__name__)

#: a batch this many times larger than the median batch so far is a spike in the data
SPIKE_FACTOR = 1.25


def batch_elements(batch: Any) -> int:
    return sum(t.numel() for t in iter_tensors(batch))


class SpikeSplitter:
    """On a ``card`` that prices (a simulated one, or CUDA's allocator): activation bytes per
    batch element are learned from the batches so far (:meth:`learn`); a batch larger than
    those that would take the card past the watermark runs in pieces (:meth:`pieces`), each
    weighted by its samples. Under FSDP every rank runs the same forwards (each gathers and
    scatters with the others): the ranks agree on the most pieces any of them needs, one
    tiny allreduce on ``control`` per micro-batch. ``log``: the decision log."""

    def __init__(self, config: LoopConfig, card: Any, *, world_rank: int, world_size: int,
                 control: Any, timer: Any, log: Any) -> None:
        self.config = config
        self.card = card
        self.rank = world_rank
        self.control = control
        self.timer = timer
        self.log = log
        self.per_elem: float | None = None      # activation bytes per element, the most seen
        self.sizes: deque[int] = deque(maxlen=64)   # elements of the batches seen
        self.pending: list[dict[str, Any]] = []     # this step's splits, measured at its end
        #: the same answer on every rank (config and world size only)
        self.agree = (config.act and world_size > 1
                      and config.strategy not in (Strategy.DDP, Strategy.ZERO1))

    def learn(self, batch: Any) -> None:
        elements = batch_elements(batch)
        if elements:
            self.sizes.append(elements)
            per_elem = self.card.last_activation_bytes / elements
            if self.per_elem is None or per_elem > self.per_elem:
                self.per_elem = per_elem

    def pieces(self, batch: Any, step: int) -> Any:
        """``((batch, 1.0),)``, or the pieces of a spike with their sample weights. A spike
        seen but not split (the guard observes, or no piece fits) is logged now: the step may
        not end."""
        size = leading_batch_size(batch) or 1
        wanted, entry = self._priced(batch, size, step)
        pieces = wanted
        if self.agree:
            start = self.timer.now()
            pieces, smallest = self.control.all_reduce_max(wanted, -size)
            if self.timer.on_host:     # the wait for the others is communication, not compute
                self.timer.record_collective(start, self.timer.now())
            pieces = min(pieces, -smallest)   # no empty piece on any rank
            if pieces > 1 and entry is None:
                entry = self._entry(size, step, f"rank {self.rank} step {step}: another rank's "
                                    f"micro-batch is too large for its card; FSDP ranks run the "
                                    f"same forwards")
        if entry is None:
            return ((batch, 1.0),)
        if pieces <= 1:
            entry["applied"] = False
            entry["reason"] += ("; not split (the guard observes only)" if not self.config.act
                                else "; not split (no room on the card for any piece)")
            self.log.append(entry)
            return ((batch, 1.0),)
        entry["reason"] += f"; run in {pieces} pieces of the same optimizer step"
        entry["params"]["pieces"] = pieces
        held = batch_nbytes(batch)   # on the card in full while its pieces (views) run
        rest = max(0.0, (self.per_elem or 0.0) * batch_elements(batch) - held)
        peak = self.card.base_bytes + held + rest / pieces
        entry["predicted"] = {"peak_frac": round(peak / self.card.capacity_bytes, 4)}
        self.pending.append(entry)
        bounds = [size * i // pieces for i in range(pieces + 1)]
        return tuple((map_tensors(batch, lambda t, lo=lo, hi=hi: t[lo:hi]), (hi - lo) / size)
                     for lo, hi in itertools.pairwise(bounds))

    def measure(self) -> None:
        """The step's measured peak beside each split's prediction, into the log."""
        peak = self.card.step_peak_bytes / self.card.capacity_bytes
        for entry in self.pending:
            entry["measured"] = {"peak_frac": round(peak, 4)}
            self.log.append(entry)
            logger.warning("%s (measured peak %.0f%%)", entry["reason"], 100 * peak)
        self.pending = []

    def _priced(self, batch: Any, size: int, step: int) -> tuple[int, dict | None]:
        """The pieces this rank's batch needs (1: none) and, for a spike past the watermark,
        the entry that says so. Memory that grows under normal batches is the memory rules'."""
        card, per_elem = self.card, self.per_elem
        if per_elem is None:
            return 1, None
        elements = batch_elements(batch)
        if elements <= SPIKE_FACTOR * statistics.median(self.sizes):
            return 1, None
        predicted = per_elem * elements
        watermark = self.config.guard.memory_watermark_frac
        room = card.capacity_bytes * watermark - card.base_bytes
        if predicted <= room:
            return 1, None
        peak_frac = (card.base_bytes + predicted) / card.capacity_bytes
        entry = self._entry(size, step, f"rank {self.rank} step {step}: this micro-batch's "
                            f"activations are priced at {predicted / 2**20:.1f} MiB before its "
                            f"forward ({per_elem:.1f} bytes per element), which takes the card "
                            f"to {peak_frac:.0%} (watermark {watermark:.0%})")
        entry["predicted"] = {"peak_frac": round(peak_frac, 4)}
        held = batch_nbytes(batch)
        if not self.config.act or room <= held:
            return 1, entry
        # the whole batch stays on the card while its pieces run: only the rest divides
        return min(size, max(2, -(-int(predicted - held) // int(room - held)))), entry

    def _entry(self, size: int, step: int, reason: str) -> dict[str, Any]:
        return {"action": "split_micro_batch", "step": step, "applied_at": step,
                "scope": "rank", "cause": "device_memory", "world_rank": self.rank,
                "decision_id": 0, "applied": True, "reason": reason,
                "params": {"pieces": 1, "micro_batch": size}}
