"""What the coordinator takes in: each rank's batches of step rows, kept as a window of columns
per rank, and the newest node sample per node. A report that is unreadable, repeated or late is
refused with one of :data:`IGNORE_REASONS`, never raised past the coordinator."""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import add, lt
from typing import Any

from raytrain_guard.coordination.client import STEP_FIELDS, step_row
from raytrain_guard.core.columns import EMPTY, StepColumns, floats
from raytrain_guard.core.node_samples import NodeSample, RunSetup
from raytrain_guard.core.steps import StepStats
from raytrain_guard.core.view import RankView
from raytrain_guard.errors import check_int

RECENT_BATCHES_KEPT = 8     # per rank, to tell a duplicate batch from a late one

IGNORE_REASONS = ("stale", "duplicate", "out_of_order", "malformed")

Refusal = tuple[str, str]     # (one of IGNORE_REASONS, what was refused)


@dataclass(slots=True)
class StepReport:
    """One rank's batch of steps, checked: steps strictly increasing, figures finite."""

    world_rank: int
    node_id: str
    attempt: int
    columns: StepColumns
    setup: RunSetup | None          # None: the report brought none (the rank's last is kept)


def read_step_report(world_rank: Any, node_id: Any, attempt: Any, stats: Sequence[Any],
                     setup: Mapping[str, Any] | None) -> StepReport:
    """The report checked; ValueError naming what is unreadable. ``stats``: rows in
    ``STEP_FIELDS`` order (what the client sends) or ``StepStats.to_dict()`` dicts."""
    rank = check_int("world_rank", world_rank)
    node, att = str(node_id), read_attempt(attempt)
    if not node:
        raise ValueError("node_id must be non-empty")
    n = len(STEP_FIELDS)
    rows = [x if type(x) is tuple and len(x) == n else _row(x) for x in stats]
    if not rows:
        raise ValueError("an empty batch")
    cols = {name: column for name, column in zip(STEP_FIELDS, zip(*rows))}
    steps = cols["step"]
    if set(map(type, steps)) != {int} or min(steps) < 0:
        for s in steps:
            check_int("step", s)
    if not all(map(lt, steps, steps[1:])):
        raise ValueError("steps in a batch must be strictly increasing")
    _check_figures({name: cols[name] for name in FIGURES})
    _check_figures({"memory_frac": [m for m in cols["memory_frac"] if m is not None]})
    compute = map(add, map(add, cols["forward_s"], cols["backward_s"]), cols["optimizer_s"])
    return StepReport(rank, node, att, StepColumns(
        array("q", steps), array("d", cols["total_s"]), array("d", cols["data_wait_s"]),
        array("d", compute), array("d", cols["comm_wait_s"]), floats(cols["memory_frac"])),
        _read_setup(setup) if setup else None)


def read_attempt(attempt: Any) -> int:
    """An attempt number: any integer (one below the current attempt is stale, not malformed)."""
    return check_int("attempt", attempt, at_least=-(2 ** 63))


_SETUPS: dict[tuple, RunSetup] = {}     # a rank's setup rarely changes: read each one once
_SETUPS_KEPT = 4096


def _read_setup(setup: Mapping[str, Any]) -> RunSetup:
    """``RunSetup.from_dict(setup)``, from the setups already read when it is one of them."""
    try:
        key = tuple(setup.items())
        hash(key)
    except TypeError:               # unhashable values: not a setup this has read
        return RunSetup.from_dict(setup)
    found = _SETUPS.get(key)
    if found is None:
        found = RunSetup.from_dict(setup)
        if len(_SETUPS) >= _SETUPS_KEPT:
            _SETUPS.clear()
        _SETUPS[key] = found
    return found


def _row(row: Any) -> tuple:
    """A step row, or a ``StepStats.to_dict()`` as one."""
    if isinstance(row, (tuple, list)):
        if len(row) != len(STEP_FIELDS):
            raise ValueError(f"a step row has {len(STEP_FIELDS)} fields, got {len(row)}")
        return tuple(row)
    return step_row(StepStats.from_dict(row))


