"""The cluster layer (importing it imports neither ray nor torch): node monitors
(``monitor``, their probes in ``monitor.probes``), the run's ``coordinator`` (the pure policy
is ``raytrain_guard.core.policy``), ``actors`` (makes them Ray actors), the ``launcher``, the
Ray ``metrics`` and their ``grafana`` dashboard, and ``status`` (``raytrain-guard status``).
"""
