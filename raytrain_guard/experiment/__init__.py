"""The before/after experiment (``raytrain-guard experiment``; :func:`runner.run_experiment`)
and what exists only for it: fault specs and injection, the simulated card, the device-time
model, the demo. Importing this package imports neither ray nor torch.
"""
