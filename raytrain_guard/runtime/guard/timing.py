"""The step timer: cheap phase marks summed into StepStats.

:class:`StepTimer` stamps a step's phases (host clock on CPU, CUDA events on CUDA, never
synchronized) and sums them into :class:`~raytrain_guard.core.steps.StepStats`; the
communication timers (:mod:`raytrain_guard.runtime.guard.comm_timers`) add the communication
wait. What each figure means: docs/train_loop.md, "Step timings".
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from raytrain_guard.core.steps import StepStats
from raytrain_guard.errors import InputError
from raytrain_guard.runtime.guard.node_peers import NodePeers

logger = logging.getLogger(__name__)

#: Phase names accepted by :meth:`StepTimer.mark`, and the StepStats field each one fills.
PHASE_FIELDS = {"data": "data_wait_s", "data_wait": "data_wait_s", "forward": "forward_s",
                "backward": "backward_s", "optimizer": "optimizer_s"}
_SLOT = {"data": 0, "data_wait": 0, "forward": 1, "backward": 2, "optimizer": 3}
_BACKWARD, _OPTIMIZER = _SLOT["backward"], _SLOT["optimizer"]
#: the slot of a stamp that ends no phase (a step's start, its end)
UNTIMED = -1


class _StepRecord:
    """Stamps of one step: floats on CPU, CUDA events on CUDA."""

    __slots__ = ("collectives", "done", "figures", "idle_before", "judged",
                 "last_ready", "lender", "lends_end", "marks", "opened", "prev_opened",
                 "released", "step")

    def __init__(self, start: Any, opened: float, lender: _StepRecord | None = None) -> None:
        self.step: int | None = None     # None: nobody began it (it opened where the last ended)
        self.opened = opened             # host clock at ``start``
        self.prev_opened = opened        # the previous step's ``opened`` (set at the close)
        self.judged = False              # the gate may judge it: it reads the node's peers
        self.figures: tuple[float, ...] | None = None  # host stamps: _figures, once computed
        self.marks: list[tuple[int, Any]] = [(UNTIMED, start)]  # (slot of phase ended, stamp)
        self.last_ready: Any = None      # stamp when the last bucket became ready
        self.done: list[Any] = []        # stamps of allreduce completions
        # host clock only: (start, end) of collectives the training thread blocked in (FSDP2)
        self.collectives: list[tuple[float, float]] = []
        self.idle_before: float | None = None    # host seconds since the previous step closed
        # CUDA event pooling: a step that starts where the previous one ended shares that
        # record's end event; the later step gives it back, never the lender
        self.lender = lender
        self.lends_end = False
        self.released = False
        if lender is not None:
            lender.lends_end = True


class _EventPool:
    """Reusable CUDA timing events (each new ``torch.cuda.Event`` is a driver call). A step's
    events return here once its figures are read, or it is dropped."""

    def __init__(self) -> None:
        self._free: list[Any] = []
        self.num_created = 0

    def stamp(self) -> Any:
        """An event recorded now on the current stream. Called from the training thread and
        DDP's communication callbacks: ``list.pop`` and ``append`` are atomic."""
        try:
            event = self._free.pop()
        except IndexError:
            import torch
            event = torch.cuda.Event(enable_timing=True)
            self.num_created += 1
        event.record()
        return event

    def release(self, record: _StepRecord) -> None:
        """Take back ``record``'s events once its figures are read (or it is dropped): all of
        them but its end when the next step started there (that step gives it back)."""
        marks = record.marks[:-1] if record.lends_end else record.marks
        self._free.extend(stamp for _, stamp in marks)
        self._take_comm(record)
        record.released = True
        record.lender = None

    def discard(self, record: _StepRecord) -> None:
        """Take back the events of a step record that is replaced before it finished
        (:meth:`StepTimer.begin_step`); a borrowed start goes back to its lender, unless the
        lender was read already (then nobody holds it)."""
        lender, record.lender = record.lender, None
        if lender is not None:
            lender.lends_end = False
        if lender is None or lender.released:
            self._free.append(record.marks[0][1])
        self._free.extend(stamp for _, stamp in record.marks[1:])
        self._take_comm(record)

    def _take_comm(self, record: _StepRecord) -> None:
        self._free.extend(record.done)
        if record.last_ready is not None:
            self._free.append(record.last_ready)


