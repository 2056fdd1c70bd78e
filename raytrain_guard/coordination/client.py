"""The worker-side coordinator client, and the decision source the train loop polls.

:class:`CoordinatorClient` hands each batch of steps to a daemon thread that sends it and leaves
new decisions in an inbox (no Ray call or wait on the training thread);
:class:`LockstepDecisionSource` hands them to the lockstep; :class:`ClusterDecisionSource` is the
picklable one the launcher ships to every worker. Details: docs/coordination.md.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.coordination.context import current_context
from raytrain_guard.coordination.control_plane import shared_control_plane
from raytrain_guard.coordination.link import (
    HANG_REPORT_TIMEOUT_S,
    POLL_S,
    CoordinatorLink,
    coordinator_name,
    fetch_attempt,
    lookup_actor,
    register_worker_with_monitor,
    send_hang_record,
    wait_for,
)
from raytrain_guard.coordination.lockstep import (
    Lockstep,
    ProcessGroupExchange,
    SingleRankExchange,
    is_agreement_step,
)
from raytrain_guard.core.decisions import Decision
from raytrain_guard.core.steps import StepStats

logger = logging.getLogger(__name__)

STEP_FIELDS = tuple(f.name for f in dataclasses.fields(StepStats))   # a report row's order
step_row = operator.attrgetter(*STEP_FIELDS)                          # a StepStats as its row

MAX_QUEUED_REPORTS = 4      # report batches held while the coordinator is slow; more are dropped
FLUSH_TIMEOUT_S = 2.0       # how long the end of a rank's run waits for its last reports
APPLIED_KEPT = 64           # (step, decision id) pairs kept while the coordinator is away


class CoordinatorClient:
    """One rank's reports out and decisions in. ``background=False`` runs the link's calls in
    place (tests). ``_answers`` is the one method that waits on Ray, on the link's thread."""

    def __init__(self, name: str, *, namespace: str | None, world_rank: int, node_id: str,
                 report_every_steps: int, attempt: int = 0,
                 setup: Callable[[], Mapping[str, Any]] | None = None,
                 lookup: Callable[[str, str | None], Any] = lookup_actor,
                 clock: Callable[[], float] = time.monotonic,
                 retry_after_s: float | None = None, background: bool = True) -> None:
        self.name = name
        self.namespace = namespace
        self.world_rank = world_rank
        self.node_id = node_id
        self.report_every_steps = report_every_steps
        self.attempt = attempt
        self.setup = setup
        self.lookup = lookup
        self._buffer: list[StepStats] = []
        self._inbox: deque[Decision] = deque()           # fetched, not yet handed out
        self._applied: deque[tuple[int, int]] = deque(maxlen=APPLIED_KEPT)   # not reported
        self.cursor = 0                                  # newest decision id handed out
        self._fetched = 0                                # newest id put in the inbox
        self.num_reports_sent = 0
        self._link = CoordinatorLink(
            name, namespace, max_queued=MAX_QUEUED_REPORTS, lookup=lookup, clock=clock,
            retry_after_s=(GuardConfig().coordinator_retry_s if retry_after_s is None
                           else retry_after_s), background=background, poll_s=POLL_S,
            who=f"rank {world_rank}")

    @property
    def connected(self) -> bool:
        return self._link.connected

    @property
    def num_reports_dropped(self) -> int:
        return self._link.num_dropped

    @property
    def num_failures(self) -> int:
        return self._link.num_failures

    # -- the training thread -----------------------------------------------------------------
    def record(self, stats: StepStats | Iterable[StepStats]) -> None:
        """Keep one step's (or several steps') figures; queue a batch every N steps."""
        if isinstance(stats, StepStats):
            self._buffer.append(stats)
        else:
            self._buffer.extend(stats)
        if len(self._buffer) >= self.report_every_steps:
            self._queue(fetch=True)

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """At the end of the rank's run: queue the steps kept and wait at most ``timeout_s`` for
        the reports to leave."""
        if self._buffer:
            self._queue(fetch=False)
        self._link.drain(timeout_s)
        self._link.close()

    def note_applied(self, step: int, decision_id: int) -> None:
        """The lockstep applied ``decision_id`` at ``step``: sent with the next report."""
        self._applied.append((int(step), int(decision_id)))

    def poll_decisions(self) -> list[Decision]:
        """The decisions fetched since the last call, without waiting."""
        out = []
        while self._inbox:
            decision = self._inbox.popleft()
            self.cursor = max(self.cursor, decision.decision_id)
            out.append(decision)
        return out

    def _queue(self, *, fetch: bool) -> None:
        batch, self._buffer = self._buffer, []
        self._link.submit(lambda handle: self._send(handle, batch, fetch), wake=False)

    # -- the link's thread -------------------------------------------------------------------
    def _send(self, handle: Any, batch: list[StepStats], fetch: bool) -> None:
        """One report, then (``fetch``) the decisions newer than any known into the inbox."""
        applied = list(self._applied)
        extra = {"applied": applied} if applied else {}
        refs = [handle.report_steps.remote(self.world_rank, self.node_id, self.attempt,
                                           [step_row(s) for s in batch], self._current_setup(),
                                           self.cursor, **extra)]
        for _ in applied:
            self._applied.popleft()
        self.num_reports_sent += 1
        if fetch:
            refs.append(handle.decisions_since.remote(max(self.cursor, self._fetched)))
        answers = self._answers(refs)
        for entry in (answers[-1] or []) if fetch else ():
            try:
                decision = Decision.from_dict(entry)
            except (KeyError, ValueError, TypeError) as exc:
                logger.warning("rank %d: ignoring an unreadable decision %r: %s",
                               self.world_rank, entry, exc)
                continue
            self._fetched = max(self._fetched, decision.decision_id)
            self._inbox.append(decision)

    def _answers(self, refs: list[Any]) -> list[Any]:
        return wait_for(refs)

    def _current_setup(self) -> dict[str, Any] | None:
        """The rank's batch layout now; None without a callable or when it fails."""
        if self.setup is None:
            return None
        try:
            return dict(self.setup())
        except Exception as exc:  # noqa: BLE001 - fail open
            logger.debug("rank %d: setup not readable: %r", self.world_rank, exc)
            return None

    def report_hang(self, record: Mapping[str, Any],
                    timeout_s: float = HANG_REPORT_TIMEOUT_S) -> dict[str, Any] | None:
        return send_hang_record(self.name, self.namespace, self.world_rank, self.node_id,
                                self.attempt, record, timeout_s=timeout_s,
                                handle=self._link.handle, lookup=self.lookup)


