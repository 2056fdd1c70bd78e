"""The other local ranks' work per step (``StepStats.peer_work_s``), through a small file
mapped into memory: no RPC, no system call per step.

A rank that works longer in a step makes the others wait for it in the collective, where they
see communication wait they cannot tell from a slow link (the gate's peer rule). The file lives
in ``/dev/shm``, named after the group's rendezvous address (``MASTER_ADDR``/``MASTER_PORT``),
and is removed by local rank 0 at :meth:`NodePeers.close`; every rank holds a shared lock on it
while open, so a file no process holds is a killed group's, which the next local rank 0 removes
(:func:`sweep_stale_boards`). Layout and figures: docs/train_loop.md ("Step timings").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import struct
import tempfile
import time
from collections.abc import Callable, Mapping

logger = logging.getLogger(__name__)

__all__ = ["NodePeers", "sweep_stale_boards"]

_ENTRY = struct.Struct("<ddd")   # (step, seconds of own work in it, when written)
_NAME = "raytrain_guard-peers-v5"
"""The board files' name; the version names the entry layout, so a file another version left
behind is never read or swept as this one."""
SWEEP_MIN_AGE_S = 60.0
"""A board file is swept only when created this long ago and held by no process: a board being
opened takes its lock within microseconds of its creation."""
RING_STEPS = 64
"""Steps each rank keeps on the board: more than a gate batch (``gate_batch_steps``)."""


class NodePeers:
    """One rank's end of the node's board of per-step work (seconds): ``path`` (see
    :meth:`for_group`), ``local_rank`` of ``local_world_size``. ``clock`` stamps the entries,
    the same in every process of the node (``CLOCK_MONOTONIC``), so an earlier group's entry in
    a file of the same name is told from this group's."""

    def __init__(self, path: str, local_rank: int, local_world_size: int, *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.path = path
        self.local_rank = local_rank
        self._clock = clock
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
                  environ: Mapping[str, str] = os.environ) -> NodePeers | None:
        """The board of this rank's group on this node; None for a rank alone on its node, or
        without a rendezvous address to name it after (no process group)."""
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
            logger.info("node peers: no board in %s; the other ranks' work is not read", folder,
                        exc_info=True)
            return None

    def publish(self, step: int, work_s: float) -> None:
        """This rank worked ``work_s`` in ``step`` (its time less its communication wait)."""
        board = self._map
        if board is not None:
            _ENTRY.pack_into(board, self._offset(self.local_rank, step), step, work_s,
                             self._clock())

    def peer_work(self, step: int, since_s: float = float("-inf"),
                  prev_since_s: float | None = None) -> float | None:
        """The most work another rank of the node published for ``step`` at ``since_s`` or
        later (no rank closes a step before every rank began it: an older entry is an earlier
        group's); None where none has. A rank that has not written ``step`` yet gives its step
        before, written at ``prev_since_s`` or later, when given."""
        board = self._map
        if board is None:
            return None
        most = None
        for rank in self._others:
            work_s = self._entry(rank, step, since_s)
            if work_s is None and prev_since_s is not None:
                work_s = self._entry(rank, step - 1, prev_since_s)
            if work_s is not None and (most is None or work_s > most):
                most = work_s
        return most

    def _entry(self, rank: int, step: int, since_s: float) -> float | None:
        at, work_s, written_s = _ENTRY.unpack_from(self._map, self._offset(rank, step))
        return work_s if at == step and written_s >= since_s else None

    @staticmethod
    def _offset(rank: int, step: int) -> int:
        return _ENTRY.size * (rank * RING_STEPS + step % RING_STEPS)

    def close(self) -> None:
        board, self._map = self._map, None
        if board is None:
            return
        board.close()
        if self.local_rank == 0:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
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
                logger.debug("node peers: %s not swept", path, exc_info=True)
        finally:
            os.close(fd)
    if removed:
        logger.info("node peers: removed %d board(s) in %s that no rank held", removed, folder)
    return removed
