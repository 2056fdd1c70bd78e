"""Small factories for the examples and tests: a model, a dataset, an optimizer and a loss.

Everything is fast on CPU. Every sample carries its index as ``"id"``, so a run can prove that
each sample was consumed exactly once (the train loop's ``audit_dir``).

The factory contract of :func:`raytrain_guard.runtime.loop.train_loop.train_loop_per_worker`:
``model_factory() -> nn.Module``, ``dataset_factory() -> Dataset``,
``optimizer_factory(params) -> Optimizer``, ``loss_fn(model, batch) -> scalar tensor``.
Parametrize them with ``functools.partial``.

The ``bad_*`` factories produce the bad inputs the loop must reject with a clear error.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.utils.data import Dataset

DIM = 32


def make_model(dim: int = DIM, hidden: int = 64, depth: int = 3) -> nn.Module:
    """An MLP of ``depth`` hidden layers; deterministic under ``torch.manual_seed``."""
    layers: list[nn.Module] = [nn.Linear(dim, hidden), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    layers.append(nn.Linear(hidden, 1))
    return nn.Sequential(*layers)


class ToyDataset(Dataset):
    """``num_samples`` regression samples ``{"id", "x", "y"}``, tensor-backed (no copy-on-read).

    ``delay_s`` sleeps in every ``__getitem__``: a slow dataset, for data-wait attribution.
    """

    def __init__(self, num_samples: int = 256, dim: int = DIM, seed: int = 0,
                 delay_s: float = 0.0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_samples, dim, generator=gen)
        w = torch.randn(dim, 1, generator=gen) / dim ** 0.5     # targets of unit variance
        self.y = self.x @ w + 0.1 * torch.randn(num_samples, 1, generator=gen)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> dict:
        if self.delay_s:
            time.sleep(self.delay_s)
        return {"id": i, "x": self.x[i], "y": self.y[i]}


def make_dataset(num_samples: int = 256, dim: int = DIM, delay_s: float = 0.0,
                 delay_rank: int | None = None) -> Dataset:
    """A :class:`ToyDataset`; with ``delay_rank``, only that rank's copy is slow (``RANK``)."""
    slow = delay_rank is None or int(os.environ.get("RANK", "-1")) == delay_rank
    return ToyDataset(num_samples, dim, delay_s=delay_s if slow else 0.0)


def make_optimizer(params, lr: float = 0.02) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    """Mean squared error of ``model(batch["x"])`` against ``batch["y"]``."""
    return nn.functional.mse_loss(model(batch["x"]), batch["y"])


# -- bad inputs, to rehearse the loop's errors ----------------------------------------------------

def bad_dataset_raises() -> Dataset:
    raise RuntimeError("dataset shard not found: s3://bucket/missing")


def bad_dataset_empty() -> Dataset:
    return ToyDataset(num_samples=0)


def bad_loss_not_scalar(model: nn.Module, batch: dict) -> torch.Tensor:
    return (model(batch["x"]) - batch["y"]) ** 2      # per-sample, not reduced


class CrashOnceLoss:
    """``loss_fn`` that raises once on ``world_rank`` at its ``crash_call``-th call (1-based).

    A marker file makes it happen once: the restarted worker group finds the marker and trains
    on. Rehearses a worker dying mid-run.
    """

    def __init__(self, marker_path: str, crash_call: int, world_rank: int = 1) -> None:
        self.marker_path = marker_path
        self.crash_call = crash_call
        self.world_rank = world_rank
        self.calls = 0

    def __call__(self, model: nn.Module, batch: dict) -> torch.Tensor:
        self.calls += 1
        rank = int(os.environ.get("RANK", "-1"))
        if (self.calls == self.crash_call and rank == self.world_rank
                and not os.path.exists(self.marker_path)):
            with open(self.marker_path, "w") as fh:
                fh.write(f"crashed on rank {rank} at call {self.calls}\n")
            raise RuntimeError(f"injected crash on rank {rank} at loss call {self.calls}")
        return loss_fn(model, batch)


class RaiseOnRankLoss:
    """``loss_fn`` that raises on one rank only at its ``at_call``-th call (every attempt).
    ``stamp_path``: a file where it writes the wall-clock time (``time.time()``) it raised at."""

    def __init__(self, world_rank: int = 1, at_call: int = 2, stamp_path: str | None = None
                 ) -> None:
        self.world_rank = world_rank
        self.at_call = at_call
        self.stamp_path = stamp_path
        self.calls = 0

    def __call__(self, model: nn.Module, batch: dict) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at_call and int(os.environ.get("RANK", "-1")) == self.world_rank:
            if self.stamp_path is not None:
                with open(self.stamp_path, "w") as fh:
                    fh.write(repr(time.time()))
            raise RuntimeError(f"injected failure on rank {self.world_rank} only")
        return loss_fn(model, batch)
