"""The CPU waits of the other ranks of this node, through a small shared file: no RPC.

Under synchronous training a rank that the host starves of CPU (``cpu_wait_s``) makes every
other rank wait for it in the collective: there the host's contention shows as communication
wait, which the waiting rank alone cannot tell from a slow link. Each rank writes its
cumulative run-queue wait into its slot of one file per node and group (8 bytes at each step's
close) and reads the others' (one ``pread``), so a step slow in communication while another
rank of this node waited for a CPU is the host's contention too (``StepStats.peer_cpu_wait_s``,
the step gate's host-wait rule). Ranks on other nodes are not seen: their contention still
shows here as communication wait.

The file lives in ``/dev/shm`` (memory; the temp folder where there is none), named after the
group's rendezvous address (``MASTER_ADDR``/``MASTER_PORT``, the same on every rank of a group,
different for groups alive at the same time) and removed by local rank 0 at :meth:`close`.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import tempfile
from collections.abc import Mapping

logger = logging.getLogger(__name__)

__all__ = ["NodeCpuWaits"]

_SLOT = struct.Struct("<d")


class NodeCpuWaits:
    """One rank's end of the node's board of cumulative CPU waits (seconds).

    ``path``: the board file (see :meth:`for_group`); ``local_rank`` of ``local_world_size``
    ranks on this node.
    """

    def __init__(self, path: str, local_rank: int, local_world_size: int) -> None:
        self.path = path
        self.local_rank = local_rank
        self.local_world_size = local_world_size
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        size = _SLOT.size * local_world_size
        if os.fstat(self._fd).st_size < size:
            os.ftruncate(self._fd, size)
        self._last: list[float] | None = None     # the others' waits at the previous exchange

    @classmethod
    def for_group(cls, local_rank: int, local_world_size: int,
                  environ: Mapping[str, str] = os.environ) -> NodeCpuWaits | None:
        """The board of this rank's group on this node; None for a rank alone on its node,
        or without a rendezvous address to name it after (no process group)."""
        addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
        if local_world_size < 2 or not addr or not port:
            return None
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"raytrain_guard-cpuwait-{addr}-{port}")
        try:
            return cls(os.path.join(folder, name), local_rank, local_world_size)
        except OSError:
            logger.info("node CPU waits: no board in %s; the other ranks' waits are not read",
                        folder, exc_info=True)
            return None

    def exchange(self, own_s: float | None) -> float | None:
        """Write this rank's cumulative wait ``own_s``; return the most any other rank of the
        node waited since the previous exchange (None: the first exchange, or a failed one)."""
        fd = self._fd
        if fd is None:
            return None
        try:
            if own_s is not None:
                os.pwrite(fd, _SLOT.pack(own_s), _SLOT.size * self.local_rank)
            data = os.pread(fd, _SLOT.size * self.local_world_size, 0)
        except OSError:
            self.close()           # fail open: the waits of the others are no longer read
            return None
        waits = [w for i, (w,) in enumerate(_SLOT.iter_unpack(data)) if i != self.local_rank]
        last, self._last = self._last, waits
        if last is None or len(last) != len(waits):
            return None
        # a restarted rank starts from 0 again: its first interval counts as no wait
        return max((max(0.0, now - before) for now, before in zip(waits, last)), default=None)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        os.close(fd)
        if self.local_rank == 0:
            try:
                os.unlink(self.path)
            except OSError:
                pass
