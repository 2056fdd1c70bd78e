"""Cost of the train loop's per-step stop agreement (a 4-byte all_reduce) and of the start-up
bandwidth measurement, on a real 2-rank gloo process group.

    python benchmarks/stop_flag_cost.py [--steps 200] [--rounds 5]

The toy DDP step is timed with and without the flag allreduce, interleaved in rounds in one
run (A, B, A, B ...); the figure is the ratio of the medians. The bandwidth curve's wall time is
the loop's start-up cost.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))


def _worker(rank: int, port: int, steps: int, rounds: int, queue) -> None:
    import toy

    from raytrain_guard.runtime.dist.bandwidth import measure_allreduce_curve
    from raytrain_guard.runtime.dist.model import wrap_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    curve_s = []
    for _ in range(3):
        t0 = time.perf_counter()
        curve = measure_allreduce_curve()
        curve_s.append(time.perf_counter() - t0)
    torch.manual_seed(0)
    planned = wrap_model(toy.make_model(), strategy="ddp", use_ray=False)
    opt = toy.make_optimizer(planned.module.parameters())
    data = toy.make_dataset(16 * 8)
    batch = {"x": data.x[:16], "y": data.y[:16]}
    flag = torch.zeros(1, dtype=torch.int32)

    def run(with_flag: bool) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            toy.loss_fn(planned.module, batch).backward()
            opt.step()
            opt.zero_grad()
            if with_flag:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return (time.perf_counter() - start) / steps

    run(False)          # warm-up (bucket rebuild)
    plain, flagged = [], []
    for _ in range(rounds):
        plain.append(run(False))
        flagged.append(run(True))
    if rank == 0:
        queue.put({"plain_s": statistics.median(plain), "flag_s": statistics.median(flagged),
                   "curve_s": statistics.median(curve_s),
                   "describe": curve.describe(0.8)})
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(port, args.steps, args.rounds, queue), nprocs=2,
                       start_method="spawn")
    r = queue.get()
    print(r["describe"])
    print(f"bandwidth measurement: {r['curve_s'] * 1e3:.0f} ms (median of 3)")
    print(f"toy DDP step: {r['plain_s'] * 1e3:.3f} ms; with the stop-flag all_reduce: "
          f"{r['flag_s'] * 1e3:.3f} ms; ratio {r['flag_s'] / r['plain_s']:.3f} "
          f"(+{(r['flag_s'] - r['plain_s']) * 1e6:.0f} us per step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
