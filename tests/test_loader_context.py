"""Where the loader finds its rank: single process, and an initialized torch.distributed."""

from __future__ import annotations

import socket

import torch.distributed as dist

from raytrain_guard.coordination.context import WorkerContext, current_context
from raytrain_guard.runtime.data.loader import GuardedDataLoader


def test_single_process_is_rank_0_of_1():
    assert current_context() == WorkerContext(node_id=socket.gethostname())


def test_initialized_process_group_gives_rank_and_size(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        ctx = current_context()
        assert (ctx.world_rank, ctx.world_size, ctx.local_world_size, ctx.source) == \
            (0, 1, 1, "torch")
        loader = GuardedDataLoader(list(range(10)), 2, num_workers=0,
                                   watch_worker_memory=False)
        assert (loader.world_rank, loader.world_size) == (0, 1)
    finally:
        dist.destroy_process_group()
