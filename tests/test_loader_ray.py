"""Inside real Ray Train workers (gloo, CPU): the loader finds its rank and world size itself."""

from __future__ import annotations

import json

import pytest

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray


RAY_NUM_CPUS = 3       # for the ray_instance fixture (conftest.py)


def test_two_train_workers_shard_the_dataset_exactly_once(ray_instance, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def train_loop(config):
        import torch

        from raytrain_guard.coordination.context import current_context
        from raytrain_guard.runtime.data.loader import GuardedDataLoader

        dataset = torch.arange(30)        # a tensor is a map-style dataset of scalars
        loader = GuardedDataLoader(dataset, 4, seed=3, num_workers=2,
                                   watch_worker_memory=False)
        ctx = current_context()
        seen = [[int(v) for v in batch] for _ in range(2) for batch in loader]
        with open(f"{config['out']}/rank{loader.world_rank}.json", "w") as fh:
            json.dump({"rank": loader.world_rank, "size": loader.world_size,
                       "source": ctx.source, "node_id": ctx.node_id, "seen": seen,
                       "prefetch": loader.torch_loader.prefetch_factor,
                       "persistent": loader.torch_loader.persistent_workers}, fh)
        loader.close()

    trainer = TorchTrainer(train_loop, train_loop_config={"out": str(tmp_path)},
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=RunConfig(storage_path=str(tmp_path / "runs")))
    trainer.fit()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["size"], r["source"]) for r in ranks] == [(0, 2, "ray"), (1, 2, "ray")]
    assert all(r["node_id"] for r in ranks)
    assert all(r["persistent"] and r["prefetch"] >= 1 for r in ranks)
    # 2 epochs x 2 ranks x 4 batches (15 samples per rank: 4 + 4 + 4 + 3)
    for epoch in range(2):
        batches = [b for r in ranks for b in r["seen"][epoch * 4:(epoch + 1) * 4]]
        flat = [v for b in batches for v in b]
        assert sorted(flat) == list(range(30))            # 30 % 2 == 0: no padding
    assert ranks[0]["seen"][:4] != ranks[0]["seen"][4:]   # set_epoch: a new order
