"""The worker-side coordinator client, and the decision source the train loop polls.

:class:`CoordinatorClient` runs in every training worker and never blocks a step: step figures
go to the coordinator in batched fire-and-forget calls, decisions come back through
``ray.wait(timeout=0)`` only at the lockstep's agreement steps, and any failure drops the
handle while training goes on under the local gate rules. The name lookup (``ray.get_actor``,
which waits on the GCS) runs on a thread of its own, at most once per ``coordinator_retry_s``:
the step path only reads a handle that is there or not. :class:`LockstepDecisionSource` is the
train loop's ``decision_source`` seam, handing fetched decisions to
:class:`~raytrain_guard.cluster.lockstep.Lockstep`;
:class:`ClusterDecisionSource` is the picklable one the launcher ships to every worker. The
attempt agreement, the coordinator methods used and the hang report: docs/coordination.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from raytrain_guard.cluster.lockstep import Lockstep, is_agreement_step
from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Decision
from raytrain_guard.core.steps import StepStats
from raytrain_guard.errors import InputError

logger = logging.getLogger(__name__)

COORDINATOR_PREFIX = "raytrain_guard:coordinator:"
MAX_INFLIGHT_REPORTS = 4
"""Report calls a rank lets go unanswered before it drops new batches (a slow coordinator must
not make a rank queue memory). Not a user knob: 4 batches is 4 x report_every_steps steps of
slack, far beyond a healthy round trip of a few milliseconds."""
ATTEMPT_TIMEOUT_S = 30.0
"""How long rank 0 waits for the coordinator's ``next_attempt`` at start, while the other ranks
wait in the agreement: long enough for Ray to restart a coordinator that died just then."""
HANG_REPORT_TIMEOUT_S = 1.5
"""How long a rank's hang watchdog waits for the coordinator to take its record before the
process ends: a slow or dead coordinator must not hold the exit (and so the restart) longer
than this. A healthy round trip is milliseconds; 1.5 s also covers a name lookup."""


def coordinator_name(run_id: str) -> str:
    """The coordinator actor's name for a run (``raytrain_guard:coordinator:<run id>``)."""
    return f"{COORDINATOR_PREFIX}{run_id}"


def lookup_actor(name: str, namespace: str | None) -> Any:
    """The named actor's handle (raises ValueError when there is none)."""
    import ray
    return ray.get_actor(name, namespace=namespace)


def on_daemon_thread(fn: Callable[[], None]) -> None:
    """Run ``fn`` on a daemon thread of its own (where :class:`CoordinatorClient` looks the
    coordinator up, off the step path)."""
    threading.Thread(target=fn, name="raytrain-guard-coordinator-lookup", daemon=True).start()


