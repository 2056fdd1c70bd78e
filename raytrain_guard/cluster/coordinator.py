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
  ``setup``: ``{"micro_batch", "grad_accum", "prefetch_factor"}`` as the rank runs now, and
  optionally the figures the policy prices with (``core.node_samples.RunSetup``): ``device``
  ("cuda"/"cpu"), ``device_index``, ``allocated_bytes``, ``reserved_bytes``,
  ``device_total_bytes``, ``num_workers``, ``batch_bytes``.
  ``decision_cursor``: the newest decision id the rank knows of (new ids are made larger).
  ``applied``: ``[(step, decision id), ...]`` its lockstep applied since its last report.
* ``report_node(sample) -> None``: a monitor's ``NodeSample.to_dict()``.
* ``decide(next_apply_step=None) -> list[dict]``: one policy round now (otherwise rounds run by
  themselves on reports, at most every ``decision_interval_s``); the new decisions.
* ``decisions_since(decision_id) -> list[dict]``: decisions with a larger id, oldest first.
* ``status() -> dict``: nodes, ranks, memory, step time p50/p99, straggler scores, active
  decisions, counters of ignored reports (what ``raytrain-guard status`` prints); ``effects``:
  the decisions measured so far (``predicted`` and ``measured``), ``missed``: the
  ``action:cause`` keys not repeated, ``straggler_ranks``, ``plan``: whether actions are priced.
* ``set_plan(plan) -> bool``: the run's ``core.effects.RunPlan.to_dict()`` (model, activation
  profile, training setup, device memory, gradient-sync mode); without it memory actions are
  unpriced (today's ladder). Also the ``plan=`` constructor argument.
* ``report_hang(world_rank, node_id, attempt, record) -> dict | None``: a rank's hang watchdog
  record (``runtime.watchdog.StepWatchdog``: step, phase, ``phase_for_s``, ``step_for_s``,
  ``last_progress_wall``, ``in_collective``, ``world_size``), sent from its watchdog thread
  before the process ends. The coordinator keeps them per attempt and names the hung rank
  (:func:`raytrain_guard.core.hang.name_hung_rank`, with the ranks that reported steps in
  that attempt); the answer is the verdict so far (``attempt`` added).
  ``status()["hangs"]``: one verdict per attempt with a hang, oldest first, with its records.
  A settled verdict is logged once and counted (``metrics.record_hang(verdict)``).
* ``ping() -> str``.

Effects (issue 11): a release, shrink, prefetch change or pacing decision is measured once
every rank has reported ``decision_cooldown_steps`` steps after the step the ranks applied it
at (``applied`` in their reports; the lockstep applies a decision whose step has passed when
the ranks agree at their next agreement step instead, and the policy's cooldown for the
action then counts from there too; a decision no rank reports applied is not measured):
medians of the worst rank's memory fraction (the node's host memory for a prefetch change), of
the step time and of the data wait, over those steps against the ``decision_cooldown_steps``
steps each rank had reported when it was decided. The result is stored with the decision
(``measured``, with ``missed`` and ``applied_at``); an action whose memory fell by less than
``effect_min_share`` of its prediction goes into the policy's ``missed`` set: it is not
repeated for that cause and the policy escalates (a shrink if one is predicted to help, else
checkpoint-and-stop at critical). The set survives a new attempt (the same model misses the
same way). ``metrics.record_measured(decision, measured)`` is called when the metrics object
has it.

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

import dataclasses
import logging
import math
import time
import uuid
from collections import Counter, deque
from typing import Any, Callable, Mapping, Sequence

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Decision
from raytrain_guard.core.effects import RunPlan, measure, missed
from raytrain_guard.core.hang import HangRecord, HungRank, name_hung_rank
from raytrain_guard.core.node_samples import NodeSample, RunSetup
from raytrain_guard.core.policy import (
    ClusterView,
    PolicyState,
    RankView,
    decide,
    default_apply_step,
    missed_key,
)
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
HANG_ATTEMPTS_KEPT = 16
"""Attempts whose hang records are kept for ``status()`` (a run restarts a handful of times)."""

