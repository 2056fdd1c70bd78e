"""The analytic planner against published memory of real Llama training runs (and the trace).

Each published row is one run the planner can represent: data parallel / FSDP2 without tensor,
pipeline or context parallelism, eager (no ``torch.compile``), bf16 (no float8). The measured
figure is the trainer's logged peak of the CUDA caching allocator's *reserved* memory
(``torch.cuda.memory_stats()["reserved_bytes.all.peak"]``); the planner's figure is its total
less ``cuda_context_bytes`` (the CUDA context and NCCL's buffers lie outside the caching
allocator, so the trainer's figure does not hold them): the tensor peak plus the allocator
reserve (``fragmentation_frac`` of the peak, and under FSDP the previous step's gradient shards,
see ``planner/memory_model.py``).

``--trace`` adds the traced-vs-analytic row: ``examples/llama.py`` (Llama 3.2 3B's shape, as
users write it) traced on the CPU under FakeTensorMode, planned next to the analytic model of
the same shape (a few minutes on a 2-core box). The last column is the measured figure over the
predicted tensor peak plus gradient-shard holes: the ``1 + fragmentation_frac`` that would make
the row exact.

Run: ``python benchmarks/planner_published.py [--trace] [--fragmentation FRAC]``; prints a
Markdown table (docs/benchmarks.md, "Planner against published runs").
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from raytrain_guard.config import GuardConfig
from raytrain_guard.planner.activations import analytic_transformer
from raytrain_guard.planner.memory_model import TrainingSetup, estimate
from raytrain_guard.units import GiB

TORCHTITAN_2024_12 = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md "
                      "(torchtitan 9dec370, torch 1963fc8, Dec 2024)")
#: Llama 3.1 8B (torchtitan's "8B" flavor: dim 4096, 32 layers, 32 heads, 8 KV heads, SwiGLU
#: hidden 14336, vocabulary 128256, RMSNorm, rotary, no biases, untied head)
LLAMA3_8B = {"layers": 32, "hidden": 4096, "heads": 32, "num_kv_heads": 8,
             "ffn_hidden": 14336, "vocab": 128256, "gated_mlp": True, "bias": False}


@dataclass(frozen=True)
class PublishedRun:
    source: str
    config: str
    measured_gib: float
    shape: dict
    seq_len: int
    recompute: str
    setup: TrainingSetup


#: torchtitan's run (train_configs/llama3_8b.toml at 9dec370): seq 8192, AdamW (foreach),
#: FSDP2 fully_shard per block + root with MixedPrecisionPolicy(bf16, fp32), activation
#: checkpointing "selective" with selective_ac_option "op" (per-op SAC: every other mm and SDPA
#: saved), eager, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, "del pred" before backward
PUBLISHED = [
    PublishedRun(TORCHTITAN_2024_12 + ", Table 1 row FSDP",
                 "Llama 3.1 8B, 8 x H100 96 GB, FSDP2, local batch 2, seq 8192, per-op SAC",
                 82.4, LLAMA3_8B, 8192, "per-op",
                 TrainingSetup(strategy="fsdp-full", precision="bf16-master", optimizer="adamw",
                               micro_batch=2, world_size=8)),
    PublishedRun(TORCHTITAN_2024_12 + ", Table 3 row FSDP",
                 "Llama 3.1 8B, 128 x H100 96 GB, FSDP2, local batch 2, seq 8192, per-op SAC",
                 67.0, LLAMA3_8B, 8192, "per-op",
                 TrainingSetup(strategy="fsdp-full", precision="bf16-master", optimizer="adamw",
                               micro_batch=2, world_size=128)),
]

#: examples/llama.py's default shape (Llama 3.2 3B, tied embeddings), seq examples.llama.SEQ_LEN
LLAMA32_3B = {"layers": 28, "hidden": 3072, "heads": 24, "num_kv_heads": 8,
              "ffn_hidden": 8192, "vocab": 128256, "gated_mlp": True, "bias": False,
              "tied_embeddings": True}


def predict_reserved(run: PublishedRun, config: GuardConfig) -> tuple[int, int]:
    """(tensor peak, peak + allocator reserve) in bytes for one published run; the reserve is
    ``fragmentation_frac`` of the peak plus, under FSDP, the previous step's gradient shards."""
    stats, acts = analytic_transformer(seq_len=run.seq_len, precision=run.setup.precision,
                                       recompute=run.recompute, **run.shape)
    est = estimate(stats, acts, run.setup, config)
    return est.peak_bytes, est.total_bytes - config.cuda_context_bytes


def published_rows(config: GuardConfig) -> list[str]:
    rows = []
    for run in PUBLISHED:
        peak, predicted = predict_reserved(run, config)
        holes = predicted - peak - round(config.fragmentation_frac * peak)
        measured = run.measured_gib * GiB
        rows.append(f"| {run.source} | {run.config} | {run.measured_gib:.1f} GiB reserved | "
                    f"{predicted / GiB:.1f} GiB (tensors {peak / GiB:.1f} + reserve "
                    f"{(predicted - peak) / GiB:.1f}) | {predicted / measured - 1:+.1%} | "
                    f"{measured / (peak + holes):.3f} |")
    return rows


def trace_row(setup: TrainingSetup, config: GuardConfig) -> str:
    from examples import llama
    from raytrain_guard.planner.trace import trace_model

    start = time.perf_counter()
    traced = trace_model(llama.llama_3b, llama.llama_batch, loss=llama.llama_loss,
                         precision=setup.precision, optimizer=setup.optimizer)
    trace_s = time.perf_counter() - start
    stats, acts = analytic_transformer(seq_len=llama.SEQ_LEN, precision=setup.precision,
                                       recompute="none", **LLAMA32_3B)
    if stats.num_params != traced.model_stats.num_params:
        raise SystemExit(f"parameter counts differ: analytic {stats.num_params}, traced "
                         f"{traced.model_stats.num_params}")
    t = estimate(traced.model_stats, traced.activations, setup, config).peak_bytes
    a = estimate(stats, acts, setup, config).peak_bytes
    return (f"| traced on CPU in {trace_s:.0f} s (FakeTensorMode + MemTracker), "
            f"examples/llama.py:llama_3b | Llama 3.2 3B shape ({stats.num_params / 1e9:.2f} B), "
            f"seq {llama.SEQ_LEN}, micro-batch {setup.micro_batch}, {setup.strategy.value} x "
            f"{setup.world_size}, {setup.precision.value}, no recompute | {t / GiB:.2f} GiB "
            f"(traced plan, tensors) | {a / GiB:.2f} GiB (analytic plan, tensors) | "
            f"{a / t - 1:+.2%} | - |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", action="store_true", help="add the traced-vs-analytic row")
    parser.add_argument("--fragmentation", type=float, default=None,
                        help="allocator reserve as a fraction of the tensor peak (default: "
                             "GuardConfig's fragmentation_frac)")
    args = parser.parse_args(argv)
    config = GuardConfig()
    if args.fragmentation is not None:
        config = replace(config, fragmentation_frac=args.fragmentation)
    print("| source | config | measured | predicted | error | implied reserved / allocated |")
    print("|---|---|---|---|---|---|")
    for row in published_rows(config):
        print(row)
    if args.trace:
        setup = TrainingSetup(strategy="fsdp-full", precision="bf16-master", optimizer="adamw",
                              micro_batch=1, world_size=8)
        print(trace_row(setup, config), flush=True)


if __name__ == "__main__":
    main()