class CoordinatorClient:
    """One rank's link to the coordinator: batched reports out, decisions in, never blocking.

    ``lookup`` finds the coordinator by name; ``run_lookup`` runs it off the step path (on a
    daemon thread by default; ``lambda fn: fn()`` runs it in place, for an instant lookup in a
    test). The first lookup starts when the client is built, so the handle is usually there
    by the first report; a report while none is there is dropped and counted."""

    def __init__(self, name: str, *, namespace: str | None, world_rank: int, node_id: str,
                 report_every_steps: int, attempt: int = 0,
                 setup: Callable[[], Mapping[str, Any]] | None = None,
                 lookup: Callable[[str, str | None], Any] = lookup_actor,
                 run_lookup: Callable[[Callable[[], None]], None] = on_daemon_thread,
                 clock: Callable[[], float] = time.monotonic,
                 retry_after_s: float | None = None) -> None:
        self.name = name
        self.namespace = namespace
        self.world_rank = world_rank
        self.node_id = node_id
        self.report_every_steps = report_every_steps
        self.attempt = attempt
        self.setup = setup
        self.lookup = lookup
        self.run_lookup = run_lookup
        self.clock = clock
        self.retry_after_s = (GuardConfig().coordinator_retry_s if retry_after_s is None
                              else retry_after_s)
        self._handle: Any = None                # set by the lookup, read by the step path
        self._looking_up = False                # a lookup is running
        self._next_lookup_at = float("-inf")
        self._buffer: list[StepStats] = []
        self._reports: list[Any] = []           # refs of unanswered report_steps calls
        self._fetch: Any = None                 # ref of the unanswered decisions_since call
        self._arrived: list[Mapping[str, Any]] = []   # fetched, not yet handed out
        self.cursor = 0                         # newest decision id received
        self._applied: list[tuple[int, int]] = []   # (step, decision id) not reported yet
        self.num_reports_sent = 0
        self.num_reports_dropped = 0
        self.num_failures = 0
        self._warned = False
        self._start_lookup()

    @property
    def connected(self) -> bool:
        return self._handle is not None

    def record(self, stats: StepStats | Iterable[StepStats]) -> None:
        """Keep one step's (or several steps') figures; send a batch every N steps."""
        if isinstance(stats, StepStats):
            self._buffer.append(stats)
        else:
            self._buffer.extend(stats)
        if len(self._buffer) >= self.report_every_steps:
            self._send(fetch=True)

    def flush(self) -> None:
        """Send the steps kept so far, a partial batch: at the end of this rank's run, so the
        coordinator sees its last steps too. Asks no decisions (none is applied any more)."""
        if self._buffer:
            self._send(fetch=False)

    def _send(self, *, fetch: bool) -> None:
        """One report of the kept steps (fail open: dropped and counted when the coordinator
        is not there or is slow), then a decisions fetch unless one is out or ``fetch`` is
        False."""
        batch, self._buffer = self._buffer, []
        handle = self._connect()
        if handle is None:
            self.num_reports_dropped += 1
            return
        if len(self._reports) >= MAX_INFLIGHT_REPORTS:
            self._arrived.extend(self._take_ready())   # rare: only when replies pile up
        if len(self._reports) >= MAX_INFLIGHT_REPORTS:
            self.num_reports_dropped += 1       # the coordinator is slow: never queue up
        else:
            setup = self._current_setup()
            rows = [_row(s) for s in batch]
            applied = {"applied": list(self._applied)} if self._applied else {}
            try:
                self._reports.append(handle.report_steps.remote(
                    self.world_rank, self.node_id, self.attempt, rows, setup, self.cursor,
                    **applied))
                self.num_reports_sent += 1
                self._applied = []
            except Exception as exc:  # noqa: BLE001 - fail open
                self._lose(exc)
                return
        if fetch and self._fetch is None:
            try:
                self._fetch = handle.decisions_since.remote(self.cursor)
            except Exception as exc:  # noqa: BLE001 - fail open
                self._lose(exc)

    def note_applied(self, step: int, decision_id: int) -> None:
        """The lockstep applied ``decision_id`` at ``step`` (every rank agreed on that step):
        sent with the next report, so the coordinator measures the decision's effect from the
        step it took effect, not from the step it asked for."""
        self._applied.append((int(step), int(decision_id)))
        del self._applied[:-64]           # bounded while the coordinator is away

    def _current_setup(self) -> dict[str, Any] | None:
        """The rank's batch layout now (the shrink and prefetch rules' input); None when the
        callable is missing or fails (fail open: the report goes out without it)."""
        if self.setup is None:
            return None
        try:
            return dict(self.setup())
        except Exception as exc:  # noqa: BLE001 - fail open
            logger.debug("rank %d: setup not readable: %r", self.world_rank, exc)
            return None

    def poll_decisions(self) -> list[Decision]:
        """Decisions whose fetch has completed since the last call; ``[]`` without waiting."""
        out = []
        entries, self._arrived = self._arrived + self._take_ready(), []
        for entry in entries:
            try:
                decision = Decision.from_dict(entry)
            except (KeyError, ValueError, TypeError) as exc:
                logger.warning("rank %d: ignoring an unreadable decision %r: %s",
                               self.world_rank, entry, exc)
                continue
            self.cursor = max(self.cursor, decision.decision_id)
            out.append(decision)
        return out

    def _take_ready(self) -> list[Mapping[str, Any]]:
        """What :meth:`_ready_results` collected; ``[]`` when nothing is outstanding or the
        coordinator failed (then it is looked up again later)."""
        if self._fetch is None and not self._reports:
            return []
        try:
            return self._ready_results()
        except Exception as exc:  # noqa: BLE001 - fail open
            self._lose(exc)
            return []

    def _ready_results(self) -> list[Mapping[str, Any]]:
        """The one method that touches ``ray.wait``/``ray.get``, always with timeout 0.

        Collects finished report calls (raising their error, if any, so a dead coordinator is
        noticed) and the decisions of a finished fetch.
        """
        import ray

        refs = list(self._reports) + ([self._fetch] if self._fetch is not None else [])
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=True)
        if not done:
            return []
        done_set = set(done)
        finished_reports = [r for r in self._reports if r in done_set]
        self._reports = [r for r in self._reports if r not in done_set]
        ray.get(finished_reports, timeout=0)
        if self._fetch is not None and self._fetch in done_set:
            fetch, self._fetch = self._fetch, None
            return list(ray.get(fetch, timeout=0) or [])
        return []

    def _connect(self) -> Any:
        """The coordinator's handle, or None while no lookup has found it (a due lookup is
        started, off the step path: its handle serves the next report). Never waits."""
        if self._handle is None:
            self._start_lookup()
        return self._handle

    def _start_lookup(self) -> None:
        now = self.clock()
        if self._looking_up or now < self._next_lookup_at:
            return
        self._next_lookup_at = now + self.retry_after_s
        self._looking_up = True
        try:
            self.run_lookup(self._look_up)
        except Exception as exc:  # noqa: BLE001 - fail open (no thread to be had)
            self._looking_up = False
            self._note_failure(exc)

    def _look_up(self) -> None:
        """Where ``run_lookup`` puts it (a thread of its own): the handle found, or the failure
        counted; the step path reads ``_handle`` only."""
        try:
            handle = self.lookup(self.name, self.namespace)
            logger.info("rank %d: connected to coordinator %s", self.world_rank, self.name)
            self._handle = handle
        except Exception as exc:  # noqa: BLE001 - fail open
            self._note_failure(exc)
        finally:
            self._looking_up = False

    def report_hang(self, record: Mapping[str, Any],
                    timeout_s: float = HANG_REPORT_TIMEOUT_S) -> dict[str, Any] | None:
        """Send this rank's hang watchdog record (from the watchdog's thread); the coordinator's
        verdict, or None when it did not answer within ``timeout_s``. Never raises."""
        return send_hang_record(self.name, self.namespace, self.world_rank, self.node_id,
                                self.attempt, record, timeout_s=timeout_s,
                                handle=self._handle, lookup=self.lookup)

    def _lose(self, exc: BaseException) -> None:
        self._handle = None
        self._reports = []
        self._fetch = None
        self._next_lookup_at = self.clock() + self.retry_after_s
        self._note_failure(exc)

    def _note_failure(self, exc: BaseException) -> None:
        self.num_failures += 1
        log = logger.debug if self._warned else logger.warning
        self._warned = True
        log("rank %d: coordinator %s unreachable (%s: %s); training goes on under the local "
            "gate, retrying every %.0f s", self.world_rank, self.name, type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "", self.retry_after_s)


