"""Small statistics shared by the gate, the straggler scores and the cluster policy (pure)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def slope(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of ``y`` against ``x`` over ``(x, y)`` points (per unit of ``x``);
    0 with fewer than two points or when every ``x`` is the same.

    Example: ``[(0, 0.80), (1, 0.88), (2, 0.89)]`` -> mean x 1, mean y 0.8567; sum of
    (x - 1)(y - 0.8567) = 0.09, sum of (x - 1)^2 = 2 -> 0.045 per step.
    """
    n = len(points)
    if n < 2:
        return 0.0
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    if sxx == 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx


def nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of already sorted values: the value at
    1-based rank ``ceil(q x n)``. Example: q 0.99 of 20 values -> rank 20, the largest."""
    if not sorted_values:
        raise ValueError("nearest_rank of no values")
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def median_of_sorted(values: Sequence[float]) -> float:
    """The median of already sorted values (the mean of the middle two for an even count)."""
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


MAD_TO_SIGMA = 1.4826
"""Median absolute deviation -> standard deviation of a normal distribution (1 / 0.6745)."""


def robust_sigma(values: Sequence[float], median: float | None = None) -> float:
    """1.4826 x the median absolute deviation of ``values`` (around ``median`` when given):
    a spread that a few outliers do not move. 0 for no values.

    Example: [3, 4, 4, 5, 30] ms -> median 4, deviations [1, 0, 0, 1, 26] -> MAD 1 ms ->
    1.4826 ms (the standard deviation would be 11.4 ms, blown up by the one outlier).
    """
    if not values:
        return 0.0
    center = median_of_sorted(sorted(values)) if median is None else median
    return MAD_TO_SIGMA * median_of_sorted(sorted(abs(v - center) for v in values))
