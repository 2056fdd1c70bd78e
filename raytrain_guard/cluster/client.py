"""The worker-side coordinator client, and the decision source the train loop polls.

:class:`CoordinatorClient` runs inside every training worker. It never blocks a step:

- ``record(stats)`` buffers :class:`~raytrain_guard.core.steps.StepStats`; every
  ``report_every_steps`` of them go to the coordinator in one fire-and-forget ``.remote()``
  call (at most ``MAX_INFLIGHT_REPORTS`` unanswered; beyond that a batch is dropped and counted);
- ``poll_decisions()`` asks ``decisions_since(cursor)`` once per report batch and collects the
  answer with ``ray.wait(timeout=0)`` when it has arrived, never waiting for it;
- any failure (coordinator dead, restarting, not started yet, Ray gone) drops the handle; the
  lookup by name is retried lazily, at most once per ``retry_after_s`` of the injected clock.
  Meanwhile training goes on under the local gate rules: the guard fails open.

:class:`LockstepDecisionSource` is the ``decision_source`` seam of the shared train loop
(``poll(step, stats) -> list[Decision]``): it feeds the client, hands fetched decisions to
:class:`~raytrain_guard.cluster.lockstep.Lockstep` and returns what every rank applies at this
step. The coordinator actor methods used: ``report_steps(world_rank, node_id, attempt,
stats, setup)`` and ``decisions_since(decision_id) -> list[dict]``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from raytrain_guard.cluster.lockstep import Lockstep
from raytrain_guard.core.decisions import Decision
from raytrain_guard.core.steps import StepStats

logger = logging.getLogger(__name__)

COORDINATOR_PREFIX = "raytrain_guard:coordinator:"
MAX_INFLIGHT_REPORTS = 4


def coordinator_name(run_id: str) -> str:
    """The coordinator actor's name for a run (``raytrain_guard:coordinator:<run id>``)."""
    return f"{COORDINATOR_PREFIX}{run_id}"


def lookup_actor(name: str, namespace: str | None) -> Any:
    """The named actor's handle (raises ValueError when there is none)."""
    import ray
    return ray.get_actor(name, namespace=namespace)


