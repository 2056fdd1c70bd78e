"""Step timing: cheap phase marks, and communication timers for DDP and FSDP2.

:class:`StepTimer` stamps a step's phases (host clock on CPU, CUDA events on CUDA, never
synchronized) and sums them into :class:`~raytrain_guard.core.steps.StepStats`;
:func:`attach_comm_timer` (a DDP communication hook) and :func:`attach_fsdp_comm_timer` (FSDP2's
custom collectives) add the communication wait. What each figure means: docs/train_loop.md,
"Step timings".
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from raytrain_guard.core.steps import StepStats
from raytrain_guard.errors import InputError

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

    __slots__ = ("collectives", "cpu_wait", "done", "figures", "idle_before", "judged",
                 "last_ready", "lender", "lends_end", "marks", "opened", "prev_opened",
                 "released", "step")

    def __init__(self, start: Any, opened: float, lender: _StepRecord | None = None) -> None:
        self.step: int | None = None     # None: nobody began it (it opened where the last ended)
        self.opened = opened             # host clock at ``start``
        self.prev_opened = opened        # the previous step's ``opened`` (set at the close)
        self.judged = False              # read_cpu_wait asked for it: the gate may judge it
        self.figures: tuple[float, ...] | None = None  # host stamps: _figures, once computed
        self.marks: list[tuple[int, Any]] = [(UNTIMED, start)]  # (slot of phase ended, stamp)
        self.last_ready: Any = None      # stamp when the last bucket became ready
        self.done: list[Any] = []        # stamps of allreduce completions
        # host clock only: (start, end) of collectives the training thread blocked in (FSDP2)
        self.collectives: list[tuple[float, float]] = []
        self.cpu_wait: float | None = None   # the training thread's run-queue wait, seconds
        self.idle_before: float | None = None    # host seconds since the previous step closed
        # CUDA event pooling: a step that starts where the previous one ended shares that
        # record's end event; the later step gives it back, never the lender
        self.lender = lender
        self.lends_end = False
        self.released = False
        if lender is not None:
            lender.lends_end = True


class _EventPool:
    """Reusable CUDA timing events (a step records about ten; each new ``torch.cuda.Event`` is
    a driver call). A step's events return here once its figures are read, or it is dropped."""

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
        free = self._free
        marks = record.marks
        free.extend(stamp for _, stamp in marks[:-1])
        if not record.lends_end and len(marks) > 1:
            free.append(marks[-1][1])
        free.extend(record.done)
        if record.last_ready is not None:
            free.append(record.last_ready)
        record.released = True
        record.lender = None

    def discard(self, record: _StepRecord) -> None:
        """Take back the events of a step record that is replaced before it finished
        (:meth:`StepTimer.begin_step`); a borrowed start goes back to its lender."""
        lender, record.lender = record.lender, None
        if lender is not None:
            lender.lends_end = False
            if lender.released:          # read already: nobody holds that event now
                self._free.append(record.marks[0][1])
        else:
            self._free.append(record.marks[0][1])
        self._free.extend(stamp for _, stamp in record.marks[1:])
        self._free.extend(record.done)
        if record.last_ready is not None:
            self._free.append(record.last_ready)


