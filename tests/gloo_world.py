"""A world of real ranks for a test: spawned processes joined in one process group.

Each rank runs the test's worker ``fn(rank, *args)`` as a plain call, so the worker's locals
(DDP, FSDP2, ZeRO wraps, optimizers) die when it returns; what a reference cycle still holds
is collected, and only then is the group destroyed. A rank exiting while such objects outlived
``destroy_process_group`` aborted at interpreter exit (SIGABRT, "terminate called without an
active exception") after its work was done.

A rank that returns leaves by ``os._exit(0)``, after the group is destroyed: it skips the
interpreter's finalization, where a gloo worker thread still running a ``Future.then`` callback
(the communication timer's hook stamps each bucket that way) takes the GIL and aborts the
process the same way. ``destroy_process_group`` joins those threads only when nothing else
holds the group; a rank that outlives it (a test's global, a wrap PyTorch keeps) aborted at
random on a loaded machine. A rank that raises still exits through ``mp.spawn``, which writes
its traceback first.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for the group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, fn: Callable[..., None], world: int, port: int, backend: str,
               args: tuple) -> None:
    if "nccl" in backend:
        torch.cuda.set_device(rank)   # one GPU per rank, bound before nccl's communicator
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        fn(rank, *args)
    finally:
        gc.collect()                  # wraps kept alive by cycles go before their group
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)                       # no finalization for gloo's threads to abort


def spawn(fn: Callable[..., None], world: int, *args, backend: str = "gloo") -> None:
    """Run ``fn(rank, *args)`` on ``world`` processes joined in a ``backend`` group; raises
    if any rank fails. ``fn`` must be a module-level function (it is pickled to the ranks)."""
    mp.spawn(_rank_main, args=(fn, world, free_port(), backend, args), nprocs=world, join=True)


def one_rank(fn: Callable[[], None], store_dir: str) -> None:
    """``fn()`` in a one-rank gloo group of this process (a file store in ``store_dir``): its
    locals die when it returns, and are collected before the group is destroyed, as in
    :func:`spawn` (a DDP reducer freed after its gloo group deadlocked in the group's
    destructor)."""
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/rdv", rank=0, world_size=1)
    try:
        fn()
    finally:
        gc.collect()
        dist.destroy_process_group()
