"""DataLoader sizing: workers from cores per GPU, prefetch from 5 % of host RAM per GPU."""

import pytest

from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import InputError, PlanInputError
from raytrain_guard.planner.dataloader_sizing import DataLoaderPlan, size_dataloader
from raytrain_guard.units import GiB, MiB

C = GuardConfig()


@pytest.mark.parametrize("batch, host, gpus, cpus, pin, workers, prefetch, host_bytes, budget", [
    # 96 cores / 8 GPUs - 1 = 11 -> clamped to 8. Budget 0.05 x 512 GiB / 8 = 3435973836 B
    # (int of 3.2 GiB). Pinned 64 MiB batch costs 128 MiB; 8 x P x 128 MiB <= 3.2 GiB -> P = 3
    # (3 GiB = 3221225472 B; P = 4 would be 4 GiB).
    (64 * MiB, 512 * GiB, 8, 96, True, 8, 3, 8 * 3 * 128 * MiB, 3435973836),
    # Same, not pinned: 8 x P x 64 MiB <= 3.2 GiB -> P = 6 (3 GiB); P = 7 is 3.5 GiB.
    (64 * MiB, 512 * GiB, 8, 96, False, 8, 6, 8 * 6 * 64 * MiB, 3435973836),
    # 2 cores / 1 GPU - 1 = 1 -> clamped up to 2. Budget 0.05 x 24 GiB = 1288490188 B.
    # 2 x P x 64 MiB <= 1.2 GiB -> P = 9.6 -> capped at max_prefetch_factor 8 (1 GiB).
    (64 * MiB, 24 * GiB, 1, 2, False, 2, 8, 2 * 8 * 64 * MiB, 1288490188),
    # 32 cores / 4 GPUs - 1 = 7 workers. Budget 0.05 x 64 GiB / 4 = 858993459 B (0.8 GiB).
    # Pinned 100 MiB batch costs 200 MiB; 7 x 1 x 200 MiB = 1400 MiB > 819.2 MiB, so fewer
    # workers: 819.2 // 200 = 4 workers, prefetch 1, 800 MiB.
    (100 * MiB, 64 * GiB, 4, 32, True, 4, 1, 4 * 200 * MiB, 858993459),
    # One batch exactly fills the budget: 1 worker, prefetch 1.
    (1000, 20000, 1, 16, False, 1, 1, 1000, 1000),
])
def test_sizing_table(batch, host, gpus, cpus, pin, workers, prefetch, host_bytes, budget):
    plan = size_dataloader(batch_bytes=batch, host_memory_bytes=host, gpus_per_node=gpus,
                           cpus_per_node=cpus, pin_memory=pin, config=C)
    assert (plan.num_workers, plan.prefetch_factor, plan.host_bytes, plan.budget_bytes) == (
        workers, prefetch, host_bytes, budget)
    assert plan.host_bytes <= plan.budget_bytes
    assert isinstance(plan, DataLoaderPlan) and plan.reason


def test_prefetch_is_the_largest_that_fits():
    # Property check over a grid: P fits, and P + 1 either breaks the budget or the max.
    for batch in (1 * MiB, 7 * MiB, 33 * MiB, 129 * MiB):
        for cpus in (4, 16, 64, 128):
            plan = size_dataloader(batch_bytes=batch, host_memory_bytes=256 * GiB,
                                   gpus_per_node=4, cpus_per_node=cpus, pin_memory=True,
                                   config=C)
            cost = plan.num_workers * batch * 2
            assert plan.prefetch_factor * cost <= plan.budget_bytes
            assert (plan.prefetch_factor == C.max_prefetch_factor
                    or (plan.prefetch_factor + 1) * cost > plan.budget_bytes)


def test_fewer_workers_is_warned():
    plan = size_dataloader(batch_bytes=100 * MiB, host_memory_bytes=64 * GiB, gpus_per_node=4,
                           cpus_per_node=32, pin_memory=True, config=C)
    assert any("num_workers lowered from 7 to 4" in w for w in plan.warnings)


def test_config_clamps_are_used():
    # 64 cores / 2 GPUs - 1 = 31 -> clamped to max 4; 2 / 1 - 1 = 1 -> raised to min 3.
    cfg = GuardConfig(min_workers_per_gpu=3, max_workers_per_gpu=4)
    big = size_dataloader(batch_bytes=MiB, host_memory_bytes=64 * GiB, gpus_per_node=2,
                          cpus_per_node=64, pin_memory=False, config=cfg)
    small = size_dataloader(batch_bytes=MiB, host_memory_bytes=64 * GiB, gpus_per_node=1,
                            cpus_per_node=2, pin_memory=False, config=cfg)
    assert (big.num_workers, small.num_workers) == (4, 3)
    assert any("only 2 cores per GPU" in w for w in small.warnings)