class CoordinatorClient:
    """One rank's link to the coordinator: batched reports out, decisions in, never blocking."""

    def __init__(self, name: str, *, namespace: str | None, world_rank: int, node_id: str,
                 report_every_steps: int, attempt: int = 0,
                 setup: Callable[[], Mapping[str, Any]] | None = None,
                 lookup: Callable[[str, str | None], Any] = lookup_actor,
                 clock: Callable[[], float] = time.monotonic, retry_after_s: float = 5.0) -> None:
        self.name = name
        self.namespace = namespace
        self.world_rank = world_rank
        self.node_id = node_id
        self.report_every_steps = report_every_steps
        self.attempt = attempt
        self.setup = setup
        self.lookup = lookup
        self.clock = clock
        self.retry_after_s = retry_after_s
        self._handle: Any = None
        self._next_lookup_at = float("-inf")
        self._buffer: list[dict[str, Any]] = []
        self._reports: list[Any] = []           # refs of unanswered report_steps calls
        self._fetch: Any = None                 # ref of the unanswered decisions_since call
        self.cursor = 0                         # newest decision id received
        self.num_reports_sent = 0
        self.num_reports_dropped = 0
        self.num_failures = 0
        self._warned = False

    @property
    def connected(self) -> bool:
        return self._handle is not None

    def record(self, stats: StepStats | Iterable[StepStats]) -> None:
        """Buffer one step's (or several steps') figures; send a batch every N steps."""
        batch = [stats] if isinstance(stats, StepStats) else list(stats)
        self._buffer.extend(s.to_dict() for s in batch)
        if len(self._buffer) < self.report_every_steps:
            return
        stats_dicts, self._buffer = self._buffer, []
        handle = self._connect()
        if handle is None:
            self.num_reports_dropped += 1
            return
        if len(self._reports) >= MAX_INFLIGHT_REPORTS:
            self.num_reports_dropped += 1       # the coordinator is slow: never queue up
        else:
            setup = self._current_setup()
            try:
                self._reports.append(handle.report_steps.remote(
                    self.world_rank, self.node_id, self.attempt, stats_dicts, setup))
                self.num_reports_sent += 1
            except Exception as exc:  # noqa: BLE001 - fail open
                self._lose(exc)
                return
        if self._fetch is None:
            try:
                self._fetch = handle.decisions_since.remote(self.cursor)
            except Exception as exc:  # noqa: BLE001 - fail open
                self._lose(exc)

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
        if self._fetch is None and not self._reports:
            return []
        try:
            ready = self._ready_results()
        except Exception as exc:  # noqa: BLE001 - fail open
            self._lose(exc)
            return []
        out = []
        for entry in ready:
            try:
                decision = Decision.from_dict(entry)
            except (KeyError, ValueError, TypeError) as exc:
                logger.warning("rank %d: ignoring an unreadable decision %r: %s",
                               self.world_rank, entry, exc)
                continue
            self.cursor = max(self.cursor, decision.decision_id)
            out.append(decision)
        return out

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
        if self._handle is not None:
            return self._handle
        now = self.clock()
        if now < self._next_lookup_at:
            return None
        self._next_lookup_at = now + self.retry_after_s
        try:
            self._handle = self.lookup(self.name, self.namespace)
            logger.info("rank %d: connected to coordinator %s", self.world_rank, self.name)
        except Exception as exc:  # noqa: BLE001 - fail open
            self._note_failure(exc)
        return self._handle

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

    def poll(self, step: int, stats: StepStats | Sequence[StepStats] | None = None
             ) -> list[Decision]:
        """At a step boundary on every rank: decisions to apply at exactly ``step``.

        Runs the lockstep collective every ``lockstep_every_steps`` steps (all ranks call it).
        """
        if self.first_step is None:
            self.first_step = step
        if self.client is not None:
            try:
                if stats:
                    self.client.record(stats)
                self.lockstep.offer(d for d in self.client.poll_decisions()
                                    if d.step is None or d.step >= self.first_step)
            except Exception as exc:  # noqa: BLE001 - the guard fails open, lockstep must run
                logger.warning("decision source: client failed (%r); going on", exc)
        return self.lockstep.poll(step)

    @property
    def applied(self) -> list[tuple[int, int]]:
        """This rank's log of ``(step, decision_id)`` applied."""
        return self.lockstep.applied

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
    :class:`CoordinatorClient` for ``run_id`` in ``namespace``, an attempt id agreed by all ranks,
    and a fire-and-forget registration with this node's monitor.
    """

    def __init__(self, run_id: str, namespace: str, guard: Mapping[str, Any] | None = None,
                 *, register_with_monitor: bool = True) -> None:
        self.run_id = run_id
        self.namespace = namespace
        self.guard = dict(guard or {})
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
            try:
                self._source = self._build()
            except Exception as exc:  # noqa: BLE001 - fail open; the causes are rank-symmetric
                logger.warning("decision source could not start (%r): no cluster decisions "
                               "in this run, the local gate still acts", exc)
                self._source = _NoDecisions()
        return self._source.poll(step, stats)

    @property
    def applied(self) -> list[tuple[int, int]]:
        return self._source.applied if self._source is not None else []

    def _build(self) -> LockstepDecisionSource:
        from raytrain_guard.cluster.lockstep import ProcessGroupExchange, SingleRankExchange
        from raytrain_guard.config import GuardConfig
        from raytrain_guard.runtime.context import current_context

        config = GuardConfig.from_dict(self.guard, source="decision_source guard")
        ctx = current_context()
        exchange = ProcessGroupExchange() if ctx.world_size > 1 else SingleRankExchange()
        attempt = agree_on_attempt(int(time.time() * 1000), ctx.world_size)
        if self.register_with_monitor:
            try:
                from raytrain_guard.cluster.actors import register_worker_with_monitor
                register_worker_with_monitor(self.namespace, ctx.world_rank)
            except Exception as exc:  # noqa: BLE001 - fail open
                logger.warning("rank %d: monitor registration failed: %r", ctx.world_rank, exc)
        client = CoordinatorClient(coordinator_name(self.run_id), namespace=self.namespace,
                                   world_rank=ctx.world_rank, node_id=ctx.node_id or "local",
                                   report_every_steps=config.report_every_steps,
                                   attempt=attempt, setup=getattr(self, "_setup", None))
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
    the rank is read from the worker context on the first poll.
    """

    def __init__(self, script: Mapping[int, Sequence[tuple[int, Mapping[str, Any]]]]) -> None:
        self.script = {int(rank): [(int(at), dict(d)) for at, d in entries]
                       for rank, entries in script.items()}
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


class _NoDecisions:
    """What a decision source that could not start falls back to (on every rank alike)."""

    applied: list[tuple[int, int]] = []

    def poll(self, step: int, stats: Any = None) -> list[Decision]:
        return []


def agree_on_attempt(local_id: int, world_size: int) -> int:
    """The run attempt id every rank reports with: the largest of the ranks' start times (ms).

    A collective on the default ``torch.distributed`` group (one int64 all_reduce(MAX)) when
    the world has more than one rank. It grows from one worker-group start to the next, which
    is what the coordinator needs to tell a new attempt from a stale one.
    """
    if world_size <= 1:
        return local_id
    import torch
    import torch.distributed as dist

    device = None
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([local_id], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())
