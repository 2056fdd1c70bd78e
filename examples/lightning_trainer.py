"""A Lightning ``Trainer`` on Ray Train, guarded by one callback (lines marked ``# guard``).

    python examples/lightning_trainer.py                  # a local Ray
    ray job submit --working-dir . -- python examples/lightning_trainer.py

A small regression model on synthetic data, 2 gloo workers, as Ray's Lightning guide has it:
``RayDDPStrategy``, ``RayLightningEnvironment``, ``prepare_trainer``, Ray's
``RayTrainReportCallback`` (a checkpoint per epoch) and a resume from ``get_checkpoint()``.
``raytrain_guard.train.TorchTrainer`` and ``GuardCallback`` add the guard: steps timed, the
DataLoader held to the host budget, a stop every rank honours at the same step, and
``result.guard``. Needs ``pip install 'raytrain-guard[lightning]'``.
"""

from __future__ import annotations

import os
import sys
import tempfile

import lightning.pytorch as pl
import ray
import ray.train
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.lightning import (
    RayDDPStrategy,
    RayLightningEnvironment,
    RayTrainReportCallback,
    prepare_trainer,
)
from torch.utils.data import DataLoader

from raytrain_guard.integrations.lightning import GuardCallback  # guard
from raytrain_guard.train import TorchTrainer  # guard


class Samples(torch.utils.data.Dataset):
    """``num_samples`` rows ``(id, x, y)`` of a noisy linear map."""

    def __init__(self, num_samples: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(num_samples, 32, generator=g)
        self.y = self.x @ torch.randn(32, 1, generator=g) + 0.1 * torch.randn(num_samples, 1,
                                                                             generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"id": i, "x": self.x[i], "y": self.y[i]}


class Regressor(pl.LightningModule):
    def __init__(self, hidden: int = 256) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(32, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, 1))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"])
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def build_trainer(config: dict) -> pl.Trainer:
    trainer = pl.Trainer(
        max_epochs=config["max_epochs"], accelerator="cpu", devices="auto",
        strategy=RayDDPStrategy(), plugins=[RayLightningEnvironment()],
        callbacks=[RayTrainReportCallback(), GuardCallback()],                      # guard
        enable_progress_bar=False, enable_checkpointing=False, logger=False)
    return prepare_trainer(trainer)


def make_loader(config: dict) -> DataLoader:
    return DataLoader(Samples(config["samples"]), batch_size=config["batch_size"],
                      shuffle=True, num_workers=1, prefetch_factor=4, persistent_workers=True)


def fit(trainer: pl.Trainer, model: pl.LightningModule, loader: DataLoader) -> None:
    """Fit, resuming from the run's latest checkpoint when there is one."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        trainer.fit(model, train_dataloaders=loader)
        return
    with checkpoint.as_directory() as path:
        trainer.fit(model, train_dataloaders=loader,
                    ckpt_path=os.path.join(path, RayTrainReportCallback.CHECKPOINT_NAME))


def train_func(config: dict) -> None:
    fit(build_trainer(config), Regressor(config.get("hidden", 256)), make_loader(config))


def main() -> int:
    if os.environ.get("RAY_ADDRESS"):
        ray.init()                        # ray job submit: the cluster's
    else:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    storage = tempfile.mkdtemp(prefix="rtg-lightning-")
    try:
        result = TorchTrainer(
            train_func, train_loop_config={"max_epochs": 2, "batch_size": 16, "samples": 1024},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name="lightning_trainer", storage_path=storage),
        ).fit()
    finally:
        ray.shutdown()
    print(result.guard.format())
    print("done: error" if result.error else "done: trained with the guard")
    return 0


if __name__ == "__main__":
    sys.exit(main())
