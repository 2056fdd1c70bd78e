"""DDP bucket_cap_mb recommendation: overlap target, measured curve, clamps, memory bound."""

import pytest

from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import PlanInputError
from raytrain_guard.planner.buckets import (
    count_buckets,
    efficient_message_bytes,
    recommend_bucket_cap,
)
from raytrain_guard.units import GiB, MiB

C = GuardConfig()


@pytest.mark.parametrize("grad_bytes, params, cap_mb, num_buckets", [
    # 400 MiB / 8 buckets = 50 MiB exactly; 8 buckets.
    (400 * MiB, (), 50.0, 8),
    # 7B fp32 grads = 28e9 B / 8 = 3.5e9 B = 3337.9 MiB -> clamped to 256; ceil(28e9 / 256 MiB)
    # = ceil(104.3) = 105 buckets.
    (28_000_000_000, (), 256.0, 105),
    # 4 MiB / 8 = 0.5 MiB -> clamped up to min 1 MiB; 4 buckets.
    (4 * MiB, (), 1.0, 4),
    # 100 MiB / 8 = 12.5 MiB, but one parameter is 30 MiB (never split) -> cap 30 MiB.
    # DDP greedy over [30, 10 x 7]: [30] closes at 30; 10+10+10 = 30 closes; 10+10+10 closes;
    # 10 left open -> 4 buckets.
    (100 * MiB, (30 * MiB,) + (10 * MiB,) * 7, 30.0, 4),
    # 10 MiB / 8 = 1.25 MiB -> 1.25 (a multiple of 1/16). Params 5 x 2 MiB: each closes a
    # bucket alone (2 >= 1.25) -> 5 buckets.
    (10 * MiB, (2 * MiB,) * 5, 2.0, 5),
])
def test_without_curve(grad_bytes, params, cap_mb, num_buckets):
    plan = recommend_bucket_cap(grad_bytes=grad_bytes, config=C, param_bytes=params)
    assert (plan.bucket_cap_mb, plan.num_buckets) == (cap_mb, num_buckets)
    assert plan.inputs["grad_bytes"] == grad_bytes
    assert "buckets" in plan.reason


def test_largest_param_is_named_in_the_reason():
    # 10 MiB / 8 = 1.25 MiB; the largest parameter (2 MiB) lifts the cap to 2 MiB.
    plan = recommend_bucket_cap(grad_bytes=10 * MiB, config=C, param_bytes=(2 * MiB,) * 5)
    assert "largest parameter" in plan.reason


# Curve: 1 MiB in 1 ms (1.05 GB/s), 16 MiB in 4 ms (4.19 GB/s), 64 MiB in 14 ms (4.79 GB/s,
# the peak). 80 % of peak = 3.83 GB/s: 16 MiB is the smallest message reaching it.
CURVE = [(64 * MiB, 0.014), (1 * MiB, 0.001), (16 * MiB, 0.004)]


def test_efficient_message():
    size, peak = efficient_message_bytes(CURVE, 0.8)
    assert size == 16 * MiB
    assert peak == pytest.approx(64 * MiB / 0.014)
    # At 90 % of the peak (4.31 GB/s) only 64 MiB qualifies.
    assert efficient_message_bytes(CURVE, 0.9)[0] == 64 * MiB


@pytest.mark.parametrize("grad_bytes, cap_mb, raised", [
    # 80 MiB / 8 = 10 MiB < 16 MiB efficient -> raised to 16 MiB; 5 buckets.
    (80 * MiB, 16.0, True),
    # 800 MiB / 8 = 100 MiB >= 16 MiB -> overlap target kept; 8 buckets.
    (800 * MiB, 100.0, False),
])
def test_with_curve(grad_bytes, cap_mb, raised):
    plan = recommend_bucket_cap(grad_bytes=grad_bytes, config=C, bandwidth_curve=CURVE)
    assert plan.bucket_cap_mb == cap_mb
    assert plan.inputs["efficient_message_bytes"] == 16 * MiB
    assert ("raised to 16.0 MiB" in plan.reason) == raised
    assert "measured peak" in plan.reason


def test_curve_raise_is_still_clamped():
    cfg = GuardConfig(max_bucket_cap_mb=8.0)
    plan = recommend_bucket_cap(grad_bytes=80 * MiB, config=cfg, bandwidth_curve=CURVE)
    assert plan.bucket_cap_mb == 8.0


@pytest.mark.parametrize("slack, cap_mb", [
    # 400 MiB / 8 = 50 MiB target. Slack 60 MiB / 2 in flight = 30 MiB < 50 -> 30 MiB.
    (60 * MiB, 30.0),
    # Slack 1 GiB / 2 = 512 MiB >= 50 -> target kept.
    (1 * GiB, 50.0),
    # Slack 1000001 B / 2 = 500000.5 B = 0.4768 MiB -> rounded down to 7/16 = 0.4375 MiB
    # (memory wins over the 1 MiB minimum and over parameters).
    (1_000_001, 0.4375),
])
def test_memory_bound(slack, cap_mb):
    plan = recommend_bucket_cap(grad_bytes=400 * MiB, config=C, memory_slack_bytes=slack,
                                param_bytes=(4 * MiB,) * 100)
    assert plan.bucket_cap_mb == cap_mb
    assert plan.bucket_cap_mb * MiB * C.num_buckets_in_flight <= slack
    assert plan.inputs["memory_slack_bytes"] == slack


def test_no_room_at_all():
    with pytest.raises(PlanInputError, match="memory_slack_bytes"):
        recommend_bucket_cap(grad_bytes=400 * MiB, config=C, memory_slack_bytes=0)


@pytest.mark.parametrize("cap, params, expected", [
    (10, (), 1),                # no sizes: ceil(5 / 10) = 1
    (10, (4, 4, 4, 4), 2),      # 4+4+4 = 12 >= 10 closes; 4 left open -> 2
    (10, (10, 10), 2),          # each reaches the cap alone
    (10, (3, 3, 3), 1),         # 9 never reaches 10 -> one open bucket
])
def test_count_buckets_follows_ddp(cap, params, expected):
    assert count_buckets(cap, params, sum(params) or 5) == expected


@pytest.mark.parametrize("curve", [[], [(0, 1.0)], [(MiB, 0.0)], [("x",)]])
def test_bad_curve(curve):
    with pytest.raises(PlanInputError, match="bandwidth_curve"):
        recommend_bucket_cap(grad_bytes=MiB, config=C, bandwidth_curve=curve)


def test_bad_grad_bytes():
    with pytest.raises(PlanInputError, match="grad_bytes"):
        recommend_bucket_cap(grad_bytes=0, config=C)
