"""Sizes and counts as users write them."""

import pytest

from raytrain_guard.errors import InputError
from raytrain_guard.units import GiB, MiB, format_bytes, parse_bytes, parse_count


@pytest.mark.parametrize("text, expected", [
    ("80GiB", 80 * GiB), ("80 GiB", 80 * GiB), ("80GB", 80 * 10**9), ("512MiB", 512 * MiB),
    ("1.5e9", 1_500_000_000), ("1024", 1024), (2048, 2048), ("0.5GiB", GiB // 2),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "80XB", "-1GiB", "0", "GiB", "1e999GiB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(InputError, match="gpu_mem"):
        parse_bytes(text, field="gpu_mem")


@pytest.mark.parametrize("text, expected", [
    ("7.5B", 7_500_000_000), ("7.5e9", 7_500_000_000), ("70b", 70_000_000_000),
    ("125M", 125_000_000), ("3", 3), (42, 42), ("1.2K", 1200),
])
def test_parse_count(text, expected):
    assert parse_count(text) == expected


@pytest.mark.parametrize("text", ["", "seven", "-3", "0", "7.5X", "0.2"])
def test_parse_count_rejects(text):
    with pytest.raises(InputError, match="params"):
        parse_count(text, field="params")


def test_format_bytes():
    assert format_bytes(3 * GiB) == "3.0 GiB"
    assert format_bytes(1536 * MiB) == "1.5 GiB"
    assert format_bytes(100) == "100 B"
