"""A guarded training for ``ray job submit`` on a running Ray cluster.

    ray start --head --metrics-export-port=8080        # or: ray up cluster.yaml
    RAY_AUTH_MODE=token ray job submit --working-dir . -- python examples/job_submit.py

(``RAY_AUTH_MODE=token`` when the cluster has a token, see docs/cluster.md.) The script joins the
cluster with plain ``ray.init()`` and calls the launcher: plan, one node monitor per node and
the coordinator (their metrics, prefixed ``ray_raytrain_guard_``, show on every node's metrics
endpoint), the shared train loop on ``--workers`` gloo (or, with ``--gpu``, nccl) workers,
teardown, and the summary. The toy model of ``examples/toy.py`` travels with the working dir.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ray  # noqa: E402

import examples.toy as toy  # noqa: E402
from raytrain_guard.cluster.launcher import launch  # noqa: E402
from raytrain_guard.cluster.planning import PlanDoesNotFit  # noqa: E402
from raytrain_guard.cluster.progress import ProgressPrinter  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--gpu", action="store_true", help="one GPU per worker (nccl)")
    parser.add_argument("--gpu-mem", default=None,
                        help="memory of one GPU, e.g. 80GiB: plan against it (with --gpu)")
    parser.add_argument("--storage-path", default=None,
                        help="Ray Train storage (shared, e.g. s3://..., on a multi-node cluster)")
    parser.add_argument("--namespace", default="raytrain_guard")
    parser.add_argument("--summary-json", default=None, help="also write the summary here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    ray.init(namespace=args.namespace)            # the cluster the job was submitted to
    from ray import cloudpickle
    cloudpickle.register_pickle_by_value(toy)     # workers on other nodes need not import it
    config = {"model_factory": toy.make_model,
              "dataset_factory": functools.partial(toy.make_dataset, 512),
              "optimizer_factory": toy.make_optimizer, "loss_fn": toy.loss_fn,
              "micro_batch": 8, "epochs": args.epochs, "num_workers": 0,
              "checkpoint_every_steps": 10_000}
    from raytrain_guard.units import parse_bytes
    gpu_mem = parse_bytes(args.gpu_mem, field="--gpu-mem") if args.gpu_mem else None
    if args.gpu and gpu_mem is None:
        print("--gpu without --gpu-mem: launching without a capacity plan", flush=True)
    try:
        summary = launch(config, num_workers=args.workers, use_gpu=args.gpu,
                         namespace=args.namespace, device_memory_bytes=gpu_mem,
                         plan=False if args.gpu and gpu_mem is None else None,
                         storage_path=args.storage_path,
                         progress=ProgressPrinter(sys.stdout),  # a line per new step
                         progress_interval_s=2.0,
                         fixes=("lower micro_batch in this script's config, or find a setup "
                                "that fits with `raytrain-guard plan` and set it there",))
    except PlanDoesNotFit as exc:
        print(exc, file=sys.stderr)
        return 1
    print(summary.format())
    if args.summary_json:
        with open(args.summary_json, "w") as fh:
            json.dump(summary.to_dict(), fh, default=str)
    return 0 if summary.steps == summary.total_steps else 1


if __name__ == "__main__":
    sys.exit(main())
