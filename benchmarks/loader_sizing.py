"""Data-wait fraction and host bytes in flight: planned loader vs the seed's 16 x 4 vs torch default.

    python benchmarks/loader_sizing.py [--rounds 3] [--steps 40] [--gpus-per-node 8]
                                       [--device cpu|cuda]

Workload: each sample is a decoded 3 x 224 x 224 uint8 image (147 KiB) that costs an I/O-like
latency (``--sample-ms``, sleep) plus writing its pixels; a batch of 32 is 4.6 MiB. The
training step is a fixed ``--step-ms`` of sleep, standing for GPU compute that leaves the host
CPU free. The three loaders are built once (persistent workers), warmed up, then measured in
interleaved rounds of ``--steps`` steps each, so all three see the same machine noise.

Host bytes are what the loader holds in flight: ``num_workers x prefetch_factor x batch bytes``
(exactly that many batches are queued once the workers are ahead) plus the batches its
background stage keeps ready (``device_prefetch_depth``, 1 by default), against the budget of
``host_prefetch_frac x host RAM / gpus_per_node``. This box has 2 cores and no GPU: the budget
assumes ``--gpus-per-node`` training processes share the host RAM, as on an 8-GPU node.

``--device cuda``: every loader delivers to the GPU (``device="cuda"``: pinned memory, torch's
pin-memory thread taking batches from the workers, the next ``device_prefetch_depth`` batches
copied on a side stream; depth 0 copies each batch when it is taken). Each step then also
reads its batch on the GPU (a sum) and ends with ``torch.cuda.synchronize()``, so the copies
and the kernel finish inside the step; the data wait is measured the same way (host time in
``next()``). Pinned batches count twice in the host bytes (the planner's rule).
"""

from __future__ import annotations

import argparse
import time

import torch

from raytrain_guard.config import GuardConfig
from raytrain_guard.runtime.data.loader import GuardedDataLoader
from raytrain_guard.runtime.host_memory import host_memory
from raytrain_guard.units import format_bytes


class DecodedImages:
    """A long virtual dataset of decoded images with a per-sample latency."""

    def __init__(self, n: int, sample_s: float) -> None:
        self.n, self.sample_s = n, sample_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.sample_s)
        return torch.full((3, 224, 224), i % 255, dtype=torch.uint8)


