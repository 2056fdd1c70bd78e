"""Planner accuracy: predicted per-rank peak (fake trace -> estimate()) against the measured peak.

For each model family the model is traced once under FakeTensorMode (``raytrain_guard.trace``),
and ``estimate()`` predicts the per-rank peak at the traced micro-batch and at a micro-batch that
was never traced (3 x). The same models are then trained for real - AdamW, the loop
``loss.backward(); opt.step(); opt.zero_grad()`` - with one rank (no DDP wrapper, as Ray's
``prepare_model`` does at world size 1) and with two gloo ranks (real processes,
``torch.multiprocessing.spawn``) under DDP, DDP + ``ZeroRedundancyOptimizer`` (zero1) and FSDP2
``fully_shard`` per unit of ``runtime.model.wrap_units`` plus the root (``reshard_after_forward``
True: fsdp-full, False: fsdp-grad-op), all through the train loop's own ``wrap_model`` and
``wrap_optimizer``. Measured peak:

* ``--device cpu`` (default): PyTorch's own accounting, MemTracker on the real CPU tensors. One
  tracker covers DDP's construction and three steps, so DDP's gradient buckets and their rebuild
  after the first iteration are counted; the optimizer state exists from the second step on.
* ``--device cuda``: ``torch.cuda.max_memory_allocated`` over the same three steps (nccl for two
  ranks), with the optimizer's CUDA default (foreach) predicted, less what was allocated before
  the model was built. cuBLAS takes its workspace (32 MiB per handle and stream on Hopper) from
  the caching allocator at its first matmul and keeps it; the planner budgets it in the
  reserve (``cuda_context_bytes``), so each rank runs one forward and backward first and the
  baseline it leaves (printed) is not counted. With one GPU only ``--ranks 1`` runs.

Run: ``python benchmarks/planner_accuracy.py [--device cuda] [--ranks 1 2] [--strategies ...]``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from examples import models
from raytrain_guard.core.memory_model import TrainingSetup, estimate
from raytrain_guard.runtime.model import wrap_model, wrap_optimizer
from raytrain_guard.trace import skip_frozen_grad_hooks, trace_model

STRATEGIES = ("ddp", "zero1", "fsdp-grad-op", "fsdp-full")

FAMILIES = {  # name: (model factory, sample factory, loss or None)
    "mlp": (models.mlp, models.mlp_batch, None),
    "cnn-batchnorm": (models.cnn, models.cnn_batch, None),
    "gpt-lm (tied, hand-written attn)": (models.gpt, models.gpt_batch, models.gpt_loss),
    "frozen-backbone fine-tune": (models.finetune, models.finetune_batch, None),
}


def _loss(model, batch, loss_fn):
    if loss_fn is not None:
        return loss_fn(model, batch)
    return model(batch).sum()


def measure(name: str, micro_batch: int, device: str, world_size: int,
            strategy: str = "ddp") -> int:
    """Peak tensor bytes of this rank over wrapping + 3 training steps."""
    build, sample, loss_fn = FAMILIES[name]
    torch.manual_seed(0)
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else \
        torch.device("cpu")
    base = torch.cuda.memory_allocated() if device == "cuda" else 0   # cuBLAS workspaces
    model = build().to(dev)
    batch = sample(batch_size=micro_batch).to(dev)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        wrapped, opt = _wrap(model, world_size, dev, strategy)
        _steps(wrapped, opt, batch, loss_fn)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.distributed._tools.mem_tracker import MemTracker
    tracker = MemTracker()
    skip_frozen_grad_hooks(tracker, model)  # MemTracker raises on frozen parameters otherwise
    with tracker:
        wrapped, opt = _wrap(model, world_size, dev, strategy)
        skip_frozen_grad_hooks(tracker, model)  # FSDP replaced the parameters
        tracker.track_external(model, opt, batch)
        _steps(wrapped, opt, batch, loss_fn, tracker)
    return sum(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())


def _steps(wrapped, opt, batch, loss_fn, tracker=None):
    for _ in range(3):
        _loss(wrapped, batch, loss_fn).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if tracker is not None:
            tracker.reset_mod_stats()  # per-module stats only; the global peak is kept


def _wrap(model, world_size, dev, strategy):
    """(model to call, optimizer), wrapped the way the train loop does it: ``wrap_model``
    (DDP; FSDP2 per ``wrap_units`` unit plus the root; nothing at world size 1, as Ray's
    ``prepare_model``) and ``wrap_optimizer`` (ZeroRedundancyOptimizer under zero1)."""
    planned = wrap_model(model, strategy=strategy, device=dev, use_ray=False)
    adamw = torch.optim.AdamW([p for p in planned.module.parameters() if p.requires_grad],
                              lr=1e-3)
    return planned.module, wrap_optimizer(planned, adamw)


def _warm_cublas() -> int:
    """One forward and backward on this rank's GPU, so cuBLAS holds its workspaces (one per
    handle and stream; autograd's backward thread has its own handle) before any job starts;
    returns the bytes allocated then."""
    layer = torch.nn.Linear(256, 256, device="cuda")
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    (layer(x) @ x.T).sum().backward()
    del layer, x
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _rank_main(rank: int, world_size: int, device: str, jobs, init_file: str, out_dir: str):
    if device == "cuda":
        torch.cuda.set_device(rank)
        print(f"rank {rank}: {_warm_cublas()} B allocated before the first model (cuBLAS "
              f"workspaces), not counted", flush=True)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank,
                            world_size=world_size, init_method=f"file://{init_file}")
    try:
        lines = []
        for name, b, strategy in jobs:
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
            peak = measure(name, b, device, world_size, strategy)
            lines.append(f"{name}\t{b}\t{strategy}\t{peak}")
        with open(os.path.join(out_dir, f"rank{rank}.tsv"), "w") as fh:
            fh.write("\n".join(lines))
    finally:
        dist.destroy_process_group()


def measure_ranks(jobs, device: str, world_size: int) -> dict[tuple[str, int, str], int]:
    """Per-job peak, the larger of the ranks (they should agree)."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_rank_main, args=(world_size, device, jobs, init_file, tmp),
                 nprocs=world_size, join=True)
        peaks: dict[tuple[str, int, str], int] = {}
        for r in range(world_size):
            with open(os.path.join(tmp, f"rank{r}.tsv")) as fh:
                for line in fh:
                    name, b, strategy, peak = line.rstrip("\n").split("\t")
                    key = (name, int(b), strategy)
                    peaks[key] = max(peaks.get(key, 0), int(peak))
        return peaks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES),
                        choices=list(STRATEGIES),
                        help="strategies measured with more than one rank (one rank: ddp)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available here; nothing measured")
        return 2
    if args.device == "cuda" and max(args.ranks) > torch.cuda.device_count():
        args.ranks = [r for r in args.ranks if r <= torch.cuda.device_count()]

    traces, jobs = {}, []
    for name, (build, sample, loss_fn) in FAMILIES.items():
        t0 = time.perf_counter()
        traces[name] = trace_model(build, sample, loss=loss_fn, optimizer="adamw")
        b0 = traces[name].micro_batch
        print(f"traced {name}: {traces[name].model_stats.num_params} params, "
              f"{time.perf_counter() - t0:.1f} s, peak {traces[name].peak_bytes} B in "
              f"{traces[name].peak_phase} at micro-batch {b0}", flush=True)
        jobs += [(name, b0), (name, 3 * b0)]

    rows = []
    for world_size in args.ranks:
        strategies = args.strategies if world_size > 1 else ["ddp"]
        ws_jobs = [(name, b, s) for s in strategies for name, b in jobs]
        measured = measure_ranks(ws_jobs, args.device, world_size)
        for name, b, strategy in ws_jobs:
            tr = traces[name]
            setup = TrainingSetup(strategy=strategy, precision="fp32", optimizer="adamw",
                                  micro_batch=b, world_size=world_size,
                                  foreach=args.device == "cuda")
            est = estimate(tr.model_stats, tr.activations, setup)
            m = measured[(name, b, strategy)]
            rows.append((name, strategy, world_size, b,
                         "traced" if b == tr.micro_batch else "predicted",
                         est.peak_bytes, m, est.peak_bytes / m - 1, est.peak_phase))

    print()
    measured = "MemTracker on real CPU tensors" if args.device == "cpu" else \
        "torch.cuda.max_memory_allocated less the baseline before the model (cuBLAS workspaces)"
    print(f"device: {args.device}; predicted = estimate(trace at b0) peak_bytes; "
          f"measured = {measured}")
    head = f"{'model':34} {'strategy':>12} {'ranks':>5} {'b':>4} {'b is':>9} " \
           f"{'predicted MiB':>14} {'measured MiB':>13} {'error':>8}  phase"
    print(head)
    print("-" * len(head))
    for name, strategy, ws, b, kind, pred, meas, err, phase in rows:
        print(f"{name:34} {strategy:>12} {ws:>5} {b:>4} {kind:>9} {pred / 2**20:>14.3f} "
              f"{meas / 2**20:>13.3f} {err:>+8.2%}  {phase}")
    for label, subset in (("all", rows), ("ddp", [r for r in rows if r[1] == "ddp"]),
                          ("zero1", [r for r in rows if r[1] == "zero1"]),
                          ("fsdp", [r for r in rows if r[1].startswith("fsdp")])):
        if subset:
            errs = [abs(r[7]) for r in subset]
            print(f"|error| {label:>5}: median {statistics.median(errs):.2%}, worst "
                  f"{max(errs):.2%} over {len(subset)} cases")
    print("goal: median <= 5 %, worst <= 10 %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
