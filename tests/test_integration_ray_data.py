"""Ray Data in a guarded Ray Train loop: ``raytrain_guard.train.iter_torch_batches`` on the
worker's shard (examples/ray_data.py's loop, 2 gloo workers on CPU).

* The prefetch rules' figures (pure): a given depth kept or lowered to the host budget, the
  depth doubled after an epoch that waited for data, within the budget and a cap.
* A pipeline whose ``map_batches`` turns slow for the second half of the rows: the guard's
  gate names the slow steps' cause ``data`` on both ranks, the data wait dominates, and the
  depth is raised between epochs, never past the budget.
"""

from __future__ import annotations

import sys
import tempfile

import pytest

ray = pytest.importorskip("ray")

from examples import ray_data
from examples.ray_data import make_dataset, train_func
from raytrain_guard.config import GuardConfig
from raytrain_guard.runtime.data.ray_batches import (
    RAISE_AT_DATA_WAIT_FRAC,
    fit_prefetch,
    next_prefetch,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

RAY_NAMESPACE = "rtg_test_ray_data"
RAY_NUM_CPUS = 4
MiB = 2**20


@pytest.mark.parametrize("given, batch, budget, expect, warned", [
    (4, 10 * MiB, 100 * MiB, 4, False),      # 4 x 10 MiB = 40 MiB within 100 MiB: kept
    (16, 10 * MiB, 100 * MiB, 10, True),     # 160 MiB over: 100 // 10 = 10
    (2, 200 * MiB, 100 * MiB, 1, True),      # one batch over the budget: 1, the least
])
def test_given_prefetch_is_kept_or_lowered(given, batch, budget, expect, warned):
    depth, warning = fit_prefetch(given, batch, budget, GuardConfig())
    assert depth == expect and (warning is not None) == warned
    if warned:
        assert "host_prefetch_frac 5% of host RAM per GPU" in warning


@pytest.mark.parametrize("depth, wait, batch, budget, cap, expect", [
    (1, 0.5, MiB, 100 * MiB, None, 2),       # waited 50 % > 10 %: doubled
    (2, 0.05, MiB, 100 * MiB, None, 2),      # 5 %: kept
    (4, 0.5, MiB, 100 * MiB, None, 8),       # doubled to max_prefetch_factor 8
    (8, 0.5, MiB, 100 * MiB, None, 8),       # not past it
    (2, 0.5, 30 * MiB, 100 * MiB, None, 3),  # budget: 100 // 30 = 3
    (2, 0.5, MiB, 100 * MiB, 3, 3),          # a SET_PREFETCH cap
])
def test_depth_rises_after_an_epoch_that_waited(depth, wait, batch, budget, cap, expect):
    assert next_prefetch(depth, wait, batch, budget, GuardConfig(), cap) == expect
    assert RAISE_AT_DATA_WAIT_FRAC == 0.10


def test_slow_pipeline_is_named_data_and_prefetch_rises(ray_instance):
    from ray import cloudpickle
    from ray.train import RunConfig, ScalingConfig

    from raytrain_guard.train import TorchTrainer

    cloudpickle.register_pickle_by_value(ray_data)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    result = TorchTrainer(
        train_func, train_loop_config={"epochs": 2, "batch_size": 64},
        # 24 fast batches, then 24 that each take 0.15 s in the one map task
        datasets={"train": make_dataset(3072, slow_from=1536, delay_s=0.15)},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="ray_data_guarded",
                             storage_path=tempfile.mkdtemp(prefix="rtg-data-")),
        guard={"namespace": RAY_NAMESPACE, "decision_interval_s": 1e9}).fit()
    report = result.guard
    print(report.format())
    assert result.error is None, result.error
    # the slow steps are named data (the rank that waits less waits in the allreduce instead)
    slow = [d for rank in report.ranks for d in rank["decisions"] if d["action"] == "slow_step"]
    print([(d["world_rank"], d["cause"], d["applied_at"]) for d in slow])
    assert slow and {d["cause"] for d in slow} == {"data"}, slow
    for rank in report.ranks:
        loader = rank["loader"]
        print(loader["epochs"], loader["budget_bytes"], loader["batch_bytes"])
        assert loader["data_wait_frac"] > 0.3
        depths = [e["prefetch_batches"] for e in loader["epochs"]]
        assert depths[0] == 1 and depths[-1] > 1, depths       # raised between epochs
        assert all(d * loader["batch_bytes"] <= loader["budget_bytes"] for d in depths)
