"""How a train worker or a node monitor reaches its run's actors: their names, the calls that
go through a daemon thread (:class:`CoordinatorLink`), and the few that wait with a bound.
Every call fails open: an absent, slow or dead coordinator costs a counted drop or a warning.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

COORDINATOR_PREFIX = "raytrain_guard:coordinator:"
MONITOR_PREFIX = "raytrain_guard:monitor:"
REPLY_TIMEOUT_S = 10.0
"""How long the link waits for an answer before it counts the coordinator as gone (a healthy
answer takes milliseconds)."""
ATTEMPT_TIMEOUT_S = 30.0
"""How long rank 0 waits for ``next_attempt`` at start: long enough for Ray to restart a
coordinator that died just then."""
POLL_S = 0.05
"""How often a link whose caller does not wake it looks at its queue (waking a thread would
cost the training thread; docs/benchmarks.md)."""
HANG_REPORT_TIMEOUT_S = 1.5
"""How long a hang watchdog waits for the coordinator to take its record before the process
ends (and so the group restarts)."""


def coordinator_name(run_id: str) -> str:
    """The coordinator actor's name for a run (``raytrain_guard:coordinator:<run id>``)."""
    return f"{COORDINATOR_PREFIX}{run_id}"


def monitor_name(run_id: str, node_id: str) -> str:
    """``raytrain_guard:monitor:<run id>:<node id>``."""
    return f"{MONITOR_PREFIX}{run_id}:{node_id}"


def lookup_actor(name: str, namespace: str | None) -> Any:
    """The named actor's handle (ValueError when there is none)."""
    import ray
    return ray.get_actor(name, namespace=namespace)


def wait_for(refs: Sequence[Any], timeout_s: float = REPLY_TIMEOUT_S) -> list:
    """The answers of actor calls (``ray.get`` with a timeout; raises what the calls raised)."""
    import ray
    return ray.get(list(refs), timeout=timeout_s)


