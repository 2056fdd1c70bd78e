"""The cluster layer: node monitors, the run's coordinator, lockstep application of decisions.

Import-light: importing this package imports neither ray nor torch. The pieces:

* ``monitor.NodeMonitor``: samples one node's GPUs (NVML) and host (psutil); one per node.
* ``node_probes``: the NVML and psutil probes, and scripted probes for tests and rehearsals.
* ``coordinator.Coordinator``: one per run; step statistics and samples in, decisions out
  (the pure policy is ``raytrain_guard.core.policy``).
* ``metrics``: the ``raytrain_guard_*`` Ray metrics.
* ``actors``: ``start_monitors``, ``start_coordinator``, ``stop_all`` make them Ray actors.
"""
