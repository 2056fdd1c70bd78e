"""An ordinary Ray Train script, guarded by changing its imports (marked ``# guard``).

    python examples/drop_in.py

The script is the one Ray Train users write: ``prepare_model``, ``prepare_data_loader``, their own
loop. Importing ``TorchTrainer`` and the ``prepare_*`` functions from ``raytrain_guard.train``
instead of ``ray.train.torch``, and wrapping the optimizer once, gives it the guard: the plan
before launch, node monitors and the coordinator, the planned DDP bucket cap, the DataLoader's
``prefetch_factor``/``persistent_workers`` kept (Ray's own drops them), step phases timed with
no mark in the loop, per-rank metrics labelled like Ray Train's, and a stop every rank agrees on.
Rank 1 is made slow in compute so the report has a straggler to name.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ray
import ray.train
import torch
import toy
from ray import cloudpickle
from ray.train import RunConfig, ScalingConfig
from torch.utils.data import DataLoader

from raytrain_guard.train import (  # guard
    TorchTrainer,
    get_guard,
    prepare_data_loader,
    prepare_model,
    prepare_optimizer,
)


class SlowOnRankOne(torch.nn.Module):
    """The toy model; on world rank 1 each forward takes 10 ms longer (a slow GPU, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = toy.make_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ray.train.get_context().get_world_rank() == 1:
            time.sleep(0.01)
        return self.net(x)


def train_func(config: dict) -> None:
    torch.manual_seed(0)
    model = prepare_model(SlowOnRankOne())
    loader = prepare_data_loader(DataLoader(toy.make_dataset(512), batch_size=8, shuffle=True,
                                            num_workers=1, prefetch_factor=4,
                                            persistent_workers=True))
    opt = prepare_optimizer(torch.optim.AdamW(model.parameters()))              # guard
    for epoch in range(config["epochs"]):
        if ray.train.get_context().get_world_size() > 1:
            loader.sampler.set_epoch(epoch)
        for batch in loader:
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            loss.backward()
            opt.step()                         # the guard's step ends here: no mark needed
            opt.zero_grad()
            if get_guard().should_stop():                                        # guard
                break                          # every rank stops at the same step
        ray.train.report({"epoch": epoch, "loss": loss.item()})
        if get_guard().should_stop():                                            # guard
            break


def main() -> int:
    cloudpickle.register_pickle_by_value(toy)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        result = TorchTrainer(
            train_func, train_loop_config={"epochs": 2},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name="drop_in", storage_path=tempfile.mkdtemp(prefix="rtg-")),
            guard={"memory_watermark_frac": 0.88},                               # guard
        ).fit()
    finally:
        ray.shutdown()
    print(result.guard.format())
    print("done: error" if result.error else "done: trained with the guard")
    return 0


if __name__ == "__main__":
    sys.exit(main())
