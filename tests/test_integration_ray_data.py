"""Ray Data in a guarded Ray Train loop: ``raytrain_guard.train.iter_torch_batches`` on the
worker's shard (examples/ray_data.py's loop, 2 gloo workers on CPU).

* The prefetch rules' figures (pure): a given depth kept or lowered to the host budget, the
  depth doubled after an epoch that waited for data, within the budget and a cap.
* A pipeline whose ``map_batches`` turns slow for the last third of the rows: the guard's
  gate names the slow steps' cause ``data`` (the rank that waits less for its batches waits in
  the allreduce instead), the data wait dominates on both ranks, and the depth is raised
  between epochs, never past the budget.
"""

from __future__ import annotations

import sys
import tempfile

import pytest

ray = pytest.importorskip("ray")

from examples import ray_data
from examples.ray_data import make_dataset, train_func
from raytrain_guard.config import GuardConfig
from raytrain_guard.runtime.data.ray_batches import fit_prefetch, next_prefetch, raise_paid

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


@pytest.mark.parametrize("depth, wait, batch, budget, cap, raise_at, expect", [
    (1, 0.5, MiB, 100 * MiB, None, None, 2),       # waited 50 % > 10 % (the default): doubled
    (2, 0.05, MiB, 100 * MiB, None, None, 2),      # 5 %: kept
    (2, 0.12, MiB, 100 * MiB, None, None, 4),      # 12 % > 10 %: doubled
    (2, 0.12, MiB, 100 * MiB, None, 0.2, 2),       # ray_data_raise_wait_frac 0.2: kept
    (2, 0.5, MiB, 100 * MiB, None, 1.0, 2),        # 1: never raised
    (4, 0.5, MiB, 100 * MiB, None, None, 8),       # doubled to max_prefetch_factor 8
    (8, 0.5, MiB, 100 * MiB, None, None, 8),       # not past it
    (2, 0.5, 30 * MiB, 100 * MiB, None, None, 3),  # budget: 100 // 30 = 3
    (2, 0.5, MiB, 100 * MiB, 3, None, 3),          # a SET_PREFETCH cap
])
def test_depth_rises_after_an_epoch_that_waited(depth, wait, batch, budget, cap, raise_at,
                                                expect):
    config = GuardConfig() if raise_at is None else GuardConfig(ray_data_raise_wait_frac=raise_at)
    assert next_prefetch(depth, wait, batch, budget, config, cap) == expect


@pytest.mark.parametrize("before, after, paid", [
    (0.18, 0.139, True),     # line 10 %: half the way down from 18 % is 14 %
    (0.18, 0.145, False),
    (0.18, 0.17, False),     # a deeper queue bought nothing
    (0.50, 0.02, True),
])
def test_a_raise_pays_when_the_wait_falls_half_way_to_the_line(before, after, paid):
    assert raise_paid(before, after, GuardConfig()) is paid


class DepthShard:
    """Four batches an epoch on a fake clock; each waits 1 s at depth 1, and at depth d 1/d^2 s
    (a bursty stage a deeper queue smooths) or 1 s whatever the depth (a stage slower than the
    step, which no queue helps)."""

    def __init__(self, clock, bursty):
        self.clock, self.bursty = clock, bursty

    def iter_torch_batches(self, prefetch_batches, **kwargs):
        import torch
        for _ in range(4):
            self.clock[0] += 1 / prefetch_batches ** 2 if self.bursty else 1.0
            yield {"x": torch.zeros(64, 32)}


@pytest.mark.parametrize("bursty, depths", [
    (True, [1, 2, 4, 4]),     # 50 % -> 20 % (paid, still over 10 %) -> 5.9 % (paid): kept
    (False, [1, 2, 1, 1]),    # 50 % at 1 and at 2: back to 1, never raised again
])
def test_a_deeper_queue_is_kept_only_where_it_lowered_the_wait(bursty, depths):
    from raytrain_guard.runtime.data.ray_batches import GuardedBatches

    clock = [0.0]
    batches = GuardedBatches(DepthShard(clock, bursty), config=GuardConfig(),
                             host_memory_bytes=16 * 2**30, gpus_per_node=1,
                             clock=lambda: clock[0])
    for _ in depths:
        for _batch in batches:
            clock[0] += 1.0                  # the step's compute
    assert [e["prefetch_batches"] for e in batches.history] == depths


class ListShard:
    """Four batches an epoch, as a shard's ``iter_torch_batches`` yields them."""

    def iter_torch_batches(self, prefetch_batches, **kwargs):
        import torch
        return iter([{"x": torch.zeros(64, 32)}] * 4)


def test_the_summary_prints_ray_datas_prefetch_not_a_dataloaders():
    from raytrain_guard.cluster.summary import loader_settings
    from raytrain_guard.runtime.data.ray_batches import GuardedBatches

    ticks = iter(range(10**6))       # every clock read 1 s later: half of each step is waiting
    batches = GuardedBatches(ListShard(), config=GuardConfig(), host_memory_bytes=16 * 2**30,
                             gpus_per_node=1, clock=lambda: float(next(ticks)), batch_size=64,
                             prefetch_batches=2)
    for _ in range(2):
        list(batches)
    # 64 x 32 float32 = 8 KiB a batch; budget 5 % of 16 GiB = 819.2 MiB; 2 -> 4, and back to 2
    # as 4 waited as much (raise_paid)
    assert loader_settings(batches.settings()) == (
        "Ray Data prefetch_batches 2 (epochs ran at 2, 4), batch 8.0 KiB, host budget 819.2 MiB")
    assert loader_settings({"num_workers": 2, "prefetch_factor": 4,
                            "persistent_workers": True}) == \
        "num_workers 2 prefetch_factor 4 persistent_workers True"


def test_slow_pipeline_is_named_data_and_prefetch_rises(ray_instance):
    from ray import cloudpickle
    from ray.train import RunConfig, ScalingConfig

    from raytrain_guard.train import TorchTrainer

    cloudpickle.register_pickle_by_value(ray_data)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    result = TorchTrainer(
        train_func, train_loop_config={"epochs": 2, "batch_size": 64},
        # 24 fast batches, then 12 that each take 0.5 s more in the one map task: a rank's
        # step waits 1 s for its batch, against 0.05 s on a quiet box and 0.4 s on a busy one
        # (Ray Data's own per-batch work; 0.15 s more drowned in that)
        datasets={"train": make_dataset(2304, slow_from=1536, delay_s=0.5)},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="ray_data_guarded",
                             storage_path=tempfile.mkdtemp(prefix="rtg-data-")),
        guard={"namespace": RAY_NAMESPACE, "decision_interval_s": 1e9}).fit()
    report = result.guard
    print(report.format())
    assert result.error is None, result.error
    assert "Ray Data prefetch_batches" in report.format()
    assert "prefetch_factor None" not in report.format()
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