class StepTimer:
    """Per-step phase timer of one rank: a clock read and a list append per mark.

    ``device``: CUDA for event timing on the GPU timeline, anything else for host time
    (``clock``). ``max_pending`` bounds the CUDA steps waiting for their events. ``peers``:
    the node's board, where each step the gate may judge publishes its work and reads the
    other local ranks' (``StepStats.peer_work_s``).
    """

    def __init__(self, *, device: Any = None, clock: Callable[[], float] = time.perf_counter,
                 world_rank: int = 0, max_pending: int = 4, peers: NodePeers | None = None
                 ) -> None:
        self.world_rank = world_rank
        self._clock = clock
        self._cuda = str(device).startswith("cuda") if device is not None else False
        self._max_pending = max_pending
        self._pending: deque[_StepRecord] = deque()
        self._dropped = 0
        self._events = _EventPool() if self._cuda else None
        #: a stamp now: the host clock's float, or a recorded CUDA event
        self._stamp: Callable[[], Any] = clock if self._events is None else self._events.stamp
        start = self._stamp()
        self._record = _StepRecord(start, start if self._events is None else self._clock())
        self._peers = peers
        self._closed_at: float | None = None   # host clock when the last step closed
        self._last_opened = self._record.opened    # ``opened`` of the last step closed

    @classmethod
    def for_worker(cls, *, device: Any, world_rank: int, local_rank: int,
                   local_world_size: int) -> StepTimer:
        """A training worker's timer (the train loop's and the drop-in's), with the board of
        the node's other local ranks (released by :meth:`close`)."""
        return cls(device=device, world_rank=world_rank,
                   peers=NodePeers.for_group(local_rank, local_world_size))

    def close(self) -> None:
        """The run is over: the node board, if any, is released."""
        board, self._peers = self._peers, None
        if board is not None:
            board.close()

    def begin_step(self, step: int) -> None:
        """Start timing ``step`` now (optional: a step otherwise starts where the last ended)."""
        if self._events is not None:
            self._events.discard(self._record)
        start = self._stamp()
        opened = start if self._events is None else self._clock()
        record = self._record = _StepRecord(start, opened)
        record.step = step
        if self._closed_at is not None:       # the loop's time between the two steps
            record.idle_before = opened - self._closed_at

    @property
    def step_begun(self) -> bool:
        """Whether the current step was begun or stamped since the previous one closed: a
        data loader that opens steps (:meth:`StepGuard.attach_loader`) opens only the others."""
        return self._record.step is not None or len(self._record.marks) > 1

    def mark(self, phase: str) -> None:
        """End ``phase`` now: the time since the previous mark is counted as ``phase``."""
        try:
            slot = _SLOT[phase]
        except (KeyError, TypeError):
            raise _unknown_phase(phase) from None
        self._record.marks.append((slot, self._stamp()))

    @contextlib.contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        """``with timer.phase("forward"): ...`` counts the body as ``phase``."""
        slot = _SLOT.get(phase)
        if slot is None:
            raise _unknown_phase(phase)
        self._record.marks.append((UNTIMED, self._stamp()))
        try:
            yield
        finally:
            self._record.marks.append((slot, self._stamp()))

    def finish_step(self, step: int, *, memory_frac: float | None = None) -> StepStats | None:
        """Close ``step``; return its stats (host) or the oldest finished earlier step's
        (CUDA, None while its events run). ``memory_frac`` (read now) goes into them."""
        if not self._cuda:
            record, _ = self.close_step(step)
            self.publish_work(record)
            return self._stats(record, _host_s, memory_frac)
        end = self._stamp()
        record = self._record
        record.step = step
        record.marks.append((UNTIMED, end))
        record.prev_opened, self._last_opened = self._last_opened, record.opened
        record.judged = True                   # its work is published once its events complete
        self._closed_at = self._clock()
        self._record = _StepRecord(end, self._closed_at, record)
        self._pending.append(record)
        if len(self._pending) > self._max_pending:
            self._events.release(self._pending.popleft())
            self._dropped += 1
            if self._dropped == 1:
                logger.warning("rank %d: step timings dropped: the GPU is more than %d steps "
                               "behind the host", self.world_rank, self._max_pending)
        if self._pending and _all_done(self._pending[0]):
            oldest = self._pending.popleft()
            stats = self._stats(oldest, _elapsed_s, memory_frac)
            self._events.release(oldest)
            return stats
        return None

    @property
    def pending_phase(self) -> str | None:
        """The phase the time from the current step's last mark to its close will count as:
        ``"optimizer"`` after a backward mark (see the module doc), else None (untimed)."""
        return "optimizer" if self._record.marks[-1][0] == _BACKWARD else None

    @property
    def on_host(self) -> bool:
        """Whether stamps are host-clock floats, so :meth:`close_step` may be used."""
        return not self._cuda

    def close_step(self, step: int) -> tuple[_StepRecord, float]:
        """Host timers only: close ``step`` and defer its StepStats (StepGuard's fast path
        builds them in batches). Returns its record (for :meth:`stats_of`) and ``total_s``."""
        end = self._clock()
        record = self._record
        record.step = step
        record.marks.append((UNTIMED, end))
        record.prev_opened, self._last_opened = self._last_opened, record.opened
        self._closed_at = end
        self._record = _StepRecord(end, end)
        return record, end - record.marks[0][1]

    def stats_of(self, record: _StepRecord, memory_frac: float | None) -> StepStats:
        """The StepStats of a record that :meth:`close_step` returned."""
        return self._stats(record, _host_s, memory_frac)

    def publish_work(self, record: _StepRecord) -> None:
        """Host stamps: the gate may judge the step that just closed (``record``): its work
        (its time less its communication wait) goes on the node's board, and its StepStats
        will carry the other local ranks'. After :meth:`close_step`, StepGuard asks it for the
        steps over the gate's quiet bound only."""
        record.judged = True
        if self._peers is not None:
            record.figures = self._figures(record, _host_s)   # _stats takes them from here
            total_s, *_, comm_wait_s = record.figures
            self._peers.publish(record.step, total_s - comm_wait_s)

    # -- called by the communication hook (autograd and communication threads) ---------------
    def record_bucket_ready(self, is_last: bool) -> None:
        """A DDP bucket's gradients are computed; ``is_last``: the backward compute is over."""
        if is_last:
            self._record.last_ready = self._stamp()

    def record_bucket_done(self) -> None:
        """A bucket's allreduce future completed."""
        self._record.done.append(self._stamp())

    def record_collective(self, start: float, end: float) -> None:
        """Host timers only: the training thread was blocked in a collective from ``start`` to
        ``end`` (host clock). It counts as communication wait, not as the phase it fell in."""
        self._record.collectives.append((start, end))

    def now(self) -> float:
        """The host clock this timer stamps with."""
        return self._clock()

    # -- internals ---------------------------------------------------------------------------
    def _stats(self, record: _StepRecord, elapsed: Callable[[Any, Any], float],
               memory_frac: float | None) -> StepStats:
        """The step's StepStats; ``elapsed(start, end)``: seconds between two stamps."""
        total_s, data_s, forward_s, backward_s, optimizer_s, comm_wait_s = \
            record.figures or self._figures(record, elapsed)
        peer_work_s = None
        if self._peers is not None and record.judged:
            if self._cuda:                      # the work is known now
                self._peers.publish(record.step, total_s - comm_wait_s)
            peer_work_s = self._peers.peer_work(record.step, record.opened, record.prev_opened)
        return StepStats(record.step, total_s, data_s, forward_s, backward_s,  # positional:
                         comm_wait_s, optimizer_s, memory_frac, self.world_rank,  # per step
                         record.idle_before, peer_work_s)

    def _figures(self, record: _StepRecord, elapsed: Callable[[Any, Any], float]
                 ) -> tuple[float, float, float, float, float, float]:
        """(total, data wait, forward, backward, optimizer, communication wait) seconds: the
        phases summed."""
        sums = [0.0, 0.0, 0.0, 0.0]
        marks = record.marks
        prev = marks[0][1]
        for slot, stamp in marks:
            if slot >= 0:
                sums[slot] += elapsed(prev, stamp)
            prev = stamp
        total_s = elapsed(marks[0][1], prev)
        if marks[-2][0] == _BACKWARD:
            # what follows the backward pass is the optimizer's (marks[-2] exists: a closed
            # record starts and ends with an UNTIMED stamp)
            sums[_OPTIMIZER] += elapsed(marks[-2][1], prev)
        blocked_s = _blocked_by_phase(marks, list(record.collectives), sums) \
            if record.collectives else 0.0
        comm_wait_s = 0.0
        if record.last_ready is not None and record.done:
            comm_wait_s = max(0.0, max(elapsed(record.last_ready, d) for d in record.done))
        return (total_s, sums[0], sums[1], max(0.0, sums[2] - comm_wait_s), sums[3],
                comm_wait_s + blocked_s)