class LockstepDecisionSource:
    """The train loop's ``decision_source``: coordinator decisions, applied in lockstep.

    Decisions for a step before the first step this source saw belong to an earlier attempt
    of the run (the coordinator outlives worker-group restarts) and are dropped.
    """

    def __init__(self, lockstep: Lockstep, client: CoordinatorClient | None = None) -> None:
        self.lockstep = lockstep
        self.client = client
        self.first_step: int | None = None

    def finish(self, stats: Sequence[StepStats] = ()) -> None:
        """This rank's run ended: ``stats`` (steps no boundary handed over) and the steps the
        client still keeps go to the coordinator, a last partial batch. Fail open."""
        if self.client is not None:
            try:
                if stats:
                    self.client.record(stats)
                self.client.flush()
            except Exception as exc:  # noqa: BLE001
                logger.warning("decision source: last report failed (%r); going on", exc)

    def poll(self, step: int, stats: StepStats | Sequence[StepStats] | None = None
             ) -> list[Decision]:
        """At a step boundary on every rank: decisions to apply at exactly ``step``.

        Runs the lockstep collective every ``lockstep_every_steps`` steps (all ranks call it).
        """
        if self.first_step is None:
            self.first_step = step
        if self.client is not None:
            try:
                if is_agreement_step(step, self.lockstep.every_steps):   # needed now only
                    self.lockstep.offer(d for d in self.client.poll_decisions()
                                        if d.step is None or d.step >= self.first_step)
                if stats:
                    self.client.record(stats)
            except Exception as exc:  # noqa: BLE001 - the guard fails open, lockstep must run
                logger.warning("decision source: client failed (%r); going on", exc)
        due = self.lockstep.poll(step)
        if self.client is not None and self.lockstep.agreed_ids:   # ids heard from other ranks
            self.client.cursor = max(self.client.cursor, max(self.lockstep.agreed_ids))
        if self.client is not None:
            for d in due:
                self.client.note_applied(step, d.decision_id)
        return due

    @property
    def applied(self) -> list[tuple[int, int]]:
        """This rank's log of ``(step, decision_id)`` applied."""
        return self.lockstep.applied

    def report_hang(self, record: Mapping[str, Any],
                    timeout_s: float = HANG_REPORT_TIMEOUT_S) -> dict[str, Any] | None:
        """The watchdog's record to the coordinator (:meth:`CoordinatorClient.report_hang`)."""
        return self.client.report_hang(record, timeout_s) if self.client is not None else None

    def bind_setup(self, setup: Callable[[], Mapping[str, Any]]) -> None:
        """Report ``setup()`` (micro_batch, grad_accum, prefetch_factor as the rank runs now)
        with every batch of statistics; the train loop calls this once before training."""
        if self.client is not None:
            self.client.setup = setup


