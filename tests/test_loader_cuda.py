"""The device-prefetch side stream on CUDA: skipped without CUDA (not run on the CPU dev box)."""

from __future__ import annotations

import pytest
import torch

from raytrain_guard.runtime.data.loader import GuardedDataLoader

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class Vectors:
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((1 << 16,), float(i))


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_side_stream_batches_are_correct_and_pinned(depth):
    loader = GuardedDataLoader(Vectors(), 4, world_rank=0, world_size=1, num_workers=2,
                               device="cuda", device_prefetch_depth=depth, seed=1,
                               watch_worker_memory=False)
    reference = GuardedDataLoader(Vectors(), 4, world_rank=0, world_size=1, num_workers=0,
                                  seed=1, watch_worker_memory=False)
    try:
        assert loader.torch_loader.pin_memory
        sums = []
        for batch in loader:
            assert batch.is_cuda
            # heavy work on the current stream right after taking the batch: a missing
            # wait_stream would read a half-copied batch, a missing record_stream would let
            # the allocator hand the memory to the next copy while this still reads it
            out = (batch.float() * 2).sum(dim=1) / 2
            sums.append(out.cpu())
        expected = [b.sum(dim=1) for b in reference]
        assert all(torch.equal(a, b) for a, b in zip(sums, expected))
    finally:
        loader.close()
        reference.close()
