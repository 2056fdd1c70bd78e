"""The allreduce bandwidth curve: pure arithmetic (tables) and a real 2-rank gloo measurement."""

from __future__ import annotations

import json
import os

import pytest
from gloo_world import spawn

from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import InputError
from raytrain_guard.planner.buckets import recommend_bucket_cap
from raytrain_guard.runtime.dist.bandwidth import (
    CPU_SIZES_BYTES,
    BandwidthCurve,
    bus_bytes_per_s,
    measure_allreduce_curve,
)
from raytrain_guard.units import KiB, MiB

WORLD = 2


@pytest.mark.parametrize("size,time_s,world,expected", [
    # 2 (n - 1) / n x size / time
    (1_000_000, 0.001, 2, 1e9),          # 2 x 1/2 x 1e6 / 1e-3 = 1e9
    (1_000_000, 0.001, 4, 1.5e9),        # 2 x 3/4 x 1e9 = 1.5e9
    (1_000_000, 0.001, 8, 1.75e9),       # 2 x 7/8 x 1e9 = 1.75e9
    (1_000_000, 0.002, 1, 5e8),          # one rank: plain size / time
])
def test_bus_bandwidth(size, time_s, world, expected):
    assert bus_bytes_per_s(size, time_s, world) == pytest.approx(expected)


# Times chosen so bus bandwidth (world 2: size / time) is 1.2, 4, 8.5, 9.5, 10 GB/s.
CURVE_SIZES = [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB]
CURVE_GBPS = [1.2, 4.0, 8.5, 9.5, 10.0]
CURVE_TIMES = [s / (g * 1e9) for s, g in zip(CURVE_SIZES, CURVE_GBPS)]


@pytest.mark.parametrize("peak_frac,knee,saturated", [
    (0.8, 1 * MiB, True),        # 8.5 >= 0.8 x 10 = 8, 4 < 8
    (0.9, 4 * MiB, True),        # 9.5 >= 9, 8.5 < 9
    (0.96, 16 * MiB, False),     # only the largest reaches 9.6: curve still rising
    (0.1, 64 * KiB, True),       # 1.2 >= 1
])
def test_knee(peak_frac, knee, saturated):
    curve = BandwidthCurve.from_times(CURVE_SIZES, CURVE_TIMES, world_size=2, backend="gloo")
    assert curve.peak_bus_bytes_per_s == pytest.approx(10e9)
    assert curve.knee_bytes(peak_frac) == knee
    assert curve.saturated(peak_frac) is saturated


def test_unsorted_input_is_sorted():
    curve = BandwidthCurve.from_times(CURVE_SIZES[::-1], CURVE_TIMES[::-1], world_size=2)
    assert [p.size_bytes for p in curve.points] == CURVE_SIZES
    assert curve.to_dict(0.8)["knee_bytes"] == 1 * MiB
    assert "80% of peak reached at 1.0 MiB" in curve.describe(0.8)


def test_feeds_the_bucket_recommendation():
    # 64 MiB of gradients / 8 = 8 MiB overlap target; the knee (1 MiB at 0.8) is below it, so
    # the target stands: 8 MiB. With peak_frac 0.96 the efficient message is 16 MiB: raised.
    curve = BandwidthCurve.from_times(CURVE_SIZES, CURVE_TIMES, world_size=2)
    plan = recommend_bucket_cap(grad_bytes=64 * MiB, config=GuardConfig(),
                                bandwidth_curve=curve.as_pairs())
    assert plan.bucket_cap_mb == 8.0
    assert plan.inputs["efficient_message_bytes"] == 1 * MiB
    plan = recommend_bucket_cap(grad_bytes=64 * MiB,
                                config=GuardConfig(bandwidth_peak_frac=0.96),
                                bandwidth_curve=curve.as_pairs())
    assert plan.bucket_cap_mb == 16.0


@pytest.mark.parametrize("sizes,times,field", [
    ([], [], "sizes_bytes"), ([1, 2], [0.1], "sizes_bytes"),
])
def test_bad_curve_input(sizes, times, field):
    with pytest.raises(InputError, match=field):
        BandwidthCurve.from_times(sizes, times, world_size=2)


def test_bad_peak_frac():
    curve = BandwidthCurve.from_times(CURVE_SIZES, CURVE_TIMES, world_size=2)
    with pytest.raises(InputError, match="peak_frac: must be in"):
        curve.knee_bytes(0.0)


def test_measure_needs_a_process_group():
    with pytest.raises(InputError, match="torch.distributed is not initialized"):
        measure_allreduce_curve()


def _worker(rank: int, out_dir: str) -> None:
    curve = measure_allreduce_curve()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(curve.to_dict(0.8), fh)


def test_real_gloo_curve(tmp_path):
    spawn(_worker, WORLD, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r in ranks:
        assert r["sizes_bytes"] == list(CPU_SIZES_BYTES)
        assert r["backend"] == "gloo" and r["world_size"] == WORLD
        assert all(t > 0 for t in r["times_s"])
        assert r["knee_bytes"] in CPU_SIZES_BYTES
    # max over ranks: both ranks hold the very same times
    assert ranks[0]["times_s"] == ranks[1]["times_s"]
    # larger messages move more bytes per second than the smallest one on any real link
    assert max(ranks[0]["bus_gbps"]) > ranks[0]["bus_gbps"][0]
