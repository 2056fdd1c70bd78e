"""Sizes and counts as users write them."""

import re

import pytest

from raytrain_guard.errors import InputError
from raytrain_guard.units import GiB, MiB, TiB, format_bytes, parse_bytes, parse_count


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


@pytest.mark.parametrize("text, words", [
    ("-7B", "must be a positive count (got '-7B')"),
    ("1e40", "above 1e+15"),
])
def test_parse_count_refuses_negative_and_absurd(text, words):
    with pytest.raises(InputError, match=r"params: " + re.escape(words)):
        parse_count(text, field="params", at_most=1e15)


def test_parse_count_bound_is_inclusive():
    assert parse_count("1000T", field="params", at_most=1e15) == 10**15


@pytest.mark.parametrize("text, words", [
    ("80", "no unit, so 80 bytes (got '80'); write a unit, e.g. 80GiB"),
    ("0.5", "no unit"),
    ("-80GiB", "must be a positive size"),
    ("2048TiB", "above 1024.0 TiB"),
])
def test_parse_bytes_refuses_implausible_sizes(text, words):
    with pytest.raises(InputError, match=r"gpu_mem: " + re.escape(words)):
        parse_bytes(text, field="gpu_mem", unitless_min_bytes=MiB, at_most=1024 * TiB)


@pytest.mark.parametrize("text, expected", [
    ("80B", 80), ("1048576", MiB), ("80GiB", 80 * GiB), ("1024TiB", 1024 * TiB),
])
def test_parse_bytes_with_a_unit_or_large_stays_allowed(text, expected):
    assert parse_bytes(text, field="gpu_mem", unitless_min_bytes=MiB,
                       at_most=1024 * TiB) == expected