FIGURES = ("total_s", "data_wait_s", "forward_s", "backward_s", "comm_wait_s", "optimizer_s")


def _check_figures(columns: Mapping[str, Sequence[Any]]) -> None:
    """ValueError unless every value is a finite number >= 0 (a bool is not); plain floats and
    ints are checked at once."""
    values = [v for column in columns.values() for v in column]
    if set(map(type, values)) <= {float, int} and min(values, default=0) >= 0 \
            and math.isfinite(sum(values)):
        return
    for name, column in columns.items():
        for v in column:
            if isinstance(v, bool) or not isinstance(v, (int, float)) \
                    or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


class RankWindow:
    """One rank's last ``window_len`` steps (as columns), the batches they came in, and its
    ``RankView``, rebuilt per report so that a policy round costs O(ranks)."""

    __slots__ = ("batches", "columns", "last_step", "node_id", "setup", "view", "window_len",
                 "world_rank")

    def __init__(self, world_rank: int, node_id: str, window_len: int) -> None:
        self.world_rank = world_rank
        self.node_id = node_id
        self.window_len = window_len
        self.columns = EMPTY
        self.setup = RunSetup()
        self.last_step = -1
        self.batches: list[tuple[int, int]] = []   # a short list: no deque block churn
        self.view: RankView | None = None

    def add(self, report: StepReport) -> Refusal | None:
        """Take the report's steps, or say why not (a duplicate, or steps out of order)."""
        c = report.columns
        first, last = c.steps[0], c.steps[-1]
        if (first, last) in self.batches:
            return "duplicate", f"rank {self.world_rank} steps {first}-{last} again"
        if first <= self.last_step:
            return "out_of_order", (f"rank {self.world_rank} steps {first}-{last} after "
                                    f"step {self.last_step}")
        self.batches.append((first, last))
        if len(self.batches) > RECENT_BATCHES_KEPT:
            del self.batches[0]
        self.columns = self.columns.then(c, self.window_len)
        self.last_step = last
        if report.setup is not None:
            self.setup = report.setup
        self.view = RankView(self.world_rank, self.node_id, self.columns, self.setup)
        return None


class NodeSamples:
    """The newest sample of each node with when it arrived (``latest``), and its monitor's last
    ``readings_kept`` host readings (``host_readings``: time, used fraction); a monitor's
    samples carry its epoch (new after a restart: its readings start over) and a sequence
    number."""

    def __init__(self, readings_kept: int = 5) -> None:
        self.latest: dict[str, tuple[NodeSample, float]] = {}   # node -> (sample, received at)
        self._seq: dict[str, tuple[str, int]] = {}              # node -> (epoch, last seq)
        self.host_readings: dict[str, deque[tuple[float, float]]] = {}
        self._readings_kept = readings_kept

    def add(self, sample: NodeSample, now: float) -> Refusal | None:
        """Keep ``sample``, or say why not (a duplicate, or older than the last)."""
        last = self._seq.get(sample.node_id)
        if last is not None and last[0] == sample.monitor_epoch:
            if sample.seq == last[1]:
                return "duplicate", f"node {sample.node_id} sample {sample.seq} again"
            if sample.seq < last[1]:
                return "out_of_order", f"node {sample.node_id} sample {sample.seq} after {last[1]}"
        if last is None or last[0] != sample.monitor_epoch:
            self.host_readings[sample.node_id] = deque(maxlen=self._readings_kept)
        if sample.host is not None:
            self.host_readings[sample.node_id].append((sample.time_s,
                                                       sample.host.memory_used_frac))
        self._seq[sample.node_id] = (sample.monitor_epoch, sample.seq)
        self.latest[sample.node_id] = (sample, now)
        return None

    def fresh(self, now: float, max_age_s: float) -> dict[str, NodeSample]:
        """The samples received at most ``max_age_s`` ago."""
        return {n: s for n, (s, at) in self.latest.items() if now - at <= max_age_s}

    def sample(self, node_id: str) -> NodeSample | None:
        entry = self.latest.get(node_id)
        return None if entry is None else entry[0]