def test_zero_workers_loads_in_process():
    cfg = GuardConfig(min_workers_per_gpu=0, max_workers_per_gpu=4)
    plan = size_dataloader(batch_bytes=MiB, host_memory_bytes=64 * GiB, gpus_per_node=8,
                           cpus_per_node=8, pin_memory=True, config=cfg)
    assert (plan.num_workers, plan.prefetch_factor, plan.host_bytes) == (0, 0, 2 * MiB)


def test_list_backed_dataset_warns():
    plan = size_dataloader(batch_bytes=MiB, host_memory_bytes=64 * GiB, gpus_per_node=1,
                           cpus_per_node=16, pin_memory=False, config=C,
                           list_backed_dataset=True)
    assert any("Python lists" in w and "copy-on-read" in w for w in plan.warnings)
    clean = size_dataloader(batch_bytes=MiB, host_memory_bytes=64 * GiB, gpus_per_node=1,
                            cpus_per_node=16, pin_memory=False, config=C)
    assert clean.warnings == ()


def test_batch_over_budget_names_both_and_the_fix():
    # Budget 0.05 x 16 GiB / 8 = 0.1 GiB = 102.4 MiB; a pinned 60 MiB batch costs 120 MiB.
    with pytest.raises(PlanInputError) as err:
        size_dataloader(batch_bytes=60 * MiB, host_memory_bytes=16 * GiB, gpus_per_node=8,
                        cpus_per_node=64, pin_memory=True, config=C)
    msg = str(err.value)
    assert err.value.field == "batch_bytes"
    assert "120.0 MiB" in msg and "102.4 MiB" in msg and "pin_memory=False" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("field, value", [
    ("batch_bytes", 0), ("host_memory_bytes", -1), ("gpus_per_node", 0), ("cpus_per_node", 1.5)])
def test_bad_counts(field, value):
    args = dict(batch_bytes=MiB, host_memory_bytes=GiB, gpus_per_node=1, cpus_per_node=4)
    args[field] = value
    with pytest.raises(InputError) as err:
        size_dataloader(pin_memory=False, config=C, **args)
    assert str(err.value).startswith(f"{field}: must be an integer >= 1 (got {value!r}); ")


@pytest.mark.parametrize("workers, prefetch, cap, want_workers, want_prefetch, warned", [
    # 2 cores / 1 GPU -> rule: 2 workers; budget 0.05 x 1 GiB = 53687091 B; batch 4 MiB.
    # rule: 53687091 // (2 x 4 MiB) = 6 -> prefetch 6
    (None, None, None, 2, 6, False),
    # 4 workers given: 53687091 // (4 x 4 MiB) = 3
    (4, None, None, 4, 3, False),
    # 16 workers given: 53687091 // (16 x 4 MiB) = 0 -> kept at 16 with prefetch 1, and
    # 16 x 1 x 4 MiB = 64 MiB > 51.2 MiB is warned
    (16, None, None, 16, 1, True),
    # prefetch given as 8: kept; 2 x 8 x 4 MiB = 64 MiB over the budget, warned
    (None, 8, None, 2, 8, True),
    # a cap lowers the rule's 6 to 2, and the given 8 to 3; a cap above the plan does nothing
    (None, None, 2, 2, 2, False),
    (None, 8, 3, 2, 3, False),
    (None, None, 7, 2, 6, False),
    # no workers: nothing to prefetch, a cap changes nothing
    (0, None, 2, 0, 0, False),
])
def test_given_workers_prefetch_and_cap(workers, prefetch, cap, want_workers, want_prefetch,
                                        warned):
    plan = size_dataloader(batch_bytes=4 * MiB, host_memory_bytes=GiB, gpus_per_node=1,
                           cpus_per_node=2, pin_memory=False, config=C, num_workers=workers,
                           prefetch_factor=prefetch, prefetch_cap=cap)
    assert (plan.num_workers, plan.prefetch_factor) == (want_workers, want_prefetch)
    assert plan.host_bytes == max(want_workers, 1) * max(want_prefetch, 1) * 4 * MiB
    assert any("exceed the host prefetch budget" in w for w in plan.warnings) == warned
    if cap is not None and want_workers and want_prefetch == cap:
        assert f"capped at {cap} by request" in plan.reason
