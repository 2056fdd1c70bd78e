"""Planner accuracy: predicted per-rank peak (fake trace -> estimate()) against the measured peak.

For each model family the model is traced once under FakeTensorMode (``raytrain_guard.planner.trace``),
and ``estimate()`` predicts the per-rank peak at the traced micro-batch and at a micro-batch that
was never traced (3 x). The same models are then trained for real - AdamW, the loop
``loss.backward(); opt.step(); opt.zero_grad()`` - with one rank (no DDP wrapper, as Ray's
``prepare_model`` does at world size 1) and with two gloo ranks (real processes,
``torch.multiprocessing.spawn``) under DDP, DDP + ``ZeroRedundancyOptimizer`` (zero1) and FSDP2
``fully_shard`` per unit of ``planner.fsdp_units.wrap_units`` plus the root (``reshard_after_forward``
True: fsdp-full, False: fsdp-grad-op), all through the train loop's own ``wrap_model`` and
``wrap_optimizer``. With two ranks each FSDP strategy also runs with gradient accumulation
(``--accum``, default 2 micro-batches a step, at ``b0``) in both gradient syncs of
``wrap_model(fsdp_grad_sync=...)``: ``every_micro_batch`` (reduce-scatter every micro-batch)
and ``last_micro_batch`` (``grad_sync(False)`` until the last), predicted with the same
``TrainingSetup(grad_accum=..., fsdp_grad_sync=...)``. Measured peak:

* ``--device cpu`` (default): PyTorch's own accounting, MemTracker on the real CPU tensors. One
  tracker covers DDP's construction and three steps, so DDP's gradient buckets and their rebuild
  after the first iteration are counted; the optimizer state exists from the second step on.
* ``--device cuda``: ``torch.cuda.max_memory_allocated`` over the same three steps (nccl for two
  ranks), with the optimizer's CUDA default (foreach) predicted, less what was allocated before
  the model was built. cuBLAS takes its workspace (32 MiB per handle and stream on Hopper) from
  the caching allocator at its first matmul and keeps it; the planner budgets it in the
  reserve (``cuda_context_bytes``), so each rank runs one forward and backward first and the
  baseline it leaves (printed) is not counted. With one GPU only ``--ranks 1`` runs.

Run: ``python benchmarks/planner_accuracy.py [--device cuda] [--ranks 1 2] [--strategies ...]
[--accum N]`` (``--accum 1``: no accumulation cases).
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
from raytrain_guard.planner.memory_model import TrainingSetup, estimate
from raytrain_guard.planner.step_memory import skip_frozen_grad_hooks
from raytrain_guard.planner.trace import trace_model
from raytrain_guard.runtime.dist.model import wrap_model, wrap_optimizer

STRATEGIES = ("ddp", "zero1", "fsdp-grad-op", "fsdp-full")
SYNCS = ("every_micro_batch", "last_micro_batch")

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
            strategy: str = "ddp", accum: int = 1, sync: str = "last_micro_batch") -> int:
    """Peak tensor bytes of this rank over wrapping + 3 training steps of ``accum``
    micro-batches each."""
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
        planned, opt = _wrap(model, world_size, dev, strategy, sync)
        _steps(planned, opt, batch, loss_fn, accum=accum)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.distributed._tools.mem_tracker import MemTracker
    tracker = MemTracker()
    skip_frozen_grad_hooks(tracker, model)  # MemTracker raises on frozen parameters otherwise
    with tracker:
        planned, opt = _wrap(model, world_size, dev, strategy, sync)
        skip_frozen_grad_hooks(tracker, model)  # FSDP replaced the parameters
        tracker.track_external(model, opt, batch)
        _steps(planned, opt, batch, loss_fn, tracker, accum=accum)
    return sum(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())


def _steps(planned, opt, batch, loss_fn, tracker=None, accum: int = 1):
    for _ in range(3):
        for micro in range(accum):   # the train loop's accumulation: sync on the last only
            with planned.grad_sync(micro == accum - 1):
                _loss(planned.module, batch, loss_fn).backward()
            if tracker is not None and micro < accum - 1:
                tracker.reset_mod_stats()  # one forward per module between resets
        opt.step()
        opt.zero_grad(set_to_none=True)
        if tracker is not None:
            tracker.reset_mod_stats()  # per-module stats only; the global peak is kept


def _wrap(model, world_size, dev, strategy, sync="last_micro_batch"):
    """(PlannedModel, optimizer), wrapped the way the train loop does it: ``wrap_model``
    (DDP; FSDP2 per ``wrap_units`` unit plus the root, with the gradient sync ``sync``; nothing
    at world size 1, as Ray's ``prepare_model``) and ``wrap_optimizer``
    (ZeroRedundancyOptimizer under zero1)."""
    planned = wrap_model(model, strategy=strategy, device=dev, use_ray=False,
                         fsdp_grad_sync=sync)
    adamw = torch.optim.AdamW([p for p in planned.module.parameters() if p.requires_grad],
                              lr=1e-3)
    return planned, wrap_optimizer(planned, adamw)


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
        for name, b, strategy, accum, sync in jobs:
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
            peak = measure(name, b, device, world_size, strategy, accum, sync)
            lines.append(f"{name}\t{b}\t{strategy}\t{accum}\t{sync}\t{peak}")
        with open(os.path.join(out_dir, f"rank{rank}.tsv"), "w") as fh:
            fh.write("\n".join(lines))
    finally:
        dist.destroy_process_group()


def measure_ranks(jobs, device: str, world_size: int) -> dict[tuple, int]:
    """Per-job peak, the larger of the ranks (they should agree)."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_rank_main, args=(world_size, device, jobs, init_file, tmp),
                 nprocs=world_size, join=True)
        peaks: dict[tuple, int] = {}
        for r in range(world_size):
            with open(os.path.join(tmp, f"rank{r}.tsv")) as fh:
                for line in fh:
                    name, b, strategy, accum, sync, peak = line.rstrip("\n").split("\t")
                    key = (name, int(b), strategy, int(accum), sync)
                    peaks[key] = max(peaks.get(key, 0), int(peak))
        return peaks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES),
                        choices=list(STRATEGIES),
                        help="strategies measured with more than one rank (one rank: ddp)")
    parser.add_argument("--accum", type=int, default=2,
                        help="micro-batches a step in the FSDP accumulation cases (both gradient "
                             "syncs, at b0, more than one rank); 1: none")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available here; nothing measured")
        return 2
    if args.device == "cuda" and max(args.ranks) > torch.cuda.device_count():
        args.ranks = [r for r in args.ranks if r <= torch.cuda.device_count()]

    traces, jobs = {}, []
    for name in args.families:
        build, sample, loss_fn = FAMILIES[name]
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
        ws_jobs = [(name, b, s, 1, "last_micro_batch") for s in strategies for name, b in jobs]
        if world_size > 1 and args.accum > 1:
            ws_jobs += [(name, traces[name].micro_batch, s, args.accum, sync)
                        for s in strategies if s.startswith("fsdp") for sync in SYNCS
                        for name in traces]
        measured = measure_ranks(ws_jobs, args.device, world_size)
        for job in ws_jobs:
            name, b, strategy, accum, sync = job
            tr = traces[name]
            setup = TrainingSetup(strategy=strategy, precision="fp32", optimizer="adamw",
                                  micro_batch=b, world_size=world_size, grad_accum=accum,
                                  fsdp_grad_sync=sync, foreach=args.device == "cuda")
            est = estimate(tr.model_stats, tr.activations, setup)
            m = measured[job]
            accum_txt = "-" if accum == 1 else f"{accum} {sync.split('_')[0]}"
            rows.append((name, strategy, world_size, b,
                         "traced" if b == tr.micro_batch else "predicted",
                         est.peak_bytes, m, est.peak_bytes / m - 1, est.peak_phase, accum_txt))

    print()
    measured = "MemTracker on real CPU tensors" if args.device == "cpu" else \
        "torch.cuda.max_memory_allocated less the baseline before the model (cuBLAS workspaces)"
    print(f"device: {args.device}; predicted = estimate(trace at b0) peak_bytes; "
          f"measured = {measured}")
    head = f"{'model':34} {'strategy':>12} {'ranks':>5} {'b':>4} {'b is':>9} {'accum':>7} " \
           f"{'predicted MiB':>14} {'measured MiB':>13} {'error':>8}  phase"
    print(head)
    print("-" * len(head))
    for name, strategy, ws, b, kind, pred, meas, err, phase, accum_txt in rows:
        print(f"{name:34} {strategy:>12} {ws:>5} {b:>4} {kind:>9} {accum_txt:>7} "
              f"{pred / 2**20:>14.3f} {meas / 2**20:>13.3f} {err:>+8.2%}  {phase}")
    fsdp = [r for r in rows if r[1].startswith("fsdp")]
    for label, subset in (("all", rows), ("ddp", [r for r in rows if r[1] == "ddp"]),
                          ("zero1", [r for r in rows if r[1] == "zero1"]),
                          ("fsdp", fsdp),
                          ("fsdp, no accumulation", [r for r in fsdp if r[9] == "-"]),
                          ("fsdp every", [r for r in fsdp if r[9].endswith("every")]),
                          ("fsdp last", [r for r in fsdp if r[9].endswith("last")])):
        if subset:
            errs = [abs(r[7]) for r in subset]
            print(f"|error| {label:>21}: median {statistics.median(errs):.2%}, worst "
                  f"{max(errs):.2%} over {len(subset)} cases")
    print("goal: median <= 5 %, worst <= 10 %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
