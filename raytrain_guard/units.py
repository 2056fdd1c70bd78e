"""Parsing and formatting of byte sizes and counts (pure: standard library only)."""

from __future__ import annotations

import math
import re

from raytrain_guard.errors import InputError

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
}
_COUNT_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_NUMBER = r"([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"   # a sign: "not positive", not "not a size"


def parse_bytes(text: str | int | float, *, field: str = "size",
                unitless_min_bytes: int | None = None, at_most: int | None = None) -> int:
    """``"80GiB"`` -> 85899345920. Decimal (GB) and binary (GiB) units; a bare number is bytes.

    ``unitless_min_bytes``: a number written without a unit below it is refused (``80`` meant
    80 GiB, not 80 bytes); with a unit (``80B``) any positive size passes. ``at_most``: sizes
    above it are refused (``1e40``).
    """
    value, unit = _number_and_unit(
        text, _BYTE_UNITS, field, "size",
        "write a number with an optional unit, e.g. 80GiB, 512MiB, 1.5e9")
    result = value * _BYTE_UNITS[unit]
    if not math.isfinite(result) or result <= 0:
        raise InputError(field, "must be a positive size", value=text, fix="e.g. 80GiB")
    if unitless_min_bytes is not None and unit == "" and result < unitless_min_bytes:
        raise InputError(field, f"no unit, so {value:g} bytes", value=text,
                         fix=f"write a unit, e.g. {value:g}GiB or {value:g}MiB ({value:g}B if "
                             f"you mean bytes)")
    if at_most is not None and result > at_most:
        raise InputError(field, f"above {format_bytes(at_most)}, more than any machine has",
                         value=text, fix="check the unit, e.g. 80GiB")
    return int(result)


def parse_count(text: str | int | float, *, field: str = "count",
                at_most: float | None = None) -> int:
    """``"7.5B"`` and ``"7.5e9"`` -> 7500000000. Suffixes K, M, B (or G) and T; counts above
    ``at_most`` are refused."""
    value, suffix = _number_and_unit(
        text, _COUNT_SUFFIX, field, "count",
        "write a number with an optional K/M/B/T suffix, e.g. 7.5B or 7.5e9")
    result = value * _COUNT_SUFFIX[suffix]
    if not math.isfinite(result) or result < 1:
        raise InputError(field, "must be a positive count", value=text, fix="e.g. 7B")
    if at_most is not None and result > at_most:
        raise InputError(field, f"above {at_most:.0e}, beyond any real count", value=text,
                         fix="check the suffix, e.g. 7B or 1.5T")
    return int(round(result))


def _number_and_unit(text, units, field: str, what: str, fix: str) -> tuple[float, str]:
    """``text`` as (number, its unit: a key of ``units``); a bare number has unit ""."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text), ""
    m = re.fullmatch(_NUMBER + r"\s*([A-Za-z]*)", str(text).strip())
    if not m or m.group(2).lower() not in units:
        raise InputError(field, f"not a {what}", value=text, fix=fix)
    return float(m.group(1)), m.group(2).lower()


def format_bytes(n: float) -> str:
    """Human bytes in binary units: ``format_bytes(3 * GiB) == "3.0 GiB"``."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.1f} {unit}"
    return f"{sign}{int(n)} B"
