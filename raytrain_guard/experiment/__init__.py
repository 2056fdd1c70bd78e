"""The before/after experiment: the same training with the guard observing and acting, under
the same injected faults (``raytrain-guard experiment``; :func:`runner.run_experiment`).

Import-light: importing this package imports neither ray nor torch.
"""
