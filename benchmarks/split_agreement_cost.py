"""What the per-micro-batch split agreement costs an FSDP2 step (2 gloo ranks, CPU).

The shared train loop trains the built-in sequence model under ``fsdp-full`` on a simulated
card big enough that nothing is ever split, with ``split_spikes`` on (the ranks agree on each
micro-batch's pieces: one 16-byte CPU allreduce) and off, alternating, in one process group;
it prints the median step time of each on rank 0 and their ratio::

    python benchmarks/split_agreement_cost.py [--rounds 3] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

BUILT_IN = {"model_factory": "raytrain_guard.experiment.model:make_model",
            "dataset_factory": "raytrain_guard.experiment.model:make_dataset",
            "optimizer_factory": "raytrain_guard.experiment.model:make_optimizer",
            "loss_fn": "raytrain_guard.experiment.model:loss_fn"}


def _worker(rank: int, out: str, rounds: int, steps: int) -> None:
    from raytrain_guard.coordination.context import WorkerContext
    from raytrain_guard.runtime.loop.train_loop import (
        DirectoryReporter,
        GuardedTrainLoop,
        LoopConfig,
    )

    medians: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(rounds):
        for name in (("on", "off") if i % 2 == 0 else ("off", "on")):
            d = os.path.join(out, f"{name}{i}")
            os.makedirs(d, exist_ok=True)
            config = LoopConfig.from_dict({
                **BUILT_IN, "strategy": "fsdp-full", "micro_batch": 8, "grad_accum": 2,
                "max_steps": steps, "num_workers": 0, "measure_bandwidth": False,
                "checkpoint_every_steps": 10_000, "device_memory_bytes": 1 << 30,
                "rehearsal": "raytrain_guard.experiment.rehearsal:build_rehearsal",
                "split_spikes": name == "on", "trace_dir": d})
            GuardedTrainLoop(config, reporter=DirectoryReporter(d),
                             context=WorkerContext(world_rank=rank, world_size=2)).run()
            with open(os.path.join(d, f"rank{rank}.jsonl")) as fh:
                totals = [r["total_s"] for r in map(json.loads, fh) if r.get("t") == "step"]
            medians[name].append(statistics.median(totals[5:]))
    if rank == 0:
        with open(os.path.join(out, "medians.json"), "w") as fh:
            json.dump(medians, fh)


def main() -> None:
    from gloo_world import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="rtg-split-agreement-")
    spawn(_worker, 2, out, args.rounds, args.steps)
    with open(os.path.join(out, "medians.json")) as fh:
        medians = json.load(fh)
    on, off = statistics.median(medians["on"]), statistics.median(medians["off"])
    print(f"FSDP2 step, 2 micro-batches, median over {args.rounds} rounds: agreement on "
          f"{1e3 * on:.2f} ms, off {1e3 * off:.2f} ms; on/off {on / off:.3f} "
          f"(+{1e6 * (on - off) / 2:.0f} us a micro-batch)")


if __name__ == "__main__":
    main()
