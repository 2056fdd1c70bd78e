"""The analytic planner against one real FSDP2 run of examples/llama.py: tensors and reserve.

One process, one rank: ``fully_shard`` on every block (the last one not resharded after forward,
as torchtitan does) and on the root, ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`` (``--precision bf16-master``), AdamW, per-op selective activation
checkpointing unless ``--recompute none``, ``zero_grad(set_to_none=True)`` at the start of each
step as torchtitan does. After one warm-up step (optimizer state) the peak over the next steps
is compared with ``estimate()`` of the analytic model of the same shape:

* ``--device cuda``: ``torch.cuda.max_memory_allocated`` against the predicted tensor peak, and
  ``max_memory_reserved`` against the predicted reserved memory (the plan's total less
  ``cuda_context_bytes``); their ratio is the measured reserved/allocated, the figure
  ``fragmentation_frac`` stands for (docs/benchmarks.md). Set
  ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` to match torchtitan's runs.
* ``--device cpu``: MemTracker on the real CPU tensors against the tensor peak (no reserve on
  the CPU), at a small default shape; this checks the script itself.

Run: ``python benchmarks/planner_reserve.py --device cuda`` (about a minute on one H200 at the
default CUDA shape: 8 Llama 3.1 8B blocks, tied 128 k embedding, seq 8192, micro-batch 1,
2.27 B parameters).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from examples import llama
from raytrain_guard.config import GuardConfig
from raytrain_guard.planner.activations import analytic_transformer
from raytrain_guard.planner.memory_model import TrainingSetup, estimate
from raytrain_guard.planner.step_memory import skip_frozen_grad_hooks
from raytrain_guard.units import GiB

#: (layers, hidden, heads, kv heads, MLP hidden, vocabulary, seq) per device
SHAPES = {"cuda": (8, 4096, 32, 8, 14336, 128256, 8192), "cpu": (2, 256, 8, 2, 768, 4096, 256)}


def build(cfg: llama.LlamaConfig, per_op: bool, device: torch.device) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with device:
        model = llama.Llama(cfg, per_op_checkpoint=per_op)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model.layers):
        fully_shard(block, mp_policy=policy, reshard_after_forward=i < len(model.layers) - 1)
    fully_shard(model, mp_policy=policy)
    return model


def run(args) -> tuple[int, int | None]:
    """(peak tensor bytes, peak reserved bytes or None) over steps 2..N."""
    layers, hidden, heads, kv, ffn, vocab, seq = SHAPES[args.device]
    cfg = llama.LlamaConfig(layers=layers, hidden=hidden, heads=heads, kv_heads=kv,
                            ffn_hidden=ffn, vocab=vocab, max_seq=seq)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    model = build(cfg, args.recompute == "per-op", device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=args.device == "cuda")
    batch = tuple(t.to(device) for t in llama.llama_batch(args.micro_batch, seq, vocab))

    def step():
        opt.zero_grad(set_to_none=True)
        llama.llama_loss(model, batch).backward()
        opt.step()

    step()                                   # warm-up: optimizer state, cuBLAS workspaces
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(args.steps - 1):
            step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    skip_frozen_grad_hooks(tracker, model)
    tracker.track_external(model, opt, batch)
    with tracker:
        for _ in range(args.steps - 1):
            step()
            tracker.reset_mod_stats()
    return sum(s["Total"] for s in tracker.get_tracker_snapshot("peak").values()), None


def predict(args) -> tuple[int, int, str]:
    """(tensor peak, reserved = total less the CUDA context, peak phase)."""
    layers, hidden, heads, kv, ffn, vocab, seq = SHAPES[args.device]
    stats, acts = analytic_transformer(layers=layers, hidden=hidden, heads=heads,
                                       num_kv_heads=kv, ffn_hidden=ffn, vocab=vocab,
                                       seq_len=seq, gated_mlp=True, bias=False,
                                       tied_embeddings=True, precision="bf16-master",
                                       recompute=args.recompute)
    setup = TrainingSetup(strategy="fsdp-full", precision="bf16-master", optimizer="adamw",
                          micro_batch=args.micro_batch, world_size=1,
                          foreach=args.device == "cuda")
    config = GuardConfig()
    est = estimate(stats, acts, setup, config)
    return est.peak_bytes, est.total_bytes - config.cuda_context_bytes, est.peak_phase


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--recompute", choices=["per-op", "none"], default="per-op")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available here; nothing measured")
        return 2
    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                                init_method=f"file://{f.name}", rank=0, world_size=1)
        try:
            allocated, reserved = run(args)
        finally:
            dist.destroy_process_group()
    peak, predicted_reserved, phase = predict(args)
    print(f"shape {SHAPES[args.device]}, micro-batch {args.micro_batch}, recompute "
          f"{args.recompute}, FSDP2 1 rank, bf16/fp32-reduce, AdamW; peak phase {phase}")
    print(f"tensors:  predicted {peak / GiB:.3f} GiB, measured {allocated / GiB:.3f} GiB, "
          f"error {peak / allocated - 1:+.2%}")
    if reserved is not None:
        print(f"reserved: predicted {predicted_reserved / GiB:.3f} GiB, measured "
              f"{reserved / GiB:.3f} GiB, error {predicted_reserved / reserved - 1:+.2%}; "
              f"measured reserved/allocated {reserved / allocated:.3f} "
              f"(PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
