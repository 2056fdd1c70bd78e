"""Coordinator: one per run; collects step statistics and node samples, decides cluster actions.

A plain class; ``raytrain_guard.cluster.actors.start_coordinator`` makes it the Ray actor
``raytrain_guard:coordinator:<run id>`` with ``max_restarts``. Its state is only what the
reports told it, so a restarted coordinator rebuilds itself from the next reports.

Actor methods (stable; the worker client, the monitors and the status CLI call them):

* ``next_attempt() -> int``: rank 0 of a starting worker group asks for its attempt number
  (one larger than any this coordinator issued or saw); the ranks agree on it and report with it.
* ``report_steps(world_rank, node_id, attempt, stats, setup=None) -> None``: a batch of one
  rank's step figures (every ``report_every_steps`` steps, fire-and-forget), each a row in
  :data:`STEP_FIELDS` order (what the client sends) or a ``StepStats.to_dict()``.
  ``setup``: ``{"micro_batch", "grad_accum", "prefetch_factor"}`` as the rank runs now.
  ``decision_cursor``: the newest decision id the rank knows of (new ids are made larger).
* ``report_node(sample) -> None``: a monitor's ``NodeSample.to_dict()``.
* ``decide(next_apply_step=None) -> list[dict]``: one policy round now (otherwise rounds run by
  themselves on reports, at most every ``decision_interval_s``); the new decisions.
* ``decisions_since(decision_id) -> list[dict]``: decisions with a larger id, oldest first.
* ``status() -> dict``: nodes, ranks, memory, step time p50/p99, straggler scores, active
  decisions, counters of ignored reports (what ``raytrain-guard status`` prints).
* ``ping() -> str``.

Ignored and counted (``status()["ignored"]``): ``stale`` (an earlier attempt of the run, or
one this coordinator did not issue), ``duplicate`` (a batch already received), ``out_of_order``
(steps at or before ones already received from that rank), ``malformed`` (unreadable).

Attempts use no clock. The coordinator persists nothing, so after a restart it adopts the
largest attempt the reports carry, until it issues one itself: from then on only the attempt it
issued last is current (a larger one comes from a group that died before the restart). A new
attempt (issued, or adopted from a report) clears rank windows and policy state; node samples
are kept.

Decision ids grow across restarts: they start from the wall clock in microseconds and, since a
restarted coordinator may run on a node whose clock is behind, jump past the newest id any rank
reports knowing (``decision_cursor``) before the next decision, so a rank's cursor from before
a restart never hides the new coordinator's decisions.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections import Counter, deque
from typing import Any, Callable, Mapping, Sequence

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Decision
from raytrain_guard.core.node_samples import NodeSample, RunSetup
from raytrain_guard.core.policy import (ClusterView, PolicyState, RankView, decide,
                                        default_apply_step)
from raytrain_guard.core.stats import nearest_rank
from raytrain_guard.core.steps import StepStats
from raytrain_guard.core.straggler import StragglerScore

STEP_FIELDS = tuple(StepStats.__dataclass_fields__)
"""The order of a step row in a report (``StepStats`` field order): the client sends rows, not
dicts, so a step costs no ``asdict``."""

logger = logging.getLogger(__name__)

MAX_DECISIONS_KEPT = 1000
"""Decisions kept for ``decisions_since``; older ones are dropped (ranks poll every N steps)."""
RECENT_BATCHES_KEPT = 8
"""Per rank, the (first, last) steps of recent batches, to tell a duplicate from a late batch."""

IGNORE_REASONS = ("stale", "duplicate", "out_of_order", "malformed")


class _Rank:
    __slots__ = ("node_id", "window", "setup", "last_step", "batches", "num_steps", "view")

    def __init__(self, node_id: str, window_len: int) -> None:
        self.node_id = node_id
        self.window: deque[StepStats] = deque(maxlen=window_len)
        self.setup = RunSetup()
        self.last_step = -1
        self.batches: list[tuple[int, int]] = []   # a short list: no deque block churn
        self.num_steps = 0
        self.view: RankView | None = None   # rebuilt per report: summaries off the round


class Coordinator:
    """The run's coordinator (plain class; see the module docstring for its actor methods).

    ``apply_step_rule(latest_step, config) -> int`` chooses the step decisions apply at (the
    lockstep layer's rule; default :func:`~raytrain_guard.core.policy.default_apply_step`).
    ``clock`` paces policy rounds and ages node samples; ``wall_clock`` seeds decision ids.
    """

    def __init__(self, run_id: str, config: GuardConfig | None = None, *,
                 attempt: int = 0, metrics: Any = None,
                 apply_step_rule: Callable[[int, GuardConfig], int] = default_apply_step,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.run_id = str(run_id)
        self.config = config or GuardConfig()
        self.attempt = int(attempt)
        self._issued_attempt = False     # True once this incarnation issued an attempt
        self._metrics = metrics
        self._apply_step_rule = apply_step_rule
        self._clock = clock
        self._ranks: dict[int, _Rank] = {}
        self._nodes: dict[str, tuple[NodeSample, float]] = {}   # node -> (sample, received at)
        self._node_seq: dict[str, tuple[str, int]] = {}          # node -> (epoch, last seq)
        self._state = PolicyState()
        self._scores: Mapping[int, StragglerScore] = {}
        self._notes: tuple[str, ...] = ()
        self._decisions: deque[Decision] = deque(maxlen=MAX_DECISIONS_KEPT)
        self._next_id = int(wall_clock() * 1e6)
        self.incarnation = uuid.uuid4().hex[:12]   # changes when the actor restarts
        self._last_round = clock()   # first round one interval after start
        self.ignored: Counter[str] = Counter({r: 0 for r in IGNORE_REASONS})
        self.num_reports = 0
        self.num_node_samples = 0
        self.num_rounds = 0
        self._warned: set[str] = set()

    # -- reports -----------------------------------------------------------------------------
    def report_steps(self, world_rank: int, node_id: str, attempt: int,
                     stats: Sequence[Any], setup: Mapping[str, Any] | None = None,
                     decision_cursor: int | None = None) -> None:
        """One rank's batch of step rows (or StepStats dicts). Never raises: bad reports are
        counted."""
        try:
            rank, node, att = _int(world_rank), str(node_id), _int(attempt)
            if decision_cursor is not None:
                self._next_id = max(self._next_id, _int(decision_cursor))
            if not node or rank < 0:
                raise ValueError("world_rank must be >= 0 and node_id non-empty")
            batch = [_checked(_step_stats(row)) for row in stats]
            if not batch:
                raise ValueError("an empty batch")
            steps = [b.step for b in batch]
            if steps != sorted(set(steps)):
                raise ValueError("steps in a batch must be strictly increasing")
            run_setup = RunSetup.from_dict(setup)
        except Exception as exc:  # noqa: BLE001 - whatever arrives, count it and go on
            self._ignore("malformed", f"report from rank {world_rank!r}: {exc}")
            return
        if att < self.attempt:
            self._ignore("stale", f"rank {rank} attempt {att} < {self.attempt}")
            return
        if att > self.attempt:
            if self._issued_attempt:
                self._ignore("stale", f"rank {rank} attempt {att}: not issued by this "
                                      f"coordinator (issued {self.attempt})")
                return
            self._new_attempt(att)
        entry = self._ranks.get(rank)
        if entry is None or entry.node_id != node:
            entry = self._ranks[rank] = _Rank(node, self.config.step_window)
        key = (steps[0], steps[-1])
        if key in entry.batches:
            self._ignore("duplicate", f"rank {rank} steps {key[0]}-{key[1]} again")
            return
        if steps[0] <= entry.last_step:
            self._ignore("out_of_order", f"rank {rank} steps {key[0]}-{key[1]} after "
                                         f"step {entry.last_step}")
            return
        entry.batches.append(key)
        if len(entry.batches) > RECENT_BATCHES_KEPT:
            del entry.batches[0]
        entry.window.extend(batch)
        entry.last_step = steps[-1]
        entry.num_steps += len(batch)
        entry.setup = run_setup if setup else entry.setup
        entry.view = RankView(rank, node, tuple(entry.window), entry.setup)
        self.num_reports += 1
        self._maybe_decide()

    def report_node(self, sample: Mapping[str, Any]) -> None:
        """A node monitor's sample dict. Never raises: bad or old samples are counted."""
        try:
            s = NodeSample.from_dict(sample)
        except Exception as exc:  # noqa: BLE001
            self._ignore("malformed", f"node sample: {exc}")
            return
        last = self._node_seq.get(s.node_id)
        if last is not None and last[0] == s.monitor_epoch:
            if s.seq == last[1]:
                self._ignore("duplicate", f"node {s.node_id} sample {s.seq} again")
                return
            if s.seq < last[1]:
                self._ignore("out_of_order", f"node {s.node_id} sample {s.seq} after {last[1]}")
                return
        self._node_seq[s.node_id] = (s.monitor_epoch, s.seq)
        self._nodes[s.node_id] = (s, self._clock())
        self.num_node_samples += 1
        self._maybe_decide()

    def next_attempt(self) -> int:
        """A new attempt number for a starting worker group (its rank 0 asks): one larger than
        any attempt issued or seen. Rank state is cleared; reports of other attempts are stale
        from now on."""
        self._issued_attempt = True
        self._new_attempt(self.attempt + 1)
        return self.attempt

    # -- decisions ---------------------------------------------------------------------------
    def decide(self, next_apply_step: int | None = None) -> list[dict]:
        """Run one policy round now; returns the new decisions as dicts."""
        view = self._view()
        latest = view.latest_step
        if latest is None and next_apply_step is None:
            return []
        at = next_apply_step if next_apply_step is not None else \
            self._apply_step_rule(latest, self.config)
        self._last_round = self._clock()
        self.num_rounds += 1
        outcome = decide(view, self._state, self.config, at)
        self._state, self._scores, self._notes = outcome.state, outcome.scores, outcome.notes
        new = []
        for d in outcome.decisions:
            self._next_id += 1
            d = Decision(d.action, d.reason, d.step, d.cause, d.scope, dict(d.params),
                         self._next_id)
            self._decisions.append(d)
            new.append(d.to_dict())
            log = logger.warning if d.action in (Action.CHECKPOINT_AND_STOP,
                                                 Action.FLAG_STRAGGLER) else logger.info
            log("[run %s] decision #%d %s", self.run_id, d.decision_id, d)
            if self._metrics is not None:
                self._safe_metrics(lambda: self._metrics.record_decision(d))
        for note in outcome.notes:
            self._warn_once(note, note)
        if self._metrics is not None:
            p50, p99 = self._round_step_quantiles()
            self._safe_metrics(lambda: self._metrics.record_round(
                self._scores, {r: e.node_id for r, e in self._ranks.items()},
                self._state.flagged_nodes, set(self._nodes), p50, p99))
        return new

    def decisions_since(self, decision_id: int) -> list[dict]:
        """Decisions with an id greater than ``decision_id``, oldest first."""
        return [d.to_dict() for d in self._decisions if d.decision_id > decision_id]

    def _maybe_decide(self) -> None:
        if self._clock() - self._last_round >= self.config.decision_interval_s:
            try:
                self.decide()
            except Exception as exc:  # noqa: BLE001 - a policy bug must not stop reports
                self._warn_once("policy", f"policy round failed ({exc!r}); decisions paused")

    def _view(self) -> ClusterView:
        max_age = self.config.node_sample_max_age_intervals * self.config.monitor_interval_s
        now = self._clock()
        nodes = {n: s for n, (s, at) in self._nodes.items() if now - at <= max_age}
        ranks = {r: e.view for r, e in self._ranks.items() if e.view is not None}
        return ClusterView(ranks, nodes)

    def _new_attempt(self, attempt: int) -> None:
        logger.info("[run %s] attempt %d starts (was %d): rank state cleared", self.run_id,
                    attempt, self.attempt)
        self.attempt = attempt
        self._ranks.clear()
        self._state = PolicyState()
        self._scores = {}

    # -- status ------------------------------------------------------------------------------
    def status(self) -> dict:
        """Nodes, ranks, memory, step time p50/p99, straggler scores, active decisions, counters."""
        latest = max((e.last_step for e in self._ranks.values()), default=None)
        p50, p99 = self._step_quantiles()
        nodes = {}
        for node_id, (s, _at) in self._nodes.items():
            d = s.to_dict()
            if s.host is not None:
                d["host"]["memory_used_frac"] = round(s.host.memory_used_frac, 4)
            for g, gd in zip(s.gpus, d["gpus"]):
                gd["memory_frac"] = round(g.memory_frac, 4)
            d["throttled"] = any(g.is_throttled for g in s.gpus)
            d["straggler"] = node_id in self._state.flagged_nodes
            nodes[node_id] = d
        ranks = {}
        for r in sorted(self._ranks):
            e = self._ranks[r]
            totals = [s.total_s for s in e.window]
            mem = next((s.memory_frac for s in reversed(e.window) if s.memory_frac is not None),
                       None)
            score = self._scores.get(r)
            ranks[r] = {"world_rank": r, "node_id": e.node_id, "step": e.last_step,
                        "step_p50_s": _quantile(totals, 0.5), "step_p99_s": _quantile(totals, 0.99),
                        "memory_frac": mem,
                        "straggler_score": None if score is None else round(score.excess_frac, 4),
                        "straggler_cause": None if score is None else score.cause.value}
        horizon = latest if latest is not None else -1
        active = [d.to_dict() for d in self._decisions
                  if d.step is None or d.step >= horizon or d.action in
                  (Action.CHECKPOINT_AND_STOP, Action.FLAG_STRAGGLER)][-20:]
        return {"run_id": self.run_id, "attempt": self.attempt, "latest_step": latest,
                "incarnation": self.incarnation,
                "step_p50_s": p50, "step_p99_s": p99, "nodes": nodes, "ranks": ranks,
                "straggler_scores": {r: s.to_dict() for r, s in sorted(self._scores.items())},
                "straggler_nodes": sorted(self._state.flagged_nodes),
                "active_decisions": active, "notes": list(self._notes),
                "ignored": dict(self.ignored), "num_reports": self.num_reports,
                "num_node_samples": self.num_node_samples, "num_rounds": self.num_rounds}

    def _round_step_quantiles(self) -> tuple[float | None, float | None]:
        """For the per-round gauges, from the per-report summaries (O(ranks), not O(steps)):
        p50 is the median of the ranks' median step, p99 the 99th percentile of their p99s.
        ``status()`` gives the exact quantiles over every step in the windows."""
        views = [e.view.timing for e in self._ranks.values() if e.view is not None]
        return (_quantile([t.total_s for t in views], 0.5),
                _quantile([t.total_p99_s for t in views], 0.99))

    def _step_quantiles(self) -> tuple[float | None, float | None]:
        totals = [s.total_s for e in self._ranks.values() for s in e.window]
        return _quantile(totals, 0.5), _quantile(totals, 0.99)

    def ping(self) -> str:
        return self.run_id

    # -- fail-open helpers -------------------------------------------------------------------
    def _ignore(self, reason: str, detail: str) -> None:
        self.ignored[reason] += 1
        logger.debug("[run %s] ignored %s report: %s", self.run_id, reason, detail)
        if self._metrics is not None:
            self._safe_metrics(lambda: self._metrics.record_ignored(reason))

    def _safe_metrics(self, record: Callable[[], None]) -> None:
        try:
            record()
        except Exception as exc:  # noqa: BLE001
            self._warn_once("metrics", f"recording metrics failed ({exc!r})")

    def _warn_once(self, key: str, text: str) -> None:
        if key in self._warned:
            return
        if len(self._warned) > 1000:   # notes carry figures: keep the set bounded
            self._warned.clear()
        self._warned.add(key)
        logger.warning("[run %s] %s", self.run_id, text)


def _checked(s: StepStats) -> StepStats:
    """The stats unchanged, or ValueError when a field is not a finite, non-negative number."""
    if isinstance(s.step, bool) or not isinstance(s.step, int) or s.step < 0:
        raise ValueError(f"step must be an integer >= 0, got {s.step!r}")
    for name in ("total_s", "data_wait_s", "forward_s", "backward_s", "comm_wait_s",
                 "optimizer_s", "memory_frac"):
        v = getattr(s, name)
        if v is None and name == "memory_frac":
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    return s


def _int(x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise ValueError(f"expected an integer, got {x!r}")
    return x


def _step_stats(row: Any) -> StepStats:
    """A step row (:data:`STEP_FIELDS` order) or a ``StepStats.to_dict()``, as StepStats."""
    if isinstance(row, (tuple, list)):
        if len(row) != len(STEP_FIELDS):
            raise ValueError(f"a step row has {len(STEP_FIELDS)} fields, got {len(row)}")
        return StepStats(*row)
    return StepStats.from_dict(row)


def _quantile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile (:func:`~raytrain_guard.core.stats.nearest_rank`), None when empty."""
    return nearest_rank(sorted(values), q) if values else None
