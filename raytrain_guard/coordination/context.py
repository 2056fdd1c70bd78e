"""Who am I? The rank, world size and node of the current training process, from Ray Train's
context (the node: Ray's node id, as nodes may share an IP), an initialized
``torch.distributed`` (the node: the host name), or rank 0 of 1. Ray and torch are read only
when the process imported them already.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerContext:
    """The position of one training process in the run; ``source``: ``"ray"``, ``"torch"`` or
    ``"single"``."""

    world_rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_id: str = ""
    source: str = "single"


def current_context() -> WorkerContext:
    """The context of the calling process; never raises (a source that fails is skipped)."""
    for read in (_from_ray_train, _from_torch_distributed):
        try:
            ctx = read()
        except Exception as exc:  # noqa: BLE001 - the guard fails open
            logger.debug("context source %s failed: %r", read.__name__, exc)
            continue
        if ctx is not None:
            return ctx
    return WorkerContext(node_id=socket.gethostname())


def _from_ray_train() -> WorkerContext | None:
    if "ray" not in sys.modules:
        return None
    import ray
    import ray.train

    if not ray.is_initialized():
        return None
    try:
        ctx = ray.train.get_context()  # raises outside a Ray Train worker
        world_rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    except Exception:  # noqa: BLE001 - not a Train worker
        return None
    return WorkerContext(world_rank=world_rank, world_size=world_size,
                         local_rank=ctx.get_local_rank(),
                         local_world_size=ctx.get_local_world_size(),
                         node_id=ray.get_runtime_context().get_node_id(), source="ray")


def _from_torch_distributed() -> WorkerContext | None:
    if "torch" not in sys.modules:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    world_rank, world_size = dist.get_rank(), dist.get_world_size()
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    local_rank = int(os.environ.get("LOCAL_RANK", world_rank % max(1, local_world_size)))
    return WorkerContext(world_rank=world_rank, world_size=world_size, local_rank=local_rank,
                         local_world_size=local_world_size, node_id=socket.gethostname(),
                         source="torch")
