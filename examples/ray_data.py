"""Ray Data batches in a Ray Train loop, guarded (lines marked ``# guard``).

    python examples/ray_data.py                           # a local Ray
    ray job submit --working-dir . -- python examples/ray_data.py

A Ray Data pipeline (``range`` -> ``map_batches`` making features) feeds 2 gloo workers through
``ray.train.get_dataset_shard("train")``. ``raytrain_guard.train.iter_torch_batches(shard, ...)``
in place of ``shard.iter_torch_batches(...)`` holds ``prefetch_batches`` to the host budget,
times each batch's wait as the step's data phase (a slow pipeline is named data), and raises
the depth between epochs that waited for data.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Any

import numpy as np
import ray
import ray.train
import torch
from ray.train import RunConfig, ScalingConfig

from raytrain_guard.train import (  # guard
    TorchTrainer,
    get_guard,
    iter_torch_batches,
    prepare_model,
    prepare_optimizer,
)


def features(batch: dict, slow_from: int | None = None, delay_s: float = 0.0) -> dict:
    """32 features and a target per row id; rows from ``slow_from`` on take ``delay_s`` per
    batch (a slow pipeline stage)."""
    ids = batch["id"]
    if slow_from is not None and ids.max() >= slow_from:
        time.sleep(delay_s)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 1)).astype(np.float32)
    x = np.stack([np.random.default_rng(int(i)).standard_normal(32) for i in ids]).astype(
        np.float32)
    return {"id": ids, "x": x, "y": x @ w}


def make_dataset(num_rows: int, slow_from: int | None = None, delay_s: float = 0.0) -> Any:
    """Blocks of 64 rows through one ``map_batches`` task at a time: batches arrive one by one,
    as fast as the stage makes them (a slow stage is slow for every batch, not in bursts)."""
    return ray.data.range(num_rows, override_num_blocks=max(1, num_rows // 64)).map_batches(
        features, batch_size=64, concurrency=1,
        fn_kwargs={"slow_from": slow_from, "delay_s": delay_s})


def train_func(config: dict) -> None:
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                              torch.nn.Linear(64, 1)))
    opt = prepare_optimizer(torch.optim.AdamW(model.parameters()))              # guard
    batches = iter_torch_batches(ray.train.get_dataset_shard("train"),         # guard
                                 batch_size=config["batch_size"])
    for epoch in range(config["epochs"]):
        for batch in batches:
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            loss.backward()
            opt.step()
            opt.zero_grad()
            if get_guard().should_stop():                                        # guard
                break
        ray.train.report({"epoch": epoch, "loss": loss.item()})
        if get_guard().should_stop():                                            # guard
            break


def main() -> int:
    if os.environ.get("RAY_ADDRESS"):
        ray.init()                        # ray job submit: the cluster's
    else:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        result = TorchTrainer(
            train_func, train_loop_config={"epochs": 3, "batch_size": 64},
            datasets={"train": make_dataset(4096, slow_from=2048, delay_s=0.05)},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name="ray_data", storage_path=tempfile.mkdtemp(prefix="rtg-")),
        ).fit()
    finally:
        ray.shutdown()
    print(result.guard.format())
    print("done: error" if result.error else "done: trained with the guard")
    return 0


if __name__ == "__main__":
    sys.exit(main())