class StepTimer:
    """Per-step phase timer of one rank. Cheap: a clock read and a list append per mark.

    ``device``: ``"cuda"`` (or a CUDA ``torch.device``) for event timing on the GPU timeline,
    anything else for host time. ``clock`` is the host clock (tests pass a fake one).
    ``max_pending`` bounds the CUDA steps waiting for their events. ``cpu_wait``: the training
    thread's cumulative run-queue wait in seconds (a
    :class:`~raytrain_guard.runtime.cpu_wait.ThreadCpuWait`'s ``read``; None: not measured),
    read when a step closes (:meth:`finish_step` every step, :meth:`read_cpu_wait` after
    :meth:`close_step`), for ``StepStats.cpu_wait_s``: the wait since the previous close, when
    that one was read too. ``node_waits``: a
    :class:`~raytrain_guard.runtime.node_cpu_waits.NodeCpuWaits` that each step's wait is
    published to, and the other local ranks' waits in it read from when the step's figures are
    built, for ``StepStats.peer_cpu_wait_s``.
    """

    def __init__(self, *, device: Any = None, clock: Callable[[], float] = time.perf_counter,
                 world_rank: int = 0, max_pending: int = 4,
                 cpu_wait: Callable[[], float | None] | None = None,
                 node_waits: Any = None) -> None:
        self.world_rank = world_rank
        self._clock = clock
        self._cuda = str(device).startswith("cuda") if device is not None else False
        self._max_pending = max_pending
        self._pending: deque[_StepRecord] = deque()
        self._dropped = 0
        self._events = _EventPool() if self._cuda else None
        start = self._stamp()
        self._record = _StepRecord(start, start if self._events is None else self._clock())
        self._cpu_wait = cpu_wait
        self._node_waits = node_waits
        self._cpu_wait_read: tuple[int, float] | None = None  # (step, reading) at the last
                                                              # close read
        self._closed_at: float | None = None   # host clock when the last step closed
        self._last_opened = self._record.opened    # ``opened`` of the last step closed

    @classmethod
    def measuring_cpu_wait(cls, *, node_waits: Any = None, **kwargs: Any) -> StepTimer:
        """A timer that also measures the training thread's wait for a CPU (the train loop's
        and the workers' timers), and with ``node_waits`` (a
        :class:`~raytrain_guard.runtime.node_cpu_waits.NodeCpuWaits`) the other local ranks'."""
        from raytrain_guard.runtime.cpu_wait import ThreadCpuWait

        return cls(cpu_wait=ThreadCpuWait().read, node_waits=node_waits, **kwargs)

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
        """Close ``step``; return its stats (CPU) or the oldest finished earlier step's (CUDA).
        ``memory_frac`` (read now) goes into the returned stats as they are."""
        end = self._stamp()
        record = self._record
        record.step = step
        record.marks.append((UNTIMED, end))
        record.prev_opened, self._last_opened = self._last_opened, record.opened
        self.read_cpu_wait(record)
        self._closed_at = end if not self._cuda else self._clock()
        self._record = _StepRecord(end, self._closed_at, record if self._cuda else None)
        if not self._cuda:
            return self._stats(record, None, memory_frac)
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
        """Host timers only: close ``step`` like :meth:`finish_step` but defer its StepStats.
        Returns the step's record (for :meth:`stats_of`) and its ``total_s``: the per-step
        fast path of StepGuard, which builds StepStats only for the steps the gate must see
        now (a StepStats per step was a third of the guard's cost in a cold-cache loop)."""
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
        return self._stats(record, None, memory_frac)

    def read_cpu_wait(self, record: _StepRecord) -> None:
        """Give the step that just closed (``record``) its CPU wait: the run-queue wait since
        the previous close, known when that close was read too (steps count one by one).
        :meth:`finish_step` reads every step; after :meth:`close_step` StepGuard reads only
        the steps over the gate's quiet bound: one system call each (10-45 us on a cold
        cache), none on a quiet step, and a slow run's steps after its first one by one. The
        step may be judged: its StepStats carry the other local ranks' figures, and with a node
        board its own wait (NaN: unknown) and work are written there for them."""
        record.judged = True
        now = self._cpu_wait() if self._cpu_wait is not None else None
        if now is not None:
            last = self._cpu_wait_read
            if last is not None and last[0] == record.step - 1:
                record.cpu_wait = now - last[1]
            self._cpu_wait_read = (record.step, now)
        if self._node_waits is not None:
            # host stamps: the step's work is known now; CUDA events: once they complete
            # (_stats publishes it then)
            work_s = math.nan
            if self._events is None:
                record.figures = self._figures(record, None)   # _stats takes them from here
                total_s, *_, comm_wait_s = record.figures
                work_s = total_s - comm_wait_s
            self._node_waits.publish(record.step,
                                     math.nan if record.cpu_wait is None else record.cpu_wait,
                                     work_s)

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
    def _stamp(self) -> Any:
        if self._events is None:
            return self._clock()
        return self._events.stamp()

    def _stats(self, record: _StepRecord, elapsed: Callable[[Any, Any], float] | None,
               memory_frac: float | None) -> StepStats:
        """The step's StepStats; ``elapsed`` None: float stamps (the CPU fast path)."""
        total_s, data_s, forward_s, backward_s, optimizer_s, comm_wait_s = \
            record.figures or self._figures(record, elapsed)
        peer_wait_s = peer_work_s = None
        if self._node_waits is not None and record.judged:
            # a step under the gate's quiet bound (not judged) needs no peer figures
            if elapsed is not None:
                self._node_waits.publish_work(record.step, total_s - comm_wait_s)
            peer_wait_s, peer_work_s = self._node_waits.peers_at(record.step, record.opened,
                                                                 record.prev_opened)
        return StepStats(record.step, total_s, data_s, forward_s, backward_s,  # positional:
                         comm_wait_s, optimizer_s, memory_frac, self.world_rank,  # per step
                         record.cpu_wait, peer_wait_s, record.idle_before, peer_work_s)

    def _figures(self, record: _StepRecord, elapsed: Callable[[Any, Any], float] | None
                 ) -> tuple[float, float, float, float, float, float]:
        """(total, data wait, forward, backward, optimizer, communication wait) seconds: the
        phases summed; ``elapsed`` None: float stamps."""
        sums = [0.0, 0.0, 0.0, 0.0]
        marks = record.marks
        prev = marks[0][1]
        for slot, stamp in marks:
            if slot >= 0:
                sums[slot] += stamp - prev if elapsed is None else elapsed(prev, stamp)
            prev = stamp
        total_s = prev - marks[0][1] if elapsed is None else elapsed(marks[0][1], prev)
        if marks[-2][0] == _BACKWARD:
            # what follows the backward pass is the optimizer's (marks[-2] exists: a closed
            # record starts and ends with an UNTIMED stamp)
            start = marks[-2][1]
            sums[_OPTIMIZER] += prev - start if elapsed is None else elapsed(start, prev)
        blocked_s = _blocked_by_phase(marks, list(record.collectives), sums) \
            if record.collectives else 0.0
        comm_wait_s = 0.0
        if record.last_ready is not None and record.done:
            if elapsed is None:
                comm_wait_s = max(0.0, max(record.done) - record.last_ready)
            else:
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


