"""The integrations' cost to throughput: each example trained with and without the guard.

    python benchmarks/integration_overhead.py [--pairs 3] [--only hf lightning ray_data]
                                              [--arms off on] [--out DIR]

For each example (examples/hf_trainer.py, examples/lightning_trainer.py, examples/ray_data.py)
the same training runs ``off`` (Ray's own ``ray.train.torch.TorchTrainer``, the guard's lines
left out: no ``GuardCallback``, Ray's ``prepare_model`` and ``shard.iter_torch_batches``) and
``on`` (the example as written: ``raytrain_guard.train.TorchTrainer`` and the guard's lines),
interleaved in one Ray instance: per pair and example one run of each, in ABBA order (pair 0
off then on, pair 1 on then off, ...) so that a drift of the box's load falls on both. A third
arm, ``local`` (``--arms off local on``), runs the guard's worker side under Ray's own
``TorchTrainer``: the callbacks, hooks, gate and lockstep without the node monitors, the
coordinator and its reports; ``local`` against ``off`` is what the worker pays in the step,
``on`` against ``local`` what the cluster layer adds. A fourth, ``idle``, is ``on`` with the
cluster layer's actors started but quiet (no reports, a monitor sample and a policy round a
minute: :data:`IDLE_GUARD`): ``idle`` against ``on`` is what that work costs the ranks on a box
with no spare core. ``--lightning-device-ms MS`` (``--hf-device-ms``, ``--ray-data-device-ms``)
gives the Lightning (Hugging Face, Ray Data) steps GPU-like time: the host waits MS a step in
forward and backward (the experiment's device-time model), as a host waits on a GPU's kernels,
so the ranks leave the CPU free as they would beside a GPU.

Throughput is measured inside the workers, over the training loop only (Ray's startup, the
worker group, the guard's actors, the allreduce curve ``prepare_model`` measures and the first
``--warmup`` steps are left out): steps per second from the end of the warm-up step to the end
of the last step (Ray Data: the batches of every epoch after the first, each epoch from its
first batch on, so the streaming split's start is left out), the mean of the ranks. Printed: each
pair's arm/off ratio per example, the box's load average at each run's start, and per example
the median ratio with its range and its 95 % bootstrap interval over the pairs
(:func:`raytrain_guard.experiment.stats.bootstrap_median`).
The goal is ``on`` at most 2 % slower (ratio >= 0.98); ``--device-ms MS`` gives all three
examples GPU-like steps of MS (100: the GPU step the guard's host budget is set against,
docs/benchmarks.md, "Guard overhead").
At the defaults, 18 runs: 8 minutes on the 2-core VM at a load of 2-5 (16 under a load of 7-39),
most of it Ray Train's start of each run (docs/benchmarks.md, "Integrations: the guard's
overhead").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray
import ray.train
import ray.train.torch
from ray import cloudpickle
from ray.train import RunConfig, ScalingConfig

from examples import hf_trainer, lightning_trainer
from examples import ray_data as ray_data_example
from raytrain_guard.experiment.stats import bootstrap_median

EXAMPLES = ("hf", "lightning", "ray_data")
IDLE_GUARD = {"report_every_steps": 10**6, "monitor_interval_s": 60.0, "decision_interval_s": 60.0}
NAMESPACE = "rtg_bench_integrations"


# -- what each worker runs ---------------------------------------------------------------------------

def _write(config: dict, rank: int, steps: int, seconds: float, **extra: Any) -> None:
    path = os.path.join(config["out"], f"{config['tag']}-{rank}.json")
    with open(path, "w") as f:
        json.dump({"steps": steps, "seconds": seconds,
                   "steps_per_s": steps / seconds if seconds > 0 else 0.0, **extra}, f)


def _wait_like_a_device(config: dict, module: Any) -> None:
    """With ``config["device_ms"]``, ``module``'s forward and backward wait that long a step
    (the experiment's device-time model); its output must carry a gradient."""
    if config["device_ms"]:
        from raytrain_guard.experiment.device_time import DeviceTime
        DeviceTime(config["device_ms"] / 1000).attach(module)


def hf_func(config: dict) -> None:
    """examples/hf_trainer.py's Trainer (no saves); ``off`` removes the guard's callback."""
    from transformers import TrainerCallback

    from raytrain_guard.integrations.transformers import GuardCallback

    marks: dict[str, Any] = {}

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == config["warmup"]:
                marks["start"] = time.perf_counter()
            marks["end"], marks["step"] = time.perf_counter(), state.global_step

    trainer = hf_trainer.build_trainer(config)
    if config["arm"] == "off":
        trainer.remove_callback(GuardCallback)
    trainer.add_callback(Clock())
    _wait_like_a_device(config, trainer.model.get_input_embeddings())
    trainer.train()
    _write(config, ray.train.get_context().get_world_rank(), marks["step"] - config["warmup"],
           marks["end"] - marks["start"])


def lightning_func(config: dict) -> None:
    """examples/lightning_trainer.py's Trainer (one epoch); ``off`` leaves out the guard's
    callback."""
    import lightning.pytorch as pl

    from raytrain_guard.integrations.lightning import GuardCallback

    marks: dict[str, Any] = {}

    class Clock(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == config["warmup"]:
                marks["start"] = time.perf_counter()
            marks["end"], marks["step"] = time.perf_counter(), trainer.global_step

    trainer = lightning_trainer.build_trainer(config)
    if config["arm"] == "off":
        trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, GuardCallback)]
    trainer.callbacks.append(Clock())
    model = lightning_trainer.Regressor(config["hidden"])
    _wait_like_a_device(config, model.net)
    trainer.fit(model, train_dataloaders=lightning_trainer.make_loader(config))
    _write(config, ray.train.get_context().get_world_rank(), marks["step"] - config["warmup"],
           marks["end"] - marks["start"])


