"""The control-plane collective: stop flag, newest decision id and urgency in one 24-byte
all_reduce.

The questions the ranks agree on every ``lockstep_every_steps`` steps (did any rank ask to
stop; has any rank heard of a newer decision; must the stop be agreed every step until the
next round, because some rank's memory may reach the critical line before it) are a MAX,
answered by one ``all_reduce(MAX)`` on a gloo group over a CPU tensor allocated once (no device
synchronization). The train loop and the lockstep share one plane per process. Why:
docs/coordination.md.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

logger = logging.getLogger(__name__)

NO_DECISION = -1  # the value a rank contributes to the MAX when it knows of nothing new


class ControlPlane:
    """One rank's end of the control-plane collective. ``group``: the gloo group to reduce over
    (None: the default group), held weakly: a group kept alive past ``destroy_process_group``
    aborts the process at exit."""

    def __init__(self, world_size: int, group: Any = None) -> None:
        self.world_size = world_size
        self._group = weakref.ref(group) if group is not None else None
        self.local_stop = False          # this rank's gate asked to stop (set by the loop)
        self.agreed_stop = False         # some rank asked, as of the last round
        self.local_urgent = False        # this rank wants the stop agreed every step (the loop)
        self.agreed_urgent = False       # some rank did, as of the last round
        self.num_rounds = 0              # rounds run; the loop compares it around a poll
        self._buffer: Any = None
        if world_size > 1:
            import torch
            self._buffer = torch.zeros(3, dtype=torch.int64)     # CPU, reused every round

    @property
    def group(self) -> Any:
        """The gloo side group, or None for the default group."""
        if self._group is None:
            return None
        group = self._group()
        if group is None:
            raise RuntimeError("control plane: its process group was destroyed")
        return group

    @classmethod
    def for_default_group(cls) -> ControlPlane:
        """The plane of the default group (a new gloo side group when its backend is not gloo:
        every rank must call it at the same point); a world of one without torch.distributed."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls(1)
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return cls(dist.get_world_size(), group)

    def agree(self, newest_id: int = NO_DECISION) -> int:
        """One round of every rank's ``[local_stop, newest_id, local_urgent]``: sets
        :attr:`agreed_stop` and :attr:`agreed_urgent`, returns the newest decision id any rank
        knows of. Every rank, same boundary."""
        stop, newest, urgent = self.all_reduce_max(int(self.local_stop), newest_id,
                                                   int(self.local_urgent))
        self.agreed_stop = bool(stop)
        self.agreed_urgent = bool(urgent)
        self.num_rounds += 1
        return newest

    def stop_agreed(self, rounds_before: int, *, check_now: bool) -> bool:
        """Whether the ranks agreed to stop: from a round run since ``rounds_before`` (the
        lockstep's), or one run now when ``check_now`` (the same on every rank)."""
        if self.num_rounds == rounds_before:
            if not check_now:
                return False
            self.agree()
        return self.agreed_stop

    def all_reduce_max(self, *values: int) -> tuple[int, ...]:
        """The one method that touches torch.distributed: ``all_reduce(MAX)`` of up to three
        int64, one per argument (the buffer's other slots carry 0)."""
        if self.world_size == 1:
            return values
        import torch.distributed as dist

        buffer = self._buffer
        buffer.zero_()
        for i, value in enumerate(values):
            buffer[i] = value
        dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=self.group)
        return tuple(int(x) for x in buffer.tolist()[:len(values)])


_shared: tuple[Any, ControlPlane] | None = None    # (weak ref to the default group, the plane)


def shared_control_plane() -> ControlPlane:
    """This process's plane for the current default group, made on the first call (every rank
    at the same point) and again after the default group was replaced."""
    global _shared
    import torch.distributed as dist

    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if _shared is None or (_shared[0]() if _shared[0] is not None else None) is not world:
        _shared = (weakref.ref(world) if world is not None else None,
                   ControlPlane.for_default_group())
        logger.debug("control plane: world of %d, %s group", _shared[1].world_size,
                     "default" if _shared[1].group is None else "gloo side")
    return _shared[1]