def attach_comm_timer(ddp_model: Any, timer: StepTimer, *, hook: Callable | None = None,
                      state: Any = None) -> None:
    """Register a DDP communication hook that times each bucket's allreduce into ``timer``.

    ``hook`` is the hook to wrap (default: ``allreduce_hook``, DDP's own behaviour) and
    ``state`` its state (default: ``None``, the default process group). The wrapper stamps
    the moment each bucket is ready, calls ``hook``, and stamps the completion of its future
    in a ``then`` callback (on CUDA an event on the callback's stream, which waits for the
    collective). DDP accepts one hook per model: call this once, instead of
    ``register_comm_hook``. This is the one function here that touches torch.distributed.
    """
    if hook is None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        hook = allreduce_hook
    if not hasattr(ddp_model, "register_comm_hook"):
        raise InputError("ddp_model", "has no register_comm_hook",
                         value=type(ddp_model).__name__,
                         fix="pass the DistributedDataParallel-wrapped model")
    inner = hook

    def timed_hook(hook_state, bucket):  # unannotated: DDP checks hook annotations
        _fail_open(timer.record_bucket_ready, bucket.is_last())
        future = inner(hook_state, bucket)

        def done(fut: Any) -> Any:
            _fail_open(timer.record_bucket_done)
            return fut.value()

        return future.then(done)

    ddp_model.register_comm_hook(state, timed_hook)


