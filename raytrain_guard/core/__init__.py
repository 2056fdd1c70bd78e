"""The pure core: capacity math and decision policies.

Nothing under ``raytrain_guard.core`` imports ray, torch, pynvml or psutil; it takes numbers
and returns values. ``tests/test_core_purity.py`` proves it by importing the core with those
modules blocked.
"""
