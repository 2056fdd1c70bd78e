"""One rank's record of its run: the decision log, the trace and the audit of sample ids."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)


class RunRecorder:
    """``decisions``: every decision of this rank, applied or not (the results' ``decisions``;
    :meth:`append` is the step boundary's log). The trace (``trace_dir``): JSON lines of the
    start, steps, decisions, a hang, the end or the error, tagged with :attr:`attempt` (this
    process's try at the run). The audit (``audit_dir``): the sample ids each step consumed."""

    def __init__(self, *, trace_dir: str | None, audit_dir: str | None, world_rank: int,
                 sample_id_key: str = "id") -> None:
        self.rank = world_rank
        self.decisions: list[dict[str, Any]] = []
        self.attempt = f"{os.getpid()}-{time.time_ns() % 10**12}"
        self._dirs = (trace_dir, audit_dir)
        self._id_key = sample_id_key
        self.trace: Any = None
        self.audit: Any = None

    def open(self) -> None:
        self.trace, self.audit = (_open(d, self.rank) for d in self._dirs)

    def append(self, entry: dict[str, Any]) -> None:
        """A decision's entry, into the log and the trace."""
        self.decisions.append(entry)
        if self.trace is not None:
            self.event("decision", **entry)

    def event(self, kind: str, **fields: Any) -> None:
        if self.trace is None:
            return
        try:
            self.trace.write(json.dumps({"t": kind, "attempt": self.attempt,
                                         "wall": time.time(), **fields}, default=str) + "\n")
            self.trace.flush()
        except Exception:
            logger.debug("rank %d: trace write failed", self.rank, exc_info=True)

    def steps(self, stats: list, **layout: Any) -> None:
        """StepStats into the trace, with the batch ``layout`` they ran with."""
        for s in stats:
            self.event("step", step=s.step, memory_frac=s.memory_frac, **{
                k: None if v is None else round(v, 6) for k, v in (
                    ("total_s", s.total_s), ("data_wait_s", s.data_wait_s),
                    ("compute_s", s.compute_s), ("comm_wait_s", s.comm_wait_s),
                    ("peer_work_s", s.peer_work_s))}, **layout)

    def sample_ids(self, step: int, epoch: int, batch: Any, resumed_from: int | None) -> None:
        ids = batch.get(self._id_key) if isinstance(batch, Mapping) else None
        if ids is None:
            return
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        self.audit.write(json.dumps({"step": step, "epoch": epoch, "ids": ids,
                                     "resumed_from": resumed_from,
                                     "attempt": self.attempt}) + "\n")
        self.audit.flush()

    def close(self) -> None:
        for f in (self.trace, self.audit):
            if f is not None:
                f.close()
        self.trace = self.audit = None


def _open(directory: str | None, rank: int) -> Any:
    if not directory:
        return None
    os.makedirs(directory, exist_ok=True)
    return open(os.path.join(directory, f"rank{rank}.jsonl"), "a")
