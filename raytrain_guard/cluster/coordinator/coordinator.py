"""Coordinator: one per run; takes the ranks' step reports and the monitors' node samples,
runs the policy rounds that decide cluster actions, and hands the decisions out. A plain class
(``cluster.actors`` makes it an actor) that persists nothing: a restarted coordinator rebuilds
itself from the next reports. Details: docs/cluster.md ("The coordinator").
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from raytrain_guard.cluster.coordinator.effects import EffectMeter
from raytrain_guard.cluster.coordinator.hangs import HangVerdicts, read_hang_report
from raytrain_guard.cluster.coordinator.reports import (
    IGNORE_REASONS,
    NodeSamples,
    RankWindow,
    read_step_report,
)
from raytrain_guard.cluster.coordinator.status import figures, round_step_quantiles
from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Cause, Decision
from raytrain_guard.core.effects import RunPlan
from raytrain_guard.core.node_samples import NodeSample
from raytrain_guard.core.policy import ClusterView, PolicyState, decide, default_apply_step
from raytrain_guard.core.straggler import StragglerScore
from raytrain_guard.errors import check_int
from raytrain_guard.log import warn_once

logger = logging.getLogger(__name__)

MAX_DECISIONS_KEPT = 1000      # for decisions_since; ranks poll every few steps


class FailOpenMetrics:
    """The coordinator's metrics (``CoordinatorMetrics`` in the actor, or None): ``record(name,
    *args)`` calls their ``name`` method when they have one; a failing call is warned once."""

    def __init__(self, metrics: Any, warn: Callable[[str, str], None]) -> None:
        self.metrics, self._warn = metrics, warn

    def record(self, name: str, *args: Any) -> None:
        method = getattr(self.metrics, name, None)
        if method is None:
            return
        try:
            method(*args)
        except Exception as exc:  # noqa: BLE001 - fail open
            self._warn("metrics", f"recording metrics failed ({exc!r})")


class Coordinator:
    """The run's coordinator. No actor method raises on a bad report: it is counted in
    ``ignored``. ``apply_step_rule(latest_step, config)``: the step decisions apply at.
    ``clock`` paces rounds and ages node samples; ``wall_clock`` seeds decision ids, which grow
    across restarts (and jump past the newest id a rank reports knowing)."""

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
        self._warned: set[str] = set()
        self._metrics = FailOpenMetrics(metrics, self._warn_once)
        self._apply_step_rule = apply_step_rule
        self._clock = clock
        self._ranks: dict[int, RankWindow] = {}
        self._nodes = NodeSamples(config.memory_trend_steps)
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
        self._effects = EffectMeter(self.run_id, self.config)
        self._hangs = HangVerdicts(self.run_id, clock,
                                   on_settled=lambda v: self._metrics.record("record_hang", v))
        self._plan: RunPlan | None = None
        if plan is not None:
            self.set_plan(plan)

    # -- attempts ----------------------------------------------------------------------------
    def next_attempt(self) -> int:
        """A new attempt number for a starting worker group (its rank 0 asks); reports of other
        attempts are stale from now on."""
        self._issued_attempt = True
        self._new_attempt(self.attempt + 1)
        return self.attempt

    def _new_attempt(self, attempt: int) -> None:
        logger.info("[run %s] attempt %d starts (was %d): rank state cleared", self.run_id,
                    attempt, self.attempt)
        self.attempt = attempt
        self._first_id_of_attempt = self._next_id      # decisions before it were the old one's
        self._ranks.clear()
        self._state = PolicyState(missed=self._state.missed)
        self._scores = {}
        self._effects.clear()

    # -- reports -----------------------------------------------------------------------------
    def report_steps(self, world_rank: int, node_id: str, attempt: int,
                     stats: Sequence[Any], setup: Mapping[str, Any] | None = None,
                     decision_cursor: int | None = None,
                     applied: Sequence[Sequence[int]] | None = None) -> None:
        """One rank's batch of step rows (``coordination.client.STEP_FIELDS`` order, or
        StepStats dicts), its ``setup`` now, the newest decision id it knows and the ``(step,
        decision id)`` pairs its lockstep applied. May run a policy round."""
        try:
            if decision_cursor is not None:
                self._next_id = max(self._next_id, check_int("decision_cursor", decision_cursor))
            report = read_step_report(world_rank, node_id, attempt, stats, setup)
        except Exception as exc:  # noqa: BLE001 - whatever arrives, count it and go on
            self._ignore("malformed", f"report from rank {world_rank!r}: {exc}")
            return
        rank, att = report.world_rank, report.attempt
        if att < self.attempt:
            self._ignore("stale", f"rank {rank} attempt {att} < {self.attempt}")
            return
        if att > self.attempt:
            if self._issued_attempt:   # a larger attempt comes from a group that died before
                self._ignore("stale", f"rank {rank} attempt {att}: not issued by this "
                                      f"coordinator (issued {self.attempt})")
                return
            self._new_attempt(att)     # after a restart: adopted from the reports
        entry = self._ranks.get(rank)
        if entry is None or entry.node_id != report.node_id:
            entry = self._ranks[rank] = RankWindow(rank, report.node_id, self.config.step_window)
        refused = entry.add(report)
        if refused is not None:
            self._ignore(*refused)
            return
        self.num_reports += 1
        self._state, bad = self._effects.applied(applied or (), self._state)
        for pair in bad:
            self._ignore("malformed", f"rank {rank}: applied entry {pair!r}")
        self._maybe_decide()

    def report_node(self, sample: Mapping[str, Any]) -> None:
        """A node monitor's ``NodeSample.to_dict()``. May run a policy round."""
        try:
            s = NodeSample.from_dict(sample)
        except Exception as exc:  # noqa: BLE001
            self._ignore("malformed", f"node sample: {exc}")
            return
        refused = self._nodes.add(s, self._clock())
        if refused is not None:
            self._ignore(*refused)
            return
        self.num_node_samples += 1
        self._maybe_decide()

    def report_hang(self, world_rank: int, node_id: str, attempt: int,
                    record: Mapping[str, Any]) -> dict | None:
        """A rank's hang watchdog record; the verdict on its attempt so far (None for a
        malformed record)."""
        try:
            att, rec = read_hang_report(world_rank, node_id, attempt, record)
        except Exception as exc:  # noqa: BLE001 - whatever arrives, count it and go on
            self._ignore("malformed", f"hang record from rank {world_rank!r}: {exc}")
            return None
        ranks = ({r: e.node_id for r, e in self._ranks.items()} if att == self.attempt
                 else None)
        verdict = self._hangs.add(att, rec, ranks)
        return None if verdict is None else {"attempt": att, **verdict.to_dict()}

    # -- the policy round and its decisions --------------------------------------------------
    def decide(self, next_apply_step: int | None = None) -> list[dict]:
        """Run one policy round now (otherwise reports run one at most every
        ``decision_interval_s``); returns the new decisions as dicts."""
        view = self._view()
        latest = view.latest_step
        if latest is None and next_apply_step is None:
            return []
        at = next_apply_step if next_apply_step is not None else \
            self._apply_step_rule(latest, self.config)
        self._last_round = self._clock()
        self.num_rounds += 1
        self._state, measured = self._effects.measure_due(self._ranks, self._nodes, self._state)
        for d in measured:
            self._replace_decision(d)
        outcome = decide(view, self._state, self.config, at)
        self._state, self._scores, self._notes = outcome.state, outcome.scores, outcome.notes
        new = [self._issue(d, view) for d in outcome.decisions]
        for note in outcome.notes:
            self._warn_once(note, note)
        if self._metrics.metrics is not None:
            self._metrics.record("record_round", self._scores,
                                 {r: e.node_id for r, e in self._ranks.items()},
                                 self._state.flagged_nodes, set(self._nodes.latest),
                                 *round_step_quantiles(self._ranks))
        return [d.to_dict() for d in new]

    def request_stop(self, reason: str) -> dict:
        """A ``checkpoint_and_stop`` for every rank, delivered like any other decision (the
        drop-in driver's call)."""
        return self._issue(Decision(Action.CHECKPOINT_AND_STOP, f"stop requested: {reason}",
                                    cause=Cause.UNKNOWN, scope="cluster")).to_dict()

    def _issue(self, d: Decision, view: ClusterView | None = None) -> Decision:
        """``d`` with the next decision id, kept, its effect tracked (with a ``view``), logged."""
        self._next_id += 1
        d = dataclasses.replace(d, params=dict(d.params), decision_id=self._next_id)
        self._decisions.append(d)
        if view is not None:
            self._effects.track(d, self._ranks, view)
        log = logger.warning if d.action in (Action.CHECKPOINT_AND_STOP,
                                             Action.FLAG_STRAGGLER) else logger.info
        log("[run %s] decision #%d %s", self.run_id, d.decision_id, d)
        self._metrics.record("record_decision", d)
        return d

    def decisions_since(self, decision_id: int) -> list[dict]:
        """Decisions of the current attempt newer than ``decision_id``, oldest first (an
        earlier attempt's would act again on a state that no longer is)."""
        first = max(decision_id, self._first_id_of_attempt)
        return [d.to_dict() for d in self._decisions if d.decision_id > first]

    def set_plan(self, plan: RunPlan | Mapping[str, Any] | None) -> bool:
        """The run's plan (``RunPlan.to_dict()``), which the policy prices its memory actions
        with. Returns whether it was taken; a malformed plan leaves them unpriced."""
        try:
            self._plan = plan if plan is None or isinstance(plan, RunPlan) else \
                RunPlan.from_dict(plan)
            return True
        except Exception as exc:  # noqa: BLE001 - fail open: no plan, actions unpriced
            self._warn_once("plan", f"plan not usable ({exc!r}); memory actions are unpriced")
            return False

    def _maybe_decide(self) -> None:
        if self._clock() - self._last_round >= self.config.decision_interval_s:
            try:
                self.decide()
            except Exception as exc:  # noqa: BLE001 - a policy bug must not stop reports
                self._warn_once("policy", f"policy round failed ({exc!r}); decisions paused")

    def _view(self) -> ClusterView:
        max_age = self.config.node_sample_max_age_intervals * self.config.monitor_interval_s
        nodes = self._nodes.fresh(self._clock(), max_age)
        ranks = {r: e.view for r, e in self._ranks.items() if e.view is not None}
        readings = {n: tuple(self._nodes.host_readings[n]) for n in nodes}
        return ClusterView(ranks, nodes, self._plan, readings)

    def _replace_decision(self, d: Decision) -> None:
        for i, old in enumerate(self._decisions):
            if old.decision_id == d.decision_id:
                self._decisions[i] = d
                return

    # -- status ------------------------------------------------------------------------------
    def status(self) -> dict:
        """Nodes, ranks, memory, step time p50/p99, straggler scores, active decisions,
        measured effects, hang verdicts and counters (what ``raytrain-guard status`` prints)."""
        return {"run_id": self.run_id, "attempt": self.attempt, "incarnation": self.incarnation,
                **figures(self._ranks, self._nodes.latest, self._scores, self._state,
                          self._decisions),
                "plan": self._plan is not None, "hangs": self._hangs.status(),
                "notes": list(self._notes), "ignored": dict(self.ignored),
                "num_reports": self.num_reports, "num_node_samples": self.num_node_samples,
                "num_rounds": self.num_rounds}

    # -- fail open ---------------------------------------------------------------------------
    def _ignore(self, reason: str, detail: str) -> None:
        self.ignored[reason] += 1
        logger.debug("[run %s] ignored %s report: %s", self.run_id, reason, detail)
        self._metrics.record("record_ignored", reason)

    def _warn_once(self, key: str, text: str) -> None:
        warn_once(logger, key, "[run %s] %s", self.run_id, text, said=self._warned)
