"""Planner scale: an analytic 70B plan is instant; a traced 1.2B plan needs no model memory.

1. Llama-2-70B shape (80 layers, hidden 8192, 64 heads, 8 KV heads, SwiGLU 28672, vocab 32000,
   seq 4096), bf16-master, full recompute: the analytic profile plus a planner-style binary
   search over micro-batch (one ``estimate()`` per probe) for FSDP FULL_SHARD on 64 ranks of 80 GiB.
   Timed with ``time.perf_counter`` over repeated runs; the median is reported.
2. A 1.2 B-parameter GPT (``examples.models:gpt_1b``, 24 x 2048, vocab 50304, seq 1024) traced under
   FakeTensorMode in a child process (two micro-batches, three full training steps): wall time
   and the child's peak RSS (``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss``), against the
   4.8 GB its fp32 parameters alone would take for real.

Run: ``python benchmarks/planner_scale.py [--skip-trace]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from raytrain_guard.config import GuardConfig  # noqa: E402
from raytrain_guard.planner.activations import analytic_transformer  # noqa: E402
from raytrain_guard.planner.memory_model import TrainingSetup, estimate  # noqa: E402
from raytrain_guard.units import GiB  # noqa: E402

LLAMA2_70B = dict(layers=80, hidden=8192, heads=64, seq_len=4096, vocab=32000, ffn_hidden=28672,
                  num_kv_heads=8, gated_mlp=True, bias=False)


def plan_70b(device_bytes: int = 80 * GiB, world_size: int = 64) -> tuple[int, object, int]:
    """Largest micro-batch that fits (binary search, as the planner does) -> (b, estimate, probes)."""
    config = GuardConfig()
    stats, prof = analytic_transformer(precision="bf16-master", recompute="full", **LLAMA2_70B)
    budget = device_bytes * config.budget_frac
    base = TrainingSetup(strategy="fsdp-full", precision="bf16-master", optimizer="adamw",
                         world_size=world_size)
    lo, hi, probes = 0, 1024, 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        probes += 1
        setup = dataclasses.replace(base, micro_batch=mid)
        if estimate(stats, prof, setup, config).total_bytes <= budget:
            lo = mid
        else:
            hi = mid - 1
    best = estimate(stats, prof, dataclasses.replace(base, micro_batch=max(lo, 1)), config)
    return lo, best, probes


TRACE_CHILD = """
import json, time
from raytrain_guard.planner.trace import trace_model
t = time.perf_counter()
r = trace_model("examples.models:gpt_1b", "examples.models:gpt_1b_batch", micro_batches=(1, 2))
print(json.dumps({"s": time.perf_counter() - t, "params": r.model_stats.num_params,
                  "peak": r.peak_bytes, "phase": r.peak_phase, "mode": r.mode,
                  "per_sample": r.activations.bytes_per_sample,
                  "fixed": r.activations.fixed_bytes}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-trace", action="store_true")
    args = parser.parse_args()

    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        b, est, probes = plan_70b()
        times.append(time.perf_counter() - t0)
    print(f"Llama-2-70B analytic plan (FSDP full, 64 ranks, 80 GiB, bf16-master, full recompute): "
          f"micro-batch {b} fits, {probes} estimate() probes; median {statistics.median(times) * 1e3:.2f} ms, "
          f"max {max(times) * 1e3:.2f} ms over {len(times)} plans")
    print(f"  at micro-batch {b}: peak {est.peak_bytes / GiB:.1f} GiB in {est.peak_phase}, "
          f"total with reserve {est.total_bytes / GiB:.1f} GiB; breakdown (GiB): "
          + ", ".join(f"{k} {v / GiB:.2f}" for k, v in est.breakdown.items()))

    if args.skip_trace:
        return 0
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", TRACE_CHILD], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    maxrss_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    res = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"gpt_1b traced under FakeTensorMode ({res['mode']}): {res['params'] / 1e9:.2f} B params, "
          f"trace {res['s']:.1f} s (child wall {wall:.1f} s with imports), child peak RSS "
          f"{maxrss_kib / 1024:.0f} MiB; fp32 parameters alone would be "
          f"{res['params'] * 4 / GiB:.1f} GiB; traced peak {res['peak'] / GiB:.1f} GiB in "
          f"{res['phase']}, activations {res['fixed'] / GiB:.2f} GiB + "
          f"{res['per_sample'] / GiB:.2f} GiB x b")
    return 0


if __name__ == "__main__":
    sys.exit(main())