def _blocked_by_phase(marks: list[tuple[int, Any]], collectives: list[tuple[float, float]],
                      sums: list[float]) -> float:
    """Take the time spent blocked in ``collectives`` out of the phases it fell in (``sums``,
    in place) and return it. Host stamps; marks and collectives are both in time order, so
    one walk over the two does it."""
    blocked = 0.0
    i, n = 0, len(collectives)
    prev = marks[0][1]
    last = len(marks) - 1
    for k, (slot, stamp) in enumerate(marks):
        if k == last and marks[-2][0] == _BACKWARD:
            slot = _OPTIMIZER            # the close after a backward mark is the optimizer's
        while i < n and collectives[i][0] < stamp:
            start, end = collectives[i]
            if end > stamp:              # runs past this mark: split it there
                collectives[i] = (stamp, end)
                end = stamp
            else:
                i += 1
            spent = end - max(start, prev)
            if slot >= 0 and spent > 0:
                sums[slot] -= spent
                blocked += spent
        prev = stamp
    return blocked


def _unknown_phase(phase: Any) -> InputError:
    return InputError("phase", "unknown phase", value=phase,
                      fix=f"use one of {', '.join(sorted(PHASE_FIELDS))}")


def _all_done(record: _StepRecord) -> bool:
    """Whether every event of ``record`` has completed (no list built: this runs every step).
    The last mark is recorded last on the stream, so it is queried first."""
    for _, stamp in reversed(record.marks):
        if not stamp.query():
            return False
    if record.last_ready is not None and not record.last_ready.query():
        return False
    return all(e.query() for e in record.done)


def _elapsed_s(start: Any, end: Any) -> float:
    return start.elapsed_time(end) / 1000.0


def _host_s(start: float, end: float) -> float:
    return end - start


