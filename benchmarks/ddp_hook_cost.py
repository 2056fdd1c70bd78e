"""What the guard's DDP communication timer costs a step: DDP's built-in allreduce (C++), PyTorch's
Python ``allreduce_hook`` and the guard's timed hook (:func:`attach_comm_timer`), side by side.

    python benchmarks/ddp_hook_cost.py [--steps 300] [--rounds 8]

Two gloo ranks (processes on this machine, one torch thread each) train the Lightning example's
network (``Regressor(256).net``: 32 -> 256 -> 256 -> 1, one bucket) with each variant, in rounds
of ``--steps`` steps, the variants' order reversed every other round so that a drift of the box
falls on all of them.
Printed: rank 0's milliseconds a step per round, their median per variant and its difference
from the built-in hook's (docs/benchmarks.md, "Integrations: the guard's overhead").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("builtin", "python", "timed")


def _rank(rank: int, port: int, steps: int, rounds: int, out: mp.Queue) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from examples.lightning_trainer import Regressor
    from raytrain_guard.runtime.guard.comm_timers import attach_comm_timer
    from raytrain_guard.runtime.guard.timing import StepTimer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    models = {}
    for variant in VARIANTS:
        model = DistributedDataParallel(Regressor(256).net)    # the same weights each time
        if variant == "python":
            model.register_comm_hook(None, allreduce_hook)
        elif variant == "timed":
            attach_comm_timer(model, StepTimer())
        models[variant] = (model, torch.optim.AdamW(model.parameters()))
    x, y = torch.randn(16, 32), torch.randn(16, 1)
    ms: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for variant in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            model, optimizer = models[variant]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
            ms[variant].append((time.perf_counter() - start) / steps * 1e3)
    if rank == 0:
        out.put(ms)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--port", type=int, default=29533)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(r, args.port, args.steps, args.rounds, out))
             for r in range(2)]
    for p in ranks:
        p.start()
    ms = out.get()
    for p in ranks:
        p.join()
    base = statistics.median(ms["builtin"])
    for variant in VARIANTS:
        median = statistics.median(ms[variant])
        print(f"{variant:8s} {median:.3f} ms a step (median; {median - base:+.3f} against "
              f"builtin), rounds: {' '.join(f'{v:.3f}' for v in ms[variant])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