def ray_data_func(config: dict) -> None:
    """examples/ray_data.py's loop; ``off`` with Ray's ``prepare_model`` and the shard's own
    ``iter_torch_batches``."""
    import torch

    import raytrain_guard.train as guarded

    torch.manual_seed(0)
    on = config["arm"] != "off"
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    _wait_like_a_device(config, net[0])
    shard = ray.train.get_dataset_shard("train")
    if on:
        model = guarded.prepare_model(net)
        opt = guarded.prepare_optimizer(torch.optim.AdamW(model.parameters()))
        batches = guarded.iter_torch_batches(shard, batch_size=config["batch_size"])
    else:
        model = ray.train.torch.prepare_model(net)
        opt = torch.optim.AdamW(model.parameters())
        batches = None
    steps, seconds = 0, 0.0
    for epoch in range(config["epochs"]):
        epoch_batches = batches if on else shard.iter_torch_batches(
            batch_size=config["batch_size"])
        first = last = None
        n = 0
        for batch in epoch_batches:
            if first is None:
                first = time.perf_counter()
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            loss.backward()
            opt.step()
            opt.zero_grad()
            n += 1
            last = time.perf_counter()
            if on and guarded.get_guard().should_stop():
                break
        if epoch > 0 and first is not None:
            steps, seconds = steps + n - 1, seconds + (last - first)
        ray.train.report({"epoch": epoch, "loss": loss.item()})
    depths = batches.settings()["epochs"] if on else []
    _write(config, ray.train.get_context().get_world_rank(), steps, seconds, epochs=depths)


# -- the driver ---------------------------------------------------------------------------------------

