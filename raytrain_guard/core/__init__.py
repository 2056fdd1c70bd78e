"""The pure core: the rules that turn measurements into decisions (the step gate, the
coordinator's policy, straggler scores, hang verdicts, priced effects).

Nothing under ``raytrain_guard.core`` imports ray, torch, pynvml or psutil; it takes numbers
and returns values. ``tests/test_core_purity.py`` proves it by importing the core with those
modules blocked.
"""
