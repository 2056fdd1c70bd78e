"""An ordinary Ray Train loop, guarded by adding a few lines (marked ``# guard``).

    python examples/own_loop.py

The loop keeps its own structure; it borrows the guard's pieces one by one: the guarded
DataLoader (sharded, sized to the host budget, resumable), the planned DDP (bucket cap from the
measured bandwidth curve), and the step guard (timings, memory watermark, slow steps).
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ray  # noqa: E402
import ray.train  # noqa: E402
import torch  # noqa: E402
from ray import cloudpickle  # noqa: E402
from ray.train import RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

import toy  # noqa: E402


def train_func(config: dict) -> None:
    from raytrain_guard import Action, GuardConfig                                   # guard
    from raytrain_guard.planner.buckets import recommend_bucket_cap                     # guard
    from raytrain_guard.runtime.dist.bandwidth import measure_allreduce_curve             # guard
    from raytrain_guard.runtime.data.loader import GuardedDataLoader                      # guard
    from raytrain_guard.runtime.dist.model import wrap_model                              # guard
    from raytrain_guard.runtime.guard.comm_timers import attach_comm_timer                 # guard
    from raytrain_guard.runtime.guard.probes import ProcessMemoryProbe                     # guard
    from raytrain_guard.runtime.guard.step_guard import StepGuard                          # guard

    ctx = ray.train.get_context()
    guard_config = GuardConfig()                                                     # guard
    torch.manual_seed(0)
    model = toy.make_model()
    loader = GuardedDataLoader(toy.make_dataset(256), batch_size=16, seed=0,         # guard
                               config=guard_config, num_workers=0)                   # guard
    curve = measure_allreduce_curve()                                                # guard
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())       # guard
    plan = recommend_bucket_cap(grad_bytes=grad_bytes, config=guard_config,          # guard
                                bandwidth_curve=curve.as_pairs())                    # guard
    planned = wrap_model(model, strategy="ddp", bucket_cap_mb=plan.bucket_cap_mb)    # guard
    model = planned.module                               # instead of prepare_model(model)
    optimizer = toy.make_optimizer(model.parameters())
    guard = StepGuard(guard_config, probe=ProcessMemoryProbe(guard_config),          # guard
                      world_rank=ctx.get_world_rank())                               # guard
    attach_comm_timer(model, guard.timer)                                            # guard
    guard.attach_loader(loader)    # the loader opens each step and times its data   # guard

    step = 0
    for epoch in range(config["epochs"]):
        loader.set_epoch(epoch)
        for batch in loader:
            loss = toy.loss_fn(model, batch)
            guard.mark("forward")                                                    # guard
            loss.backward()
            guard.mark("backward")                                                   # guard
            optimizer.step()             # the guard times it: backward mark to end_step
            optimizer.zero_grad()
            for decision in guard.end_step(step):                                    # guard
                if decision.action is Action.CHECKPOINT_AND_STOP:                    # guard
                    print(f"rank {ctx.get_world_rank()}: {decision}")  # checkpoint + stop here
            step += 1
        # report once per epoch (a barrier): never every step
        ray.train.report({"epoch": epoch, "loss": float(loss.detach()), "step": step,
                          "bucket_cap_mb": plan.bucket_cap_mb,
                          "knee_bytes": curve.knee_bytes(guard_config.bandwidth_peak_frac)})
    loader.close()


def main() -> int:
    cloudpickle.register_pickle_by_value(toy)
    ray.init(address="local", num_cpus=4, include_dashboard=False)
    try:
        result = TorchTrainer(
            train_func, train_loop_config={"epochs": 2},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name="own_loop", storage_path=tempfile.mkdtemp(prefix="rtg-")),
        ).fit()
    finally:
        ray.shutdown()
    print("done: error" if result.error else "done: trained 2 epochs with the guard")
    return 0


if __name__ == "__main__":
    sys.exit(main())