class LockstepDecisionSource:
    """The train loop's ``decision_source``: coordinator decisions, applied in lockstep.
    Decisions for a step before the first step this source saw (an earlier attempt's) are
    dropped."""

    def __init__(self, lockstep: Lockstep, client: CoordinatorClient | None = None) -> None:
        self.lockstep = lockstep
        self.client = client
        self.first_step: int | None = None

    def finish(self, stats: Sequence[StepStats] = ()) -> None:
        """The run ended: ``stats`` and the steps the client keeps go to the coordinator."""
        if self.client is not None:
            try:
                if stats:
                    self.client.record(stats)
                self.client.flush()
            except Exception as exc:  # noqa: BLE001
                logger.warning("decision source: last report failed (%r); going on", exc)

    def poll(self, step: int, stats: StepStats | Sequence[StepStats] | None = None
             ) -> list[Decision]:
        """At a step boundary on every rank: the decisions to apply at exactly ``step``."""
        if self.first_step is None:
            self.first_step = step
        client = self.client
        if client is not None:
            try:
                if is_agreement_step(step, self.lockstep.every_steps):   # needed now only
                    self.lockstep.offer(d for d in client.poll_decisions()
                                        if d.step is None or d.step >= self.first_step)
                if stats:
                    client.record(stats)
            except Exception as exc:  # noqa: BLE001 - the guard fails open, lockstep must run
                logger.warning("decision source: client failed (%r); going on", exc)
        due = self.lockstep.poll(step)
        if client is not None:
            if self.lockstep.agreed_ids:            # ids heard from other ranks
                client.cursor = max(client.cursor, max(self.lockstep.agreed_ids))
            for d in due:
                client.note_applied(step, d.decision_id)
        return due

    @property
    def applied(self) -> list[tuple[int, int]]:
        return self.lockstep.applied

    def report_hang(self, record: Mapping[str, Any],
                    timeout_s: float = HANG_REPORT_TIMEOUT_S) -> dict[str, Any] | None:
        return self.client.report_hang(record, timeout_s) if self.client is not None else None

    def bind_setup(self, setup: Callable[[], Mapping[str, Any]]) -> None:
        """Report ``setup()`` (the rank's batch layout now) with every batch."""
        if self.client is not None:
            self.client.setup = setup


