"""The coordinator's hang verdicts: the ranks' watchdog records per attempt, and the hung rank
named from them (:func:`raytrain_guard.core.hang.name_hung_rank`). A settled verdict is logged
once and handed to ``on_settled`` (the metrics)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from raytrain_guard.cluster.coordinator.reports import read_attempt
from raytrain_guard.core.hang import HangRecord, HungRank, name_hung_rank
from raytrain_guard.errors import check_int

logger = logging.getLogger(__name__)

HANG_ATTEMPTS_KEPT = 16     # a run restarts a handful of times


def read_hang_report(world_rank: Any, node_id: Any, attempt: Any,
                     record: Mapping[str, Any]) -> tuple[int, HangRecord]:
    """(attempt, record) of a watchdog's report; ValueError when unreadable."""
    rank = check_int("world_rank", world_rank)
    att = read_attempt(attempt)
    rec = HangRecord.from_dict({**dict(record), "world_rank": rank,
                                "node_id": str(node_id or record.get("node_id") or "")})
    return att, rec


@dataclasses.dataclass(slots=True)
class AttemptHangs:
    """One attempt's hang records (the latest per rank), when the first arrived, and the ranks
    (and their nodes) that reported steps in it."""

    first_at: float
    records: dict[int, HangRecord] = dataclasses.field(default_factory=dict)
    expected: set[int] = dataclasses.field(default_factory=set)
    nodes: dict[int, str] = dataclasses.field(default_factory=dict)
    announced: bool = False


class HangVerdicts:
    """Hang records by attempt (the last :data:`HANG_ATTEMPTS_KEPT`) and their verdicts."""

    def __init__(self, run_id: str, clock: Callable[[], float],
                 on_settled: Callable[[HungRank], None]) -> None:
        self.run_id = run_id
        self._clock = clock
        self._on_settled = on_settled
        self._attempts: dict[int, AttemptHangs] = {}

    def add(self, attempt: int, rec: HangRecord,
            ranks_of_attempt: Mapping[int, str] | None) -> HungRank | None:
        """Keep a rank's record; returns the verdict on its attempt so far.
        ``ranks_of_attempt``: rank -> node of the ranks that reported steps (None: not known)."""
        entry = self._attempts.get(attempt)
        if entry is None:
            entry = self._attempts[attempt] = AttemptHangs(self._clock())
            for old in sorted(self._attempts)[:-HANG_ATTEMPTS_KEPT]:
                del self._attempts[old]
        entry.records[rec.world_rank] = rec
        if ranks_of_attempt is not None:
            entry.expected |= set(ranks_of_attempt)
            entry.nodes.update(ranks_of_attempt)
        logger.warning("[run %s] attempt %d: rank %d's watchdog fired: %s (at %s)", self.run_id,
                       attempt, rec.world_rank, rec.describe(), rec.where or "?")
        return self._verdict(attempt, entry)

    def status(self) -> list[dict]:
        """One verdict per attempt with a hang, oldest first, with its records."""
        out = []
        for att in sorted(self._attempts):
            entry = self._attempts[att]
            verdict = self._verdict(att, entry)
            if verdict is not None:
                out.append({"attempt": att, **verdict.to_dict(), "records": [
                    dataclasses.asdict(entry.records[r]) for r in sorted(entry.records)]})
        return out

    def _verdict(self, attempt: int, entry: AttemptHangs) -> HungRank | None:
        """The verdict on one attempt now; a settled one is logged and handed on once."""
        verdict = name_hung_rank(entry.records.values(), entry.expected,
                                 waited_s=self._clock() - entry.first_at, nodes=entry.nodes)
        if verdict is not None and verdict.settled and not entry.announced:
            entry.announced = True
            logger.warning("[run %s] attempt %d: %s", self.run_id, attempt, verdict.reason)
            self._on_settled(verdict)
        return verdict
