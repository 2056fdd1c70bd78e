"""The before/after experiment: the same training with the guard observing and acting, under
the same injected faults (``raytrain-guard experiment``; :func:`runner.run_experiment`), and
what exists only for it: the fault specs and their injection, the simulated card, the
device-time model, the demo.

Import-light: importing this package imports neither ray nor torch.
"""