_hook_failed = False


def _fail_open(fn: Callable, *args: Any) -> None:
    """Timing must never break the allreduce: log the first failure and go on."""
    global _hook_failed
    try:
        fn(*args)
    except Exception:
        if not _hook_failed:
            _hook_failed = True
            logger.warning("communication timing failed; communication waits read 0 from now "
                           "on where it fails", exc_info=True)


def attach_fsdp_comm_timer(module: Any, timer: StepTimer, *,
                           before_reduce_scatter: Callable[[], None] | None = None) -> int:
    """Time FSDP2's all-gathers and reduce-scatters into ``timer``; returns the units timed.

    On the host clock (gloo) every collective blocks the training thread, so every FSDP2 unit
    of ``module`` gets its all-gathers and reduce-scatters timed (``set_custom_all_gather``,
    ``set_custom_reduce_scatter``, wrapping PyTorch's default ones): their whole time is
    communication wait, taken out of the forward or backward it fell in. On CUDA the
    collectives run on side streams beside compute: only the root unit's reduce-scatter, the
    last of the backward, is timed (two events a step), and its tail after the last gradient
    counts, as for DDP (the all-gathers' exposed waits are not measured there).
    ``before_reduce_scatter`` runs before each timed reduce-scatter (the seam of a slow link).
    A unit that refuses custom collectives (several parameter groups) is left untimed. The
    timed collectives take the place of the unit's own: FSDP2's symmetric-memory and
    process-group allocation options (``set_symm_mem_for_comm``,
    ``set_allocate_memory_from_process_group_for_comm``) refuse custom collectives, so a model
    that needs them is left untimed (do not attach).
    """
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            DefaultAllGather,
            DefaultReduceScatter,
        )
    except ImportError as exc:   # the defaults are not public: degrade, never break the run
        logger.warning("FSDP2 communication not timed: %s", exc)
        return 0
    gather = _TimedAllGather(DefaultAllGather(), timer)
    scatter = _TimedReduceScatter(DefaultReduceScatter(), timer, before_reduce_scatter)
    timed = 0
    units = module.modules() if timer.on_host else [module]
    for unit in units:
        if not isinstance(unit, FSDPModule):
            continue
        try:
            if timer.on_host:
                unit.set_custom_all_gather(gather)
            unit.set_custom_reduce_scatter(scatter)
            timed += 1
        except ValueError as exc:
            logger.warning("FSDP2 unit %s not timed: %s", type(unit).__name__, exc)
    return timed


class _TimedAllGather:
    """FSDP2's default all-gather, run to completion and timed on the host clock."""

    def __init__(self, inner: Any, timer: StepTimer) -> None:
        self.inner = inner
        self.timer = timer

    def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Any, input_tensor: Any, group: Any,
                 async_op: bool = False) -> Any:
        start = self.timer.now()
        # synchronous: FSDP2 reads a None work as an all-gather that is already complete
        self.inner(output_tensor, input_tensor, group, False)
        _fail_open(self.timer.record_collective, start, self.timer.now())
        return None


class _TimedReduceScatter:
    """FSDP2's default reduce-scatter, timed: the blocked time on the host clock, the tail
    after the last gradient on CUDA (events on the reduce-scatter stream)."""

    def __init__(self, inner: Any, timer: StepTimer,
                 before: Callable[[], None] | None = None) -> None:
        self.inner = inner
        self.timer = timer
        self.before = before

    def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        if not self.timer.on_host:
            _fail_open(self.timer.record_bucket_ready, True)
            if self.before is not None:
                self.before()
            work = self.inner(output_tensor, input_tensor, group, op, async_op)
            _fail_open(self.timer.record_bucket_done)
            return work
        start = self.timer.now()
        if self.before is not None:
            self.before()
        self.inner(output_tensor, input_tensor, group, op, False)
        _fail_open(self.timer.record_collective, start, self.timer.now())
        return None
