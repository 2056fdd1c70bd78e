"""Per-batch figures of a GuardedDataLoader: how long the training loop waited for each
batch, and the batch's bytes."""

from __future__ import annotations

from typing import Any


class DataWaitFigures:
    """Running totals over the batches a loader delivered."""

    def __init__(self) -> None:
        self.last_wait_s = 0.0
        self.last_batch_bytes = 0
        self.max_batch_bytes = 0       # of the current epoch (the loader re-plans from it)
        self.num_batches = 0
        self._wait_total_s = 0.0
        self._wait_max_s = 0.0
        self._wall_total_s = 0.0

    def record(self, wait_s: float, wall_s: float, nbytes: int) -> None:
        """One batch: ``wait_s`` in the fetch, ``wall_s`` since the previous batch arrived."""
        self.last_wait_s = wait_s
        self.last_batch_bytes = nbytes
        self.max_batch_bytes = max(self.max_batch_bytes, nbytes)
        self.num_batches += 1
        self._wait_total_s += wait_s
        self._wait_max_s = max(self._wait_max_s, wait_s)
        self._wall_total_s += wall_s

    def to_dict(self) -> dict[str, Any]:
        wall = self._wall_total_s
        return {"batches": self.num_batches, "last_data_wait_s": self.last_wait_s,
                "data_wait_total_s": self._wait_total_s, "data_wait_max_s": self._wait_max_s,
                "wall_total_s": wall,
                "data_wait_frac": self._wait_total_s / wall if wall > 0 else 0.0,
                "last_batch_bytes": self.last_batch_bytes,
                "max_batch_bytes": self.max_batch_bytes}