def run_steps(it, loader: GuardedDataLoader, steps: int, step_s: float,
              waits: list[float] | None = None, cuda: bool = False) -> tuple[float, float]:
    """(data wait, wall) over ``steps`` steps of fixed compute; each step's wait into ``waits``.
    ``cuda``: the step reads the batch on the GPU and ends with a synchronize."""
    wait = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        if cuda:
            batch = next(it)
            assert batch.is_cuda, f"batch on {batch.device}, not on the GPU"
            batch.sum()                  # a kernel on the current stream, after the copy
        else:
            next(it)
        wait += loader.last_data_wait_s
        if waits is not None:
            waits.append(loader.last_data_wait_s)
        time.sleep(step_s)
        if cuda:
            torch.cuda.synchronize()
    return wait, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--sample-ms", type=float, default=1.0)
    parser.add_argument("--step-ms", type=float, default=60.0)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the loaders deliver (cuda: see the module doc)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available here; nothing measured")
        raise SystemExit(2)

    config = GuardConfig()
    host = host_memory()[0]
    dataset = DecodedImages(10**6, args.sample_ms / 1000)
    common = {"world_rank": 0, "world_size": 1, "config": config,
              "gpus_per_node": args.gpus_per_node, "host_memory_bytes": host,
              "watch_worker_memory": False, "seed": 0, "device": args.device if cuda else None}
    loaders = {
        "torch default (num_workers=0)": GuardedDataLoader(dataset, args.batch_size,
                                                           num_workers=0, **common),
        "seed fixed (16 workers x prefetch 4)": GuardedDataLoader(
            dataset, args.batch_size, num_workers=16, prefetch_factor=4, **common),
        "guard planned": GuardedDataLoader(dataset, args.batch_size, **common),
        # the same plan with the training thread taking each batch from the workers' queue
        # itself (no background stage): what the stage hides
        "guard planned, no background stage": GuardedDataLoader(
            dataset, args.batch_size, device_prefetch_depth=0, **common),
    }
    iters = {name: iter(loader) for name, loader in loaders.items()}
    for name, loader in loaders.items():                 # warm-up: fill the queues
        run_steps(iters[name], loader, args.warmup_steps, args.step_ms / 1000, cuda=cuda)
    totals = {name: [0.0, 0.0] for name in loaders}
    medians: dict[str, list[float]] = {name: [] for name in loaders}
    for _ in range(args.rounds):
        for name, loader in loaders.items():
            wait, wall = run_steps(iters[name], loader, args.steps, args.step_ms / 1000,
                                   medians[name], cuda)
            totals[name][0] += wait
            totals[name][1] += wall

    budget = loaders["guard planned"].plan.budget_bytes
    batch = loaders["guard planned"].probe_batch_bytes
    print(f"host RAM {format_bytes(host)}, {args.gpus_per_node} GPUs/node assumed, budget "
          f"{config.host_prefetch_frac:.0%} x RAM / GPUs = {format_bytes(budget)}; batch "
          f"{args.batch_size} x 147 KiB = {format_bytes(batch)}; sample {args.sample_ms} ms, "
          f"step {args.step_ms} ms; {args.rounds} interleaved rounds x {args.steps} steps"
          + (f"; delivered to {torch.cuda.get_device_name()} (pinned, side-stream copies)"
             if cuda else ""))
    print(f"planned: {loaders['guard planned'].plan.reason}")
    print("| loader | workers x prefetch (+ stage) | data wait / step time | median wait per step "
          "| host bytes in flight | within budget |")
    print("|---|---|---|---|---|---|")
    for name, loader in loaders.items():
        wait, wall = totals[name]
        plan = loader.plan
        in_flight = loader.stats()["host_bytes_in_flight_estimate"]
        stage = loader.device_prefetch_depth if plan.num_workers or cuda else 0
        waits = sorted(medians[name])
        print(f"| {name} | {plan.num_workers} x {plan.prefetch_factor} (+ {stage}) | "
              f"{wait / wall:.1%} | {1000 * waits[len(waits) // 2]:.2f} ms | "
              f"{format_bytes(in_flight)} | {'yes' if in_flight <= budget else 'NO'} |")
    for loader in loaders.values():
        loader.close()
    print_overhead(args.rounds)


def print_overhead(rounds: int) -> None:
    """Per-batch cost of the guard's bookkeeping: the same in-process loading (num_workers=0,
    a tensor dataset, batch 64 of 16 floats), guarded vs a bare torch DataLoader, interleaved."""
    from torch.utils.data import DataLoader, DistributedSampler

    data = torch.arange(64 * 2000 * 16, dtype=torch.float32).reshape(-1, 16)
    guarded = GuardedDataLoader(data, 64, world_rank=0, world_size=1, num_workers=0,
                                watch_worker_memory=False, host_memory_bytes=1 << 30)
    bare = DataLoader(data, batch_size=64, sampler=DistributedSampler(data, num_replicas=1,
                                                                       rank=0))
    times = {"guarded": 0.0, "bare": 0.0}
    batches = 0
    for _ in range(rounds * 2):
        for name, loader in (("bare", bare), ("guarded", guarded)):
            t0 = time.perf_counter()
            n = sum(1 for _ in loader)
            times[name] += time.perf_counter() - t0
        batches += n
    print(f"bookkeeping overhead: guarded / bare torch time per batch = "
          f"{times['guarded'] / times['bare']:.3f} ({batches} batches each, "
          f"{1e6 * (times['guarded'] - times['bare']) / batches:+.1f} us per batch)")


if __name__ == "__main__":
    main()
