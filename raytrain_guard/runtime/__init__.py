"""Adapters that run inside every training worker (torch, psutil and ray live here).

Import-light on purpose: this package imports nothing itself. Import the module you need,
e.g. ``from raytrain_guard.runtime.loader import GuardedDataLoader``; importing
``raytrain_guard.runtime`` alone pulls in neither torch nor ray.
"""