class ClusterDecisionSource:
    """What the launcher puts in ``train_loop_config["decision_source"]`` (picklable).

    On the first ``poll`` (every rank, same step) each worker builds its own
    :class:`LockstepDecisionSource` for ``run_id`` in ``namespace`` and registers with its
    node's monitor. If one rank could not start, no rank runs the lockstep (a lone rank's
    fallback would pair mismatched collectives). ``guard``: a GuardConfig or a dict of its fields.
    """

    def __init__(self, run_id: str, namespace: str,
                 guard: GuardConfig | Mapping[str, Any] | None = None,
                 *, register_with_monitor: bool = True) -> None:
        self.run_id = run_id
        self.namespace = namespace
        self.guard = guard if isinstance(guard, GuardConfig) else dict(guard or {})
        self.register_with_monitor = register_with_monitor
        self._source: LockstepDecisionSource | _NoDecisions | None = None
        self._setup: Callable[[], Mapping[str, Any]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_source"] = None            # built anew in each worker
        state["_setup"] = None             # bound by the loop in each worker
        return state

    def bind_setup(self, setup: Callable[[], Mapping[str, Any]]) -> None:
        self._setup = setup
        if isinstance(self._source, LockstepDecisionSource):
            self._source.bind_setup(setup)

    def poll(self, step: int, stats: Sequence[StepStats] | None = None) -> list[Decision]:
        if self._source is None:
            self._source = self._build()
        return self._source.poll(step, stats)

    def finish(self, stats: Sequence[StepStats] = ()) -> None:
        if isinstance(self._source, LockstepDecisionSource):
            self._source.finish(stats)

    @property
    def applied(self) -> list[tuple[int, int]]:
        return self._source.applied if self._source is not None else []

    def report_hang(self, record: Mapping[str, Any],
                    timeout_s: float = HANG_REPORT_TIMEOUT_S) -> dict[str, Any] | None:
        """The watchdog's record, once this source started; None before."""
        source = self._source
        if isinstance(source, LockstepDecisionSource):
            return source.report_hang(record, timeout_s)
        return None

    def _build(self) -> LockstepDecisionSource | _NoDecisions:
        """On every rank at the same step: the lockstep source, or no cluster decisions on
        every rank alike when any rank could not start."""
        attempt, problem = 0, None
        try:
            config = self.guard if isinstance(self.guard, GuardConfig) else \
                GuardConfig.from_dict(self.guard, source="decision_source guard")
            ctx = current_context()
            exchange = ProcessGroupExchange() if ctx.world_size > 1 else SingleRankExchange()
            if ctx.world_rank == 0:
                attempt = fetch_attempt(coordinator_name(self.run_id), self.namespace)
        except Exception as exc:  # noqa: BLE001 - fail open, agreed below
            problem = exc
        try:
            attempt, started = agree_on_start(attempt, problem is None)
        except Exception as exc:  # noqa: BLE001 - fail open; a failing collective fails
            attempt, started, problem = 0, False, problem or exc   # on every rank
        if not started:
            logger.warning("decision source could not start (%s): no cluster decisions in "
                           "this run, the local gate still acts",
                           repr(problem) if problem is not None else "on another rank")
            return _NoDecisions()
        if self.register_with_monitor:
            try:
                register_worker_with_monitor(self.namespace, self.run_id, ctx.world_rank)
            except Exception as exc:  # noqa: BLE001 - fail open
                logger.warning("rank %d: monitor registration failed: %r", ctx.world_rank, exc)
        client = CoordinatorClient(coordinator_name(self.run_id), namespace=self.namespace,
                                   world_rank=ctx.world_rank, node_id=ctx.node_id or "local",
                                   report_every_steps=config.report_every_steps,
                                   attempt=attempt, setup=self._setup,
                                   retry_after_s=config.coordinator_retry_s)
        logger.info("rank %d: lockstep every %d steps, coordinator %s, attempt %d",
                    ctx.world_rank, config.lockstep_every_steps, client.name, attempt)
        return LockstepDecisionSource(
            Lockstep(every_steps=config.lockstep_every_steps, exchange=exchange,
                     world_rank=ctx.world_rank), client)


class _NoDecisions:
    """What a decision source that could not start falls back to (on every rank alike)."""

    @property
    def applied(self) -> list[tuple[int, int]]:
        return []

    def poll(self, step: int, stats: Any = None) -> list[Decision]:
        return []


def agree_on_start(attempt: int, started: bool) -> tuple[int, bool]:
    """``(attempt, every rank started)`` in one ``all_reduce(MAX)`` on the control plane: rank 0
    brings the coordinator's attempt number, the others 0."""
    agreed, not_started = shared_control_plane().all_reduce_max(int(attempt),
                                                                0 if started else 1)
    return agreed, not not_started
