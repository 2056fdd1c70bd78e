"""The data-parallel wrapper a trainer built around the user's model, found from its forward.

Hugging Face's Trainer has accelerate wrap the model in DDP and hands its callbacks only the
inner model. The guard times DDP's communication with a comm hook on the wrapper, so at the
inner model's first forward it looks up the calling frames (DDP's ``forward`` calls the inner
module a few frames up) for the DDP whose ``module`` is that model, and attaches the timer
there, before the first backward. Not found (no DDP, one worker): the communication wait reads
0 and a slow rank's partners show their wait in ``backward``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from raytrain_guard.runtime.guard.comm_timers import attach_comm_timers

logger = logging.getLogger(__name__)

#: frames between the inner module's forward pre-hook and DDP's forward (torch 2.13: 4)
MAX_FRAMES = 12


def ddp_calling(model: Any, max_frames: int = MAX_FRAMES) -> DistributedDataParallel | None:
    """The DDP in the calling frames whose ``module`` is ``model`` (None: none)."""
    frame = sys._getframe(1)
    for _ in range(max_frames):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, DistributedDataParallel) and owner.module is model:
            return owner
        frame = frame.f_back
    return None


def time_wrapper_communication(model: Any, guard: Any) -> None:
    """At ``model``'s next forward, attach the guard's communication timer to the DDP that
    called it (once; fails open)."""
    handles: list[Any] = []

    def first_forward(module: Any, args: Any) -> None:
        for handle in handles:
            handle.remove()
        try:
            ddp = ddp_calling(module)
            if ddp is None:
                logger.info("rank %s: no DDP wrapper around the model: communication is not "
                            "timed apart", guard.rank)
                return
            attach_comm_timers(ddp, guard.step_guard.timer, world_rank=guard.rank)
        except Exception:
            logger.warning("rank %s: communication timer not attached", guard.rank,
                           exc_info=True)

    handles.append(model.register_forward_pre_hook(first_forward))
