"""Train the toy model with the raytrain_guard train loop template on an embedded Ray cluster.

    python examples/guarded_train.py [--workers 2] [--strategy ddp|zero1|fsdp-full|fsdp-grad-op]

Starts a local Ray instance, runs a 2-worker TorchTrainer (gloo on CPU, NCCL with --gpu) on the
template, and prints the run's results: the measured bandwidth curve, the planned bucket cap,
the per-rank attribution and the guard's decisions.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ray  # noqa: E402, I001 - the local toy module stays apart from the libraries
from ray import cloudpickle  # noqa: E402
from ray.train import RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

import toy  # noqa: E402
from raytrain_guard.runtime.loop.train_loop import train_loop_per_worker  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--storage", default=None,
                        help="keep checkpoints here (default: a temp dir, removed at the end)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    cloudpickle.register_pickle_by_value(toy)      # the workers need not import this folder
    storage = args.storage or tempfile.mkdtemp(prefix="rtg-")
    ray.init(address="local", num_cpus=max(4, args.workers + 2), include_dashboard=False)
    try:
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={
                "model_factory": toy.make_model,
                "dataset_factory": functools.partial(toy.make_dataset, 512),
                "optimizer_factory": toy.make_optimizer,
                "loss_fn": toy.loss_fn,            # (model, batch) -> scalar
                "micro_batch": 16, "grad_accum": 2, "epochs": args.epochs,
                "checkpoint_every_steps": 8, "strategy": args.strategy, "num_workers": 0,
                "guard": {"memory_watermark_frac": 0.88},
            },
            scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpu),
            run_config=RunConfig(name="guarded_train", storage_path=storage))
        result = trainer.fit()
    finally:
        ray.shutdown()
        if args.storage is None:
            shutil.rmtree(storage, ignore_errors=True)
    results = json.loads(result.metrics["results"])
    kept = (f"checkpoint at {result.checkpoint.path}" if args.storage else
            "checkpoints in a temp dir, removed (pass --storage DIR to keep them)")
    print(f"trained {results['step']} of {results['total_steps']} steps, final loss "
          f"{result.metrics['loss']:.4f}, {kept}")
    if results["bandwidth"]:
        bw = results["bandwidth"]
        print("allreduce bandwidth (GB/s) by message size:",
              dict(zip(bw["sizes_bytes"], bw["bus_gbps"], strict=True)),
              f"knee {bw['knee_bytes']} B")
    print("bucket plan:", results["bucket_plan"]["reason"])
    print("model:", results["model"], "buckets:", results["bucket_layout"])
    for a in results["attribution"]:
        print("rank", a["world_rank"], a["role"], "-", a["reason"])
    for d in results["decisions"]:
        print("decision:", d["action"], "at step", d["applied_at"], "-", d["reason"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