MEASURED_ACTIONS = (Action.RELEASE_CACHE, Action.SHRINK_MICRO_BATCH, Action.SET_PREFETCH,
                    Action.PACE)
"""Actions whose effect is measured after their apply step (events and stops are not)."""


class _Pending:
    """A decision waiting for its effect: the steps before it, per rank, the node's host
    memory fraction when it was decided (host actions), and the step the ranks applied it at
    (None until a rank reports it)."""

    __slots__ = ("applied_at", "before", "decision", "host_before", "node_id")

    def __init__(self, decision: Decision, before: dict[int, tuple[StepStats, ...]],
                 host_before: float | None, node_id: str | None) -> None:
        self.decision, self.before = decision, before
        self.host_before, self.node_id = host_before, node_id
        self.applied_at: int | None = None


class _Hangs:
    """One attempt's hang records: per rank the latest, when the first arrived, and the ranks
    (and their nodes) that reported steps in that attempt."""

    __slots__ = ("announced", "expected", "first_at", "nodes", "records")

    def __init__(self, first_at: float) -> None:
        self.first_at = first_at
        self.records: dict[int, HangRecord] = {}
        self.expected: set[int] = set()
        self.nodes: dict[int, str] = {}
        self.announced = False


class _Rank:
    __slots__ = ("batches", "last_step", "node_id", "num_steps", "setup", "view", "window")

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
                 wall_clock: Callable[[], float] = time.time,
                 plan: RunPlan | Mapping[str, Any] | None = None) -> None:
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
        self._first_id_of_attempt = 0          # decisions of earlier attempts: not handed out
        self.incarnation = uuid.uuid4().hex[:12]   # changes when the actor restarts
        self._last_round = clock()   # first round one interval after start
        self.ignored: Counter[str] = Counter({r: 0 for r in IGNORE_REASONS})
        self.num_reports = 0
        self.num_node_samples = 0
        self.num_rounds = 0
        self._warned: set[str] = set()
        self._pending: dict[int, _Pending] = {}
        self._plan: RunPlan | None = None
        self._hangs: dict[int, _Hangs] = {}       # attempt -> its hang records
        if plan is not None:
            self.set_plan(plan)

    # -- reports -----------------------------------------------------------------------------
    def report_steps(self, world_rank: int, node_id: str, attempt: int,
                     stats: Sequence[Any], setup: Mapping[str, Any] | None = None,
                     decision_cursor: int | None = None,
                     applied: Sequence[Sequence[int]] | None = None) -> None:
        """One rank's batch of step rows (or StepStats dicts). Never raises: bad reports are
        counted. ``applied``: ``(step, decision id)`` pairs the rank's lockstep applied since
        its last report (see :meth:`_note_applied`)."""
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
        if applied:
            self._note_applied(rank, applied)
        self._maybe_decide()

    def _note_applied(self, rank: int, applied: Sequence[Sequence[int]]) -> None:
        """The steps the ranks applied pending decisions at. The lockstep applies a decision at
        the step the coordinator asked for, or at the first agreement after a rank fetched it
        when that step has passed; the effect is measured from the step it took effect, and
        the policy's cooldown for that action counts from there too."""
        for pair in applied:
            try:
                step, decision_id = _int(pair[0]), _int(pair[1])
            except Exception:  # noqa: BLE001 - an unreadable pair is dropped
                self._ignore("malformed", f"rank {rank}: applied entry {pair!r}")
                continue
            pending = self._pending.get(decision_id)
            if pending is None or pending.applied_at is not None:
                continue
            pending.applied_at = step
            self._state = _cooldown_from(self._state, pending.decision, step)

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

    def report_hang(self, world_rank: int, node_id: str, attempt: int,
                    record: Mapping[str, Any]) -> dict | None:
        """A rank's hang watchdog record; returns the verdict on its attempt so far (None for
        a malformed record, counted). Never raises."""
        try:
            rank, att = _int(world_rank), _int(attempt)
            rec = HangRecord.from_dict({**dict(record), "world_rank": rank,
                                        "node_id": str(node_id or record.get("node_id") or "")})
        except Exception as exc:  # noqa: BLE001 - whatever arrives, count it and go on
            self._ignore("malformed", f"hang record from rank {world_rank!r}: {exc}")
            return None
        entry = self._hangs.get(att)
        if entry is None:
            entry = self._hangs[att] = _Hangs(self._clock())
            for old in sorted(self._hangs)[:-HANG_ATTEMPTS_KEPT]:
                del self._hangs[old]
        entry.records[rank] = rec
        if att == self.attempt:           # the ranks that reported steps in this attempt
            entry.expected |= set(self._ranks)
            entry.nodes.update({r: e.node_id for r, e in self._ranks.items()})
        logger.warning("[run %s] attempt %d: rank %d's watchdog fired: %s (at %s)", self.run_id,
                       att, rank, rec.describe(), rec.where or "?")
        verdict = self._hang_verdict(att, entry)
        return None if verdict is None else {"attempt": att, **verdict.to_dict()}

    def _hang_verdict(self, attempt: int, entry: _Hangs) -> HungRank | None:
        """The verdict on one attempt now; a settled one is logged and counted once."""
        verdict = name_hung_rank(entry.records.values(), entry.expected,
                                 waited_s=self._clock() - entry.first_at, nodes=entry.nodes)
        if verdict is not None and verdict.settled and not entry.announced:
            entry.announced = True
            logger.warning("[run %s] attempt %d: %s", self.run_id, attempt, verdict.reason)
            record = getattr(self._metrics, "record_hang", None)
            if record is not None:
                self._safe_metrics(lambda: record(verdict))
        return verdict

    def _hang_status(self) -> list[dict]:
        out = []
        for att in sorted(self._hangs):
            entry = self._hangs[att]
            verdict = self._hang_verdict(att, entry)
            if verdict is not None:
                out.append({"attempt": att, **verdict.to_dict(), "records": [
                    dataclasses.asdict(entry.records[r]) for r in sorted(entry.records)]})
        return out

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
        self._measure_due()
        outcome = decide(view, self._state, self.config, at)
        self._state, self._scores, self._notes = outcome.state, outcome.scores, outcome.notes
        new = []
        for d in outcome.decisions:
            self._next_id += 1
            d = dataclasses.replace(d, params=dict(d.params), decision_id=self._next_id)
            self._decisions.append(d)
            new.append(d.to_dict())
            if d.action in MEASURED_ACTIONS and d.step is not None:
                self._pending[d.decision_id] = self._pending_of(d, view)
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

    def set_plan(self, plan: RunPlan | Mapping[str, Any] | None) -> bool:
        """The run's plan (``RunPlan.to_dict()``: model, activation profile, training setup,
        device memory, gradient-sync mode): the memory model the policy prices its memory
        actions with. Returns whether it was taken; a malformed plan is logged once and the
        policy goes on unpriced (today's ladder), as with none."""
        if plan is None or isinstance(plan, RunPlan):
            self._plan = plan
            return True
        try:
            self._plan = RunPlan.from_dict(plan)
            return True
        except Exception as exc:  # noqa: BLE001 - fail open: no plan, actions unpriced
            self._warn_once("plan", f"plan not usable ({exc!r}); memory actions are unpriced")
            return False

    def decisions_since(self, decision_id: int) -> list[dict]:
        """Decisions of the current attempt with an id greater than ``decision_id``, oldest
        first. One decided for an earlier attempt (a stop that attempt already acted on) is
        not handed to a restarted group: it would act again on a state that no longer is."""
        first = max(decision_id, self._first_id_of_attempt)
        return [d.to_dict() for d in self._decisions if d.decision_id > first]

    # -- effects -----------------------------------------------------------------------------
    def _pending_of(self, d: Decision, view: ClusterView) -> _Pending:
        n = self.config.decision_cooldown_steps
        before = {r: tuple(e.window)[-n:] for r, e in self._ranks.items()}
        node_id = d.scope.split(":", 1)[1] if d.scope.startswith("node:") else None
        host = view.nodes.get(node_id).host if node_id in view.nodes else None
        return _Pending(d, before, None if host is None else host.memory_used_frac, node_id)

    def _measure_due(self) -> None:
        """Measure every pending action whose window after its apply step every rank has
        reported: medians before and after, stored with the decision (``measured``). One that
        missed (below ``effect_min_share`` of its prediction) goes into the policy's ``missed``
        set: not repeated for that cause; the policy escalates."""
        if not self._pending or not self._ranks:
            return
        reported = min(e.last_step for e in self._ranks.values())
        n = self.config.decision_cooldown_steps
        for decision_id in sorted(self._pending):
            pending = self._pending[decision_id]
            d = pending.decision
            start = pending.applied_at
            if start is None:            # not applied yet (or no rank said so): no effect yet
                continue
            end = start + n
            if reported < end:
                continue
            del self._pending[decision_id]
            after = {r: tuple(s for s in e.window if start < s.step <= end)
                     for r, e in self._ranks.items()}
            host = (None, None)
            if pending.node_id is not None and pending.host_before is not None:
                sample = self._nodes.get(pending.node_id)
                if sample is not None and sample[0].host is not None:
                    host = (pending.host_before, sample[0].host.memory_used_frac)
            result = measure(pending.before, after, host)
            if result is None:
                continue
            miss = missed(d.predicted, result, self.config.effect_min_share)
            measured = dict(result.to_dict(), missed=miss, applied_at=start)
            self._replace_decision(dataclasses.replace(d, measured=measured))
            if d.action is Action.RELEASE_CACHE and not miss:
                self._state = dataclasses.replace(self._state, release_armed=True)
            if miss:
                key = missed_key(d)
                self._state = dataclasses.replace(self._state,
                                                  missed=self._state.missed | {key})
                logger.warning("[run %s] decision #%d %s missed its prediction (memory "
                               "%+.1f%% measured vs %+.1f%% predicted): not repeated for %s",
                               self.run_id, d.decision_id, d.action.value,
                               100 * (result.delta_frac or 0.0),
                               100 * float(d.predicted["delta_frac"]), key)
            record = getattr(self._metrics, "record_measured", None)
            if record is not None:
                self._safe_metrics(lambda r=record, d=d, m=measured: r(d, m))

    def _replace_decision(self, d: Decision) -> None:
        for i, old in enumerate(self._decisions):
            if old.decision_id == d.decision_id:
                self._decisions[i] = d
                return

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
        return ClusterView(ranks, nodes, self._plan)

    def _new_attempt(self, attempt: int) -> None:
        logger.info("[run %s] attempt %d starts (was %d): rank state cleared", self.run_id,
                    attempt, self.attempt)
        self.attempt = attempt
        self._first_id_of_attempt = self._next_id      # decisions before it were the old one's
        self._ranks.clear()
        self._state = PolicyState(missed=self._state.missed)   # what missed still misses
        self._scores = {}
        self._pending.clear()

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
                "straggler_ranks": sorted(self._state.flagged_ranks),
                "effects": [d.to_dict() for d in self._decisions
                            if d.measured is not None][-20:],
                "missed": sorted(self._state.missed), "plan": self._plan is not None,
                "hangs": self._hang_status(),
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


def _cooldown_from(state: PolicyState, d: Decision, step: int) -> PolicyState:
    """``state`` with the cooldown of ``d``'s action counted from ``step``, where the ranks
    applied it, when that is later than the step the policy asked for."""
    def later(last: int | None) -> int:
        return step if last is None else max(last, step)

    if d.action is Action.SHRINK_MICRO_BATCH:
        return dataclasses.replace(state, last_shrink_step=later(state.last_shrink_step),
                                   last_release_step=later(state.last_release_step))
    if d.action is Action.RELEASE_CACHE:
        return dataclasses.replace(state, last_release_step=later(state.last_release_step))
    if d.action is Action.PACE:
        return dataclasses.replace(state, last_pace_step=later(state.last_pace_step))
    if d.action is Action.SET_PREFETCH and d.scope.startswith("node:"):
        node = d.scope.split(":", 1)[1]
        steps = dict(state.prefetch_steps)
        steps[node] = later(steps.get(node))
        return dataclasses.replace(state, prefetch_steps=steps)
    return state


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
