"""Giving cached memory back: what a RELEASE_CACHE decision does on a rank."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import sys
from typing import Any


def release_cache() -> str:
    """Give cached memory back: ``torch.cuda.empty_cache()`` where CUDA is initialised, else
    ``gc.collect()`` and glibc's ``malloc_trim(0)`` where available. Returns what it did."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        return "torch.cuda.empty_cache"
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
        return "gc.collect + malloc_trim"
    return "gc.collect"


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None (another libc)."""
    name = ctypes.util.find_library("c")
    if name:
        with contextlib.suppress(OSError, AttributeError):
            return ctypes.CDLL(name).malloc_trim
    return None