class CoordinatorLink:
    """Calls to a named actor (the run's coordinator) made by a daemon thread of its own, so the
    caller never waits on the actor or on Ray's name lookup.

    :meth:`submit` queues ``call(handle)`` and returns at once; past ``max_queued`` waiting
    calls, or while no actor is found (looked up at most once per ``retry_after_s``), calls are
    dropped and counted. A call that raises drops the handle, to be looked up again.
    ``background=False`` runs the calls in the caller's thread (tests).
    """

    def __init__(self, name: str, namespace: str | None, *, max_queued: int,
                 retry_after_s: float, lookup: Callable[[str, str | None], Any] = lookup_actor,
                 clock: Callable[[], float] = time.monotonic, background: bool = True,
                 poll_s: float | None = None, who: str = "") -> None:
        self.name, self.namespace = name, namespace
        self.max_queued, self.retry_after_s, self.poll_s = max_queued, retry_after_s, poll_s
        self._lookup, self._clock, self._who = lookup, clock, who or f"pid {os.getpid()}"
        self.handle: Any = None                 # set and cleared by the link's thread only
        self._next_lookup_at = float("-inf")
        self._queue: deque[Callable[[Any], None]] = deque()
        self._busy = False                      # a call is running
        self._wake = threading.Event()
        self._closed = False
        self.num_full = 0                       # dropped by submit: the queue was full
        self.num_unsent = 0                     # dropped by the thread: no coordinator
        self.num_failures = 0
        self._warned = False
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="raytrain-guard-coordinator-link")
            self._thread.start()
        else:
            self._connect()

    @property
    def connected(self) -> bool:
        return self.handle is not None

    @property
    def num_dropped(self) -> int:
        return self.num_full + self.num_unsent

    def submit(self, call: Callable[[Any], None], *, wake: bool = True) -> bool:
        """Queue ``call(handle)``; False when it was dropped (the queue full). Never waits.
        ``wake=False`` leaves it for the thread's next look, unless half the queue is taken."""
        if len(self._queue) >= self.max_queued:
            self.num_full += 1
            return False
        self._queue.append(call)
        if self._thread is None:
            self._pump()
        elif wake or 2 * len(self._queue) >= self.max_queued:
            self._wake.set()
        return True

    def drain(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the queued calls to be done or dropped; whether they were."""
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        while self._queue or self._busy:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
        return True

    def close(self) -> None:
        """End the thread once the calls queued now are done."""
        self._closed = True
        self._wake.set()

    def _run(self) -> None:
        self._connect()          # at once: the handle is usually there by the first call
        while True:
            self._wake.wait(self.poll_s)
            self._wake.clear()
            self._pump()
            if self._closed:
                return

    def _pump(self) -> None:
        while self._queue:
            self._busy = True
            try:
                handle = self._connect()
                call = self._queue.popleft()
                if handle is None:
                    self.num_unsent += 1
                    continue
                try:
                    call(handle)
                except Exception as exc:  # noqa: BLE001 - fail open
                    self._lose(exc)
            finally:
                self._busy = False

    def _connect(self) -> Any:
        """The handle, looked up when there is none and a lookup is due."""
        if self.handle is None and self._clock() >= self._next_lookup_at:
            self._next_lookup_at = self._clock() + self.retry_after_s
            try:
                self.handle = self._lookup(self.name, self.namespace)
                logger.info("%s: connected to %s", self._who, self.name)
            except Exception as exc:  # noqa: BLE001 - fail open
                self._note_failure(exc)
        return self.handle

    def _lose(self, exc: BaseException) -> None:
        self.handle = None
        self._next_lookup_at = self._clock() + self.retry_after_s
        self._note_failure(exc)

    def _note_failure(self, exc: BaseException) -> None:
        self.num_failures += 1
        log = logger.debug if self._warned else logger.warning
        self._warned = True
        log("%s: %s unreachable (%s: %s); going on without it, retrying every %.0f s",
            self._who, self.name, type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "", self.retry_after_s)


def fetch_attempt(name: str, namespace: str | None,
                  timeout_s: float = ATTEMPT_TIMEOUT_S) -> int:
    """Rank 0's ask for a new attempt number (``Coordinator.next_attempt``), within ``timeout_s``."""
    return int(wait_for([lookup_actor(name, namespace).next_attempt.remote()], timeout_s)[0])


def send_hang_record(name: str, namespace: str | None, world_rank: int, node_id: str,
                     attempt: int, record: Mapping[str, Any], *,
                     timeout_s: float = HANG_REPORT_TIMEOUT_S, handle: Any = None,
                     lookup: Callable[[str, str | None], Any] = lookup_actor
                     ) -> dict[str, Any] | None:
    """``Coordinator.report_hang`` on a daemon thread joined for at most ``timeout_s``: the
    coordinator's verdict (a dict), or None when it failed or did not answer in time."""
    answer: dict[str, Any] = {}

    def send() -> None:
        try:
            target = handle if handle is not None else lookup(name, namespace)
            answer["verdict"] = wait_for([target.report_hang.remote(
                world_rank, node_id, attempt, dict(record))], timeout_s)[0]
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


def register_worker_with_monitor(namespace: str, run_id: str, world_rank: int | None = None,
                                 pid: int | None = None) -> bool:
    """Ask this node's monitor of the run to sample this process (fire-and-forget); False when
    there is no such monitor."""
    import ray
    node_id = ray.get_runtime_context().get_node_id()
    try:
        handle = lookup_actor(monitor_name(run_id, node_id), namespace)
        handle.register_worker.remote(os.getpid() if pid is None else pid, world_rank)
        return True
    except Exception as exc:  # noqa: BLE001 - fail open
        logger.warning("rank %s: no monitor on node %s (%s); host memory of this worker is not "
                       "sampled", world_rank, node_id[:12], exc)
        return False
