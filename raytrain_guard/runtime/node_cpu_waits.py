"""The other local ranks' CPU waits and work per step, through a small shared file: no RPC.

Under synchronous training a rank that the host starves of CPU (``cpu_wait_s``), or that is
slow, makes every other rank wait for it in the collective: there it shows as communication
wait, which the waiting rank alone cannot tell from a slow link. Each rank writes each step's
figures into its ring of recent steps in one file per node and group, mapped into memory (32
bytes at the step's close, no system call): its wait for a CPU and its own work (its time
less its communication wait), for the steps whose wait it reads (on host timers, those over
the gate's quiet bound: a close of every step cost 10-20 us more on a cold cache). The others'
entries for a step are read when this rank's gate may judge it (with the gate's batch, off
the per-step path). A step slow in communication while another rank of this node
waited for a CPU is the host's contention too (``StepStats.peer_cpu_wait_s``, the host-wait
rule); while another worked longer by as much, it waited for that rank, which its own gate
judges (``StepStats.peer_work_s``, the peer-work rule), not for the link. Ranks on other
nodes are not seen: their contention and their slowness still show here as communication wait.

The file lives in ``/dev/shm`` (memory; the temp folder where there is none), named after the
group's rendezvous address (``MASTER_ADDR``/``MASTER_PORT``, the same on every rank of a group,
different for groups alive at the same time) and removed by local rank 0 at :meth:`close`.
Every rank holds a shared lock on it while it is open, so a file that no process holds is a
board whose ranks were killed before their close: local rank 0 removes such files when it
opens its board (:func:`sweep_stale_boards`).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import math
import mmap
import os
import re
import struct
import tempfile
import time
from collections.abc import Callable, Mapping

logger = logging.getLogger(__name__)

__all__ = ["NodeCpuWaits", "sweep_stale_boards"]

_ENTRY = struct.Struct("<dddd")   # (step, seconds waited for a CPU in it, seconds of own
                                  # work in it (NaN: not known yet), when written)
_WORK = struct.Struct("<d")       # the work alone, at byte _WORK_AT of an entry
_WORK_AT = struct.calcsize("<dd")  # after the step and the wait
_NAME = "raytrain_guard-cpuwait-v4"
"""The board files' name; the version names the entry layout and the locking, so a file an
earlier version left behind (a rank killed before its close) is never read as this one, and a
board of an earlier version, which its ranks do not lock, is never swept as a stale one."""
SWEEP_MIN_AGE_S = 60.0
"""A board file is removed by the sweep only when it was created (or resized) this long ago
and no process holds its lock: a board being opened takes its lock within microseconds of its
creation."""
RING_STEPS = 64
"""Steps each rank keeps on the board: more than a gate batch (``gate_batch_steps``), so the
entries of the steps a batch judges are still there."""


class NodeCpuWaits:
    """One rank's end of the node's board of per-step CPU waits and work (seconds).

    ``path``: the board file (see :meth:`for_group`); ``local_rank`` of ``local_world_size``
    ranks on this node. ``clock``: the host clock entries are stamped with, the same in every
    process of the node (``time.perf_counter``: ``CLOCK_MONOTONIC`` on Linux), so that an
    entry a group of an earlier run left in a file of the same name is told from this one's.
    """

    def __init__(self, path: str, local_rank: int, local_world_size: int, *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.path = path
        self._clock = clock
        self.local_rank = local_rank
        self.local_world_size = local_world_size
        self._others = [r for r in range(local_world_size) if r != local_rank]
        size = _ENTRY.size * RING_STEPS * local_world_size
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)        # held while open: the board is alive
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self._map: mmap.mmap | None = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    @classmethod
    def for_group(cls, local_rank: int, local_world_size: int,
                  environ: Mapping[str, str] = os.environ) -> NodeCpuWaits | None:
        """The board of this rank's group on this node; None for a rank alone on its node,
        or without a rendezvous address to name it after (no process group)."""
        addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
        if local_world_size < 2 or not addr or not port:
            return None
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{_NAME}-{addr}-{port}")
        if local_rank == 0:
            sweep_stale_boards(folder, keep=name)
        try:
            return cls(os.path.join(folder, name), local_rank, local_world_size)
        except OSError:
            logger.info("node CPU waits: no board in %s; the other ranks' waits are not read",
                        folder, exc_info=True)
            return None

    def publish(self, step: int, wait_s: float, work_s: float = math.nan) -> None:
        """This rank waited ``wait_s`` for a CPU in ``step`` and worked ``work_s`` in it (its
        time less its communication wait), at the step's close; NaN: not known (the wait not
        read for that step; the work known once CUDA events complete, :meth:`publish_work`)."""
        board = self._map
        if board is not None:
            _ENTRY.pack_into(board, self._offset(self.local_rank, step), step, wait_s, work_s,
                             self._clock())

    def publish_work(self, step: int, work_s: float) -> None:
        """This rank's work in ``step``, known after its close (CUDA events), into the entry
        :meth:`publish` wrote (none: nothing)."""
        board = self._map
        if board is None:
            return
        offset = self._offset(self.local_rank, step)
        if _ENTRY.unpack_from(board, offset)[0] == step:
            _WORK.pack_into(board, offset + _WORK_AT, work_s)

    def peers_at(self, step: int, since_s: float = float("-inf"),
                 prev_since_s: float | None = None) -> tuple[float | None, float | None]:
        """(the most any other rank of the node waited for a CPU in ``step``, the most work
        any of them did in it); None where none of them has published it, or keeps it no
        longer. Only entries written at ``since_s`` or later (this clock) count: a step's timer
        passes the time its own step began. Under synchronous training no rank closes a step
        before every rank began it, so an older entry for the same step number is an earlier
        group's (a crashed attempt or a finished run that used the same rendezvous port and
        left its file behind).

        A rank that has not written ``step`` yet (this one closed it first: the two closes
        race) gives its entry of the step before, written at ``prev_since_s`` (when this
        rank's previous step began) or later, when given: that one it wrote before it joined
        this step's collective, so it is there, and a slow rank's previous step is its best
        guess of this one."""
        board = self._map
        if board is None:
            return None, None
        most_wait = most_work = None
        for rank in self._others:
            entry = self._entry(rank, step, since_s)
            if entry is None and prev_since_s is not None:
                entry = self._entry(rank, step - 1, prev_since_s)
            if entry is None:
                continue
            wait_s, work_s = entry
            if not math.isnan(wait_s) and (most_wait is None or wait_s > most_wait):
                most_wait = wait_s
            if not math.isnan(work_s) and (most_work is None or work_s > most_work):
                most_work = work_s
        return most_wait, most_work

    def _entry(self, rank: int, step: int, since_s: float) -> tuple[float, float] | None:
        """(wait, work) of ``rank``'s entry for ``step`` written at ``since_s`` or later."""
        at, wait_s, work_s, written_s = _ENTRY.unpack_from(self._map, self._offset(rank, step))
        return (wait_s, work_s) if at == step and written_s >= since_s else None

    @staticmethod
    def _offset(rank: int, step: int) -> int:
        return _ENTRY.size * (rank * RING_STEPS + step % RING_STEPS)

    def close(self) -> None:
        board, self._map = self._map, None
        if board is None:
            return
        board.close()
        if self.local_rank == 0:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        os.close(self._fd)                        # releases the lock


def sweep_stale_boards(folder: str, keep: str, *, min_age_s: float = SWEEP_MIN_AGE_S) -> int:
    """Remove the board files of this version in ``folder`` that no process holds and that
    were created at least ``min_age_s`` ago, except ``keep``; returns how many. Fails open: a
    file it cannot check or remove stays."""
    removed = 0
    try:
        names = [n for n in os.listdir(folder) if n.startswith(_NAME + "-") and n != keep]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            if time.time() - os.fstat(fd).st_mtime < min_age_s:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
            removed += 1
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.ENOENT):
                logger.debug("node CPU waits: %s not swept", path, exc_info=True)
        finally:
            os.close(fd)
    if removed:
        logger.info("node CPU waits: removed %d board(s) in %s that no rank held", removed,
                    folder)
    return removed
