"""What the guard's worker side costs a Lightning step, without Ray: the example's model trained
by Lightning's own DDP on this machine, with and without the guard's callback, in one run.

    python benchmarks/lightning_worker_cost.py [--devices 2] [--steps 250] [--rounds 6]
                                               [--device-ms 50] [--arms off on nocomm rare noloader]

Each process (Lightning launches ``--devices`` gloo ranks) fits a fresh ``Regressor`` once per
arm and round, the arms' order reversed every other round, and times the steps after the tenth.
Arms: ``off`` (no guard), ``on`` (``GuardCallback`` with a guard of no cluster layer: no Ray, no
coordinator, no node monitor, no reports), ``nocomm`` (``on`` without the DDP communication
timer), ``rare`` (``on`` with one agreement round in a million steps) and ``noloader`` (``on``
leaving the DataLoader as given). ``--device-ms`` gives the steps GPU-like time (the
experiment's device-time model). Printed by rank 0: each arm's milliseconds a step per round
and the median of its differences from ``off`` (docs/benchmarks.md, "Integrations: the guard's
overhead"). Beside ``benchmarks/integration_overhead.py`` (the whole guard under Ray Train, 45 s
a run) this takes 17 s a fit, so a part of the worker side can be taken out and compared.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

import raytrain_guard.integrations.lightning as guard_lightning
from examples.lightning_trainer import Regressor, Samples
from raytrain_guard.config import GuardConfig
from raytrain_guard.experiment.device_time import DeviceTime
from raytrain_guard.runtime.dropin.worker import WorkerGuard, WorkerSettings

ARMS = ("off", "on", "nocomm", "rare", "noloader")
WARMUP = 10
ATTACH_COMM_TIMERS = guard_lightning.attach_comm_timers


class _Clock(pl.Callback):
    def __init__(self) -> None:
        self.start = self.end = 0.0

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == WARMUP:
            self.start = time.perf_counter()
        self.end = time.perf_counter()


def fit(arm: str, args: argparse.Namespace) -> tuple[float, int]:
    """One fit of ``arm``: its milliseconds a step after the warm-up, and this process's rank."""
    clock = _Clock()
    callbacks: list[Any] = [clock]
    guard_lightning.attach_comm_timers = (ATTACH_COMM_TIMERS if arm != "nocomm"
                                          else lambda *a, **k: None)
    if arm != "off":
        config = GuardConfig(lockstep_every_steps=10**6) if arm == "rare" else GuardConfig()
        callbacks.append(guard_lightning.GuardCallback(
            guard=WorkerGuard(WorkerSettings(config=config)), fit_loader=arm != "noloader"))
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=args.devices,
                         strategy="ddp" if args.devices > 1 else "auto", callbacks=callbacks,
                         enable_progress_bar=False, enable_checkpointing=False, logger=False,
                         enable_model_summary=False)
    model = Regressor(256)
    if args.device_ms:
        DeviceTime(args.device_ms / 1000).attach(model.net)
    loader = DataLoader(Samples(16 * args.devices * args.steps), batch_size=16, shuffle=True,
                        num_workers=1, prefetch_factor=4, persistent_workers=True)
    trainer.fit(model, train_dataloaders=loader)
    return (clock.end - clock.start) / (args.steps - WARMUP) * 1e3, trainer.global_rank


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--device-ms", type=float, default=50.0)
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=["off", "on"],
                        help="off first: the differences are against it")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    ms: dict[str, list[float]] = {arm: [] for arm in args.arms}
    rank = 0
    for r in range(args.rounds):
        for arm in (args.arms if r % 2 == 0 else args.arms[::-1]):
            step_ms, rank = fit(arm, args)
            ms[arm].append(step_ms)
    if rank == 0:
        for arm in args.arms:
            diffs = [a - b for a, b in zip(ms[arm], ms[args.arms[0]])]
            print(f"{arm:9s} ms a step by round {' '.join(f'{v:.2f}' for v in ms[arm])}; "
                  f"median difference {statistics.median(diffs) * 1e3:+.0f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
