"""What the coordinator takes in: each rank's batches of step rows, checked and kept in a
window per rank, and the node monitors' samples, the newest per node. A report that is
unreadable, repeated or late is refused with one of :data:`IGNORE_REASONS` (the coordinator
counts it), never raised past the coordinator."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from raytrain_guard.core.node_samples import NodeSample, RunSetup
from raytrain_guard.core.policy import RankView
from raytrain_guard.core.steps import StepStats
from raytrain_guard.errors import check_int

STEP_FIELDS = tuple(StepStats.__dataclass_fields__)
"""The order of a step row in a report (``StepStats`` field order): the client sends rows, not
dicts, so a step costs no ``asdict``."""

RECENT_BATCHES_KEPT = 8
"""Per rank, the (first, last) steps of recent batches, to tell a duplicate from a late batch."""

IGNORE_REASONS = ("stale", "duplicate", "out_of_order", "malformed")

Refusal = tuple[str, str]     # (one of IGNORE_REASONS, what was refused)


@dataclass(frozen=True)
class StepReport:
    """One rank's batch of steps, checked: steps strictly increasing, figures finite."""

    world_rank: int
    node_id: str
    attempt: int
    steps: list[StepStats]
    setup: RunSetup | None          # None: the report brought none (the rank's last is kept)


def read_step_report(world_rank: Any, node_id: Any, attempt: Any, stats: Sequence[Any],
                     setup: Mapping[str, Any] | None) -> StepReport:
    """The report checked; ValueError (or InputError) naming what is unreadable."""
    rank = check_int("world_rank", world_rank)
    node, att = str(node_id), read_attempt(attempt)
    if not node:
        raise ValueError("node_id must be non-empty")
    batch = [_checked(_step_stats(row)) for row in stats]
    if not batch:
        raise ValueError("an empty batch")
    steps = [b.step for b in batch]
    if steps != sorted(set(steps)):
        raise ValueError("steps in a batch must be strictly increasing")
    run_setup = RunSetup.from_dict(setup)
    return StepReport(rank, node, att, batch, run_setup if setup else None)


def read_attempt(attempt: Any) -> int:
    """An attempt number: any integer, since one below the current attempt is stale (counted
    as such), not malformed."""
    return check_int("attempt", attempt, at_least=-(2 ** 63))


class RankWindow:
    """One rank's recent steps (``window``), the batches they came in, and its
    :class:`~raytrain_guard.core.policy.RankView`, rebuilt per report so that a policy round
    and the summaries cost O(ranks)."""

    __slots__ = ("batches", "last_step", "node_id", "num_steps", "setup", "view", "window",
                 "world_rank")

    def __init__(self, world_rank: int, node_id: str, window_len: int) -> None:
        self.world_rank = world_rank
        self.node_id = node_id
        self.window: deque[StepStats] = deque(maxlen=window_len)
        self.setup = RunSetup()
        self.last_step = -1
        self.batches: list[tuple[int, int]] = []   # a short list: no deque block churn
        self.num_steps = 0
        self.view: RankView | None = None

    def add(self, report: StepReport) -> Refusal | None:
        """Take the report's steps, or say why not: a batch already received, or steps at or
        before ones already received."""
        first, last = report.steps[0].step, report.steps[-1].step
        if (first, last) in self.batches:
            return "duplicate", f"rank {self.world_rank} steps {first}-{last} again"
        if first <= self.last_step:
            return "out_of_order", (f"rank {self.world_rank} steps {first}-{last} after "
                                    f"step {self.last_step}")
        self.batches.append((first, last))
        if len(self.batches) > RECENT_BATCHES_KEPT:
            del self.batches[0]
        self.window.extend(report.steps)
        self.last_step = last
        self.num_steps += len(report.steps)
        if report.setup is not None:
            self.setup = report.setup
        self.view = RankView(self.world_rank, self.node_id, tuple(self.window), self.setup)
        return None


class NodeSamples:
    """The newest sample of each node with when it arrived (``latest``); a monitor's samples
    carry its epoch (a restarted monitor starts a new one) and a sequence number."""

    def __init__(self) -> None:
        self.latest: dict[str, tuple[NodeSample, float]] = {}   # node -> (sample, received at)
        self._seq: dict[str, tuple[str, int]] = {}              # node -> (epoch, last seq)

    def add(self, sample: NodeSample, now: float) -> Refusal | None:
        """Keep ``sample``, or say why not: one already received, or older than the last."""
        last = self._seq.get(sample.node_id)
        if last is not None and last[0] == sample.monitor_epoch:
            if sample.seq == last[1]:
                return "duplicate", f"node {sample.node_id} sample {sample.seq} again"
            if sample.seq < last[1]:
                return "out_of_order", f"node {sample.node_id} sample {sample.seq} after {last[1]}"
        self._seq[sample.node_id] = (sample.monitor_epoch, sample.seq)
        self.latest[sample.node_id] = (sample, now)
        return None

    def fresh(self, now: float, max_age_s: float) -> dict[str, NodeSample]:
        """The samples received at most ``max_age_s`` ago."""
        return {n: s for n, (s, at) in self.latest.items() if now - at <= max_age_s}

    def sample(self, node_id: str) -> NodeSample | None:
        entry = self.latest.get(node_id)
        return None if entry is None else entry[0]


def _checked(s: StepStats) -> StepStats:
    """The stats unchanged, or ValueError when a field is not a finite, non-negative number."""
    check_int("step", s.step)
    for name in ("total_s", "data_wait_s", "forward_s", "backward_s", "comm_wait_s",
                 "optimizer_s", "memory_frac"):
        v = getattr(s, name)
        if v is None and name == "memory_frac":
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    return s


def _step_stats(row: Any) -> StepStats:
    """A step row (:data:`STEP_FIELDS` order) or a ``StepStats.to_dict()``, as StepStats."""
    if isinstance(row, (tuple, list)):
        if len(row) != len(STEP_FIELDS):
            raise ValueError(f"a step row has {len(STEP_FIELDS)} fields, got {len(row)}")
        return StepStats(*row)
    return StepStats.from_dict(row)
