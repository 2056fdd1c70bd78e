"""The experiment's built-in job: a small sequence model whose activations grow with the
sequence length, as a transformer's do (so an ``activation_spike`` needs more memory). Each
sample is ``{"id", "x": (seq_len, dim), "y": (1,)}``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

DIM = 32
#: 128 positions: a step of ~8 ms on a 2-core CPU box, long enough that the box's own bursts
#: reach one or two steps, not several (docs/benchmarks.md, "The before/after experiment")
SEQ_LEN = 128
NUM_SAMPLES = 1600       # divisible by 2, 4 and 8 ranks at micro-batch 8: no sampler padding


class SequenceRegressor(nn.Module):
    """Per-position MLP (``dim -> hidden -> hidden``), mean over positions, linear head."""

    def __init__(self, dim: int = DIM, hidden: int = 256) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                  nn.ReLU())
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean(dim=1))


class SequenceDataset(Dataset):
    """``num_samples`` sequences with a regression target; every sample carries its ``id``."""

    def __init__(self, num_samples: int = NUM_SAMPLES, seq_len: int = SEQ_LEN, dim: int = DIM,
                 seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_samples, seq_len, dim, generator=gen)
        w = torch.randn(dim, 1, generator=gen) / dim ** 0.5
        self.y = self.x.mean(dim=1) @ w * 4 + 0.1 * torch.randn(num_samples, 1, generator=gen)

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> dict:
        return {"id": i, "x": self.x[i], "y": self.y[i]}


def make_model() -> nn.Module:
    return SequenceRegressor()


def make_dataset() -> Dataset:
    return SequenceDataset()


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch["x"]), batch["y"])