class ClusterDecisionSource:
    """What the launcher puts in ``train_loop_config["decision_source"]`` (picklable).

    Each worker gets a copy; on the first ``poll`` (every rank, same step) it builds its own
    :class:`LockstepDecisionSource`: the rank and node from the worker context, a
    :class:`~raytrain_guard.cluster.lockstep.ProcessGroupExchange` on the default group, a
    :class:`CoordinatorClient` for ``run_id`` in ``namespace``, the attempt number the
    coordinator issued to rank 0, and a fire-and-forget registration with this node's monitor.
    Whether every rank got that far is agreed in the attempt's collective: if one rank could
    not start, no rank runs the lockstep (a lone rank's fallback would pair mismatched
    collectives).

    ``guard``: the run's :class:`~raytrain_guard.config.GuardConfig` (or a dict of its fields,
    checked on the workers).
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
        """Keep ``setup`` for the client this source builds on its first poll (see
        :meth:`LockstepDecisionSource.bind_setup`)."""
        self._setup = setup
        if isinstance(self._source, LockstepDecisionSource):
            self._source.bind_setup(setup)

    def poll(self, step: int, stats: Sequence[StepStats] | None = None) -> list[Decision]:
        if self._source is None:
            self._source = self._build()
        return self._source.poll(step, stats)

    @property
    def applied(self) -> list[tuple[int, int]]:
        return self._source.applied if self._source is not None else []

    def report_hang(self, record: Mapping[str, Any],
                    timeout_s: float = HANG_REPORT_TIMEOUT_S) -> dict[str, Any] | None:
        """A rank's hang watchdog record to the coordinator, once this source started (the
        watchdog arms after the first steps, so it has); None otherwise. Never raises."""
        source = self._source
        if isinstance(source, LockstepDecisionSource):
            return source.report_hang(record, timeout_s)
        return None

    def _build(self) -> LockstepDecisionSource | _NoDecisions:
        """On every rank at the same step: the lockstep source, or no cluster decisions on
        every rank alike (fail open) when any rank could not start."""
        from raytrain_guard.cluster.lockstep import ProcessGroupExchange, SingleRankExchange
        from raytrain_guard.runtime.context import current_context

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
                from raytrain_guard.cluster.actors import register_worker_with_monitor
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


class ScriptedDecisionSource:
    """A rehearsal ``decision_source``: hands scripted decisions to each rank at the steps the
    script says, as a coordinator would deliver them (at different times on different ranks).

    ``script`` maps a world rank to ``[(poll_step, decision dict), ...]``: at boundary
    ``poll_step`` that rank's ``poll`` returns the decision (``Decision.to_dict()`` form). The
    loop applies it at the decision's own ``step`` (or at once when it has none or it is past),
    so a decision handed to the ranks at different steps but carrying one ``step`` is applied
    in lockstep, which is what :class:`LockstepDecisionSource` guarantees for real. Picklable;
    the rank is read from the worker context on the first poll. Every scripted decision is
    read when the script is given: one that is no decision (a shrink for one node's ranks
    included) raises an InputError naming its entry.
    """

    def __init__(self, script: Mapping[int, Sequence[tuple[int, Mapping[str, Any]]]]) -> None:
        self.script = {int(rank): [(int(at), dict(d)) for at, d in entries]
                       for rank, entries in script.items()}
        for rank, entries in self.script.items():
            for index, (_, d) in enumerate(entries):
                _scripted_decision(f"script[{rank}][{index}]", d)
        self.world_rank: int | None = None
        self.setups: list[tuple[int, dict[str, Any]]] = []   # (step, setup) seen at each poll
        self._setup: Callable[[], Mapping[str, Any]] | None = None

    def bind_setup(self, setup: Callable[[], Mapping[str, Any]]) -> None:
        self._setup = setup

    def poll(self, step: int, stats: Any = None) -> list[Decision]:
        if self.world_rank is None:
            from raytrain_guard.runtime.context import current_context
            self.world_rank = current_context().world_rank
        if self._setup is not None:
            self.setups.append((step, dict(self._setup())))
        return [Decision.from_dict(d) for at, d in self.script.get(self.world_rank, ())
                if at == step]


def _scripted_decision(field: str, d: Mapping[str, Any]) -> Decision:
    """``d`` as a Decision, or an InputError naming ``field`` (the script's entry)."""
    try:
        return Decision.from_dict(d)
    except InputError as err:
        raise InputError(f"{field}.{err.field}", err.problem, value=err.value,
                         fix=err.fix) from None
    except (KeyError, ValueError, TypeError) as err:
        raise InputError(field, f"is not a decision ({err!r})", value=dict(d),
                         fix="script Decision.to_dict() forms") from None


class _NoDecisions:
    """What a decision source that could not start falls back to (on every rank alike)."""

    @property
    def applied(self) -> list[tuple[int, int]]:
        """(step, decision id) of the decisions applied: none."""
        return []

    def poll(self, step: int, stats: Any = None) -> list[Decision]:
        return []


def fetch_attempt(name: str, namespace: str | None,
                  timeout_s: float = ATTEMPT_TIMEOUT_S) -> int:
    """Rank 0's ask for a new attempt number (``Coordinator.next_attempt``); raises when the
    coordinator does not answer within ``timeout_s``. Touches ``ray.get``."""
    import ray
    return int(ray.get(lookup_actor(name, namespace).next_attempt.remote(), timeout=timeout_s))


def send_hang_record(name: str, namespace: str | None, world_rank: int, node_id: str,
                     attempt: int, record: Mapping[str, Any], *,
                     timeout_s: float = HANG_REPORT_TIMEOUT_S, handle: Any = None,
                     lookup: Callable[[str, str | None], Any] = lookup_actor
                     ) -> dict[str, Any] | None:
    """``Coordinator.report_hang`` with a bounded wait: the lookup (when ``handle`` is None)
    and the call run on a daemon thread, joined for at most ``timeout_s``; the coordinator's
    verdict (a dict), or None when it failed or did not answer in time (fail open: the caller
    goes on to end its process). Touches ``ray.get``."""
    answer: dict[str, Any] = {}

    def send() -> None:
        try:
            import ray
            target = handle if handle is not None else lookup(name, namespace)
            answer["verdict"] = ray.get(target.report_hang.remote(
                world_rank, node_id, attempt, dict(record)), timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - fail open
            answer["error"] = exc

    started = time.monotonic()
    thread = threading.Thread(target=send, name="raytrain-guard-hang-report", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if "verdict" in answer:
        return answer["verdict"]
    why = repr(answer["error"]) if "error" in answer else \
        f"no answer within {timeout_s:g} s"
    logger.warning("rank %d: the coordinator did not take the hang record (%s, after %.1f s); "
                   "going on", world_rank, why, time.monotonic() - started)
    return None


def agree_on_start(attempt: int, started: bool) -> tuple[int, bool]:
    """``(attempt, every rank started)`` agreed by all ranks in one collective.

    One ``all_reduce(MAX)`` of ``[attempt, 0 if started else 1]`` on the control plane
    (:func:`~raytrain_guard.runtime.control_plane.shared_control_plane`: a gloo group, CPU
    tensors). Rank 0 brings the coordinator's attempt number and the others 0, so the MAX is
    the issued number; any rank that could not start makes every rank fall back together.
    """
    from raytrain_guard.runtime.control_plane import shared_control_plane
    agreed, not_started = shared_control_plane().all_reduce_max(int(attempt),
                                                                0 if started else 1)
    return agreed, not not_started


def agree_on_attempt(local_id: int, world_size: int | None = None) -> int:
    """The attempt number of :func:`agree_on_start` alone, for callers that had only it.
    ``world_size`` is unused (the control plane knows the world)."""
    return agree_on_start(local_id, True)[0]


def _row(s: StepStats) -> tuple:
    """One step as the coordinator's report row (``coordinator_reports.STEP_FIELDS`` order)."""
    return (s.step, s.total_s, s.data_wait_s, s.forward_s, s.backward_s, s.comm_wait_s,
            s.optimizer_s, s.memory_frac, s.world_rank, s.cpu_wait_s, s.peer_cpu_wait_s,
            s.idle_before_s, s.peer_work_s)
