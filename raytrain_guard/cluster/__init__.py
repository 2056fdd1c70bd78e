"""The cluster layer: node monitors, the run's coordinator, the actors, the launcher, metrics,
the Grafana dashboard and ``raytrain-guard status`` (importing it imports neither ray nor torch).
"""