def run_once(example: str, arm: str, tag: str, out: str, storage: str,
             args: argparse.Namespace) -> dict[str, Any]:
    """One training run; returns its throughput (mean of the ranks) and the load at its start."""
    from raytrain_guard.train import TorchTrainer

    config: dict[str, Any] = {"arm": arm, "tag": tag, "out": out, "warmup": args.warmup}
    datasets = None
    if example == "hf":
        fn = hf_func
        config.update(output_dir=os.path.join(storage, tag), batch_size=8,
                      max_steps=args.hf_steps, samples=8 * 2 * args.hf_steps,
                      device_ms=args.hf_device_ms)
    elif example == "lightning":
        fn = lightning_func
        config.update(max_epochs=1, batch_size=16, samples=16 * 2 * args.lightning_steps,
                      hidden=args.lightning_hidden, device_ms=args.lightning_device_ms)
    else:
        fn = ray_data_func
        config.update(epochs=3, batch_size=64, device_ms=args.ray_data_device_ms)
        datasets = {"train": ray_data_example.make_dataset(args.ray_data_rows)}
    kwargs = {"train_loop_config": config, "scaling_config": ScalingConfig(num_workers=2),
              "run_config": RunConfig(name=tag, storage_path=storage), "datasets": datasets}
    load = os.getloadavg()[0]
    start = time.perf_counter()
    if arm in ("on", "idle"):
        guard = {"namespace": NAMESPACE, **(IDLE_GUARD if arm == "idle" else {})}
        result = TorchTrainer(fn, guard=guard, **kwargs).fit()
    else:
        result = ray.train.torch.TorchTrainer(fn, **kwargs).fit()
    if result.error is not None:
        raise RuntimeError(f"{tag}: {result.error!r}")
    ranks = []
    for rank in range(2):
        with open(os.path.join(out, f"{tag}-{rank}.json")) as f:
            ranks.append(json.load(f))
    return {"tag": tag, "example": example, "arm": arm, "pair": int(tag.rsplit("-", 1)[1]),
            "load": load,
            "wall_s": time.perf_counter() - start,
            "steps_per_s": statistics.fmean(r["steps_per_s"] for r in ranks),
            "steps": ranks[0]["steps"], "epochs": ranks[0].get("epochs")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--only", nargs="+", choices=EXAMPLES, default=list(EXAMPLES))
    parser.add_argument("--arms", nargs="+", choices=("off", "local", "on", "idle"),
                        default=["off", "on"], help="off first: the ratios are against it")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out at the start")
    parser.add_argument("--hf-steps", type=int, default=150)
    parser.add_argument("--lightning-steps", type=int, default=300)
    parser.add_argument("--lightning-hidden", type=int, default=256,
                        help="the Lightning model's width: 256 makes ~9 ms steps here, 1024 ~28 ms")
    parser.add_argument("--lightning-device-ms", type=float, default=0.0,
                        help="GPU-like steps: the host waits this long a step in forward and "
                        "backward, as on a GPU's kernels (raytrain_guard.experiment.device_time)"
                        "; 0: the CPU-bound steps")
    parser.add_argument("--hf-device-ms", type=float, default=0.0,
                        help="GPU-like Hugging Face steps, as --lightning-device-ms (the wait "
                        "hangs on the input embedding); 0: the CPU-bound steps")
    parser.add_argument("--ray-data-rows", type=int, default=4096)
    parser.add_argument("--ray-data-device-ms", type=float, default=0.0,
                        help="GPU-like Ray Data steps, as --lightning-device-ms (the wait hangs "
                        "on the first layer); 0: the CPU-bound steps")
    parser.add_argument("--device-ms", type=float, default=None,
                        help="GPU-like steps of this many ms in all three examples (sets "
                        "--hf-device-ms, --lightning-device-ms and --ray-data-device-ms)")
    parser.add_argument("--out", default=None, help="folder for the runs' JSON")
    args = parser.parse_args()
    if args.device_ms is not None:
        args.hf_device_ms = args.lightning_device_ms = args.ray_data_device_ms = args.device_ms

    for module in (hf_trainer, lightning_trainer, ray_data_example, sys.modules[__name__]):
        cloudpickle.register_pickle_by_value(module)
    out = args.out or tempfile.mkdtemp(prefix="rtg-bench-int-")
    os.makedirs(out, exist_ok=True)
    storage = tempfile.mkdtemp(prefix="rtg-bench-int-storage-")
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="warning",
             log_to_driver=False, namespace=NAMESPACE)
    runs: list[dict[str, Any]] = []
    begun = time.perf_counter()
    try:
        for pair in range(args.pairs):
            order = args.arms if pair % 2 == 0 else args.arms[::-1]
            for example in args.only:
                for arm in order:
                    tag = f"{example}-{arm}-{pair}"
                    run = run_once(example, arm, tag, out, storage, args)
                    runs.append(run)
                    print(f"{tag:18s} {run['steps_per_s']:8.2f} steps/s over {run['steps']} "
                          f"steps  load {run['load']:.2f}  wall {run['wall_s']:.0f} s"
                          + (f"  prefetch by epoch {run['epochs']}" if run["epochs"] else ""),
                          flush=True)
    finally:
        ray.shutdown()
    with open(os.path.join(out, "runs.json"), "w") as f:
        json.dump(runs, f, indent=1)
    print(f"\n{len(runs)} runs in {time.perf_counter() - begun:.0f} s; runs in {out}")
    print(f"\n| example | arm / off | {' | '.join(f'pair {p}' for p in range(args.pairs))} "
          "| median | range | 95 % interval |")
    print("|---|---|" + "---|" * (args.pairs + 3))
    for example in args.only:
        rate = {(r["arm"], r["pair"]): r["steps_per_s"] for r in runs if r["example"] == example}
        for arm in args.arms[1:]:
            ratios = [rate[arm, p] / rate[args.arms[0], p] for p in range(args.pairs)]
            cells = " | ".join(f"{r:.3f}" for r in ratios)
            interval = bootstrap_median(ratios)
            print(f"| {example} | {arm} / {args.arms[0]} | {cells} | "
                  f"**{interval.median:.3f}** | {min(ratios):.3f}-{max(ratios):.3f} | "
                  f"[{interval.low:.3f}, {interval.high:.3f}] |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
