"""The ``raytrain-guard`` command line: ``plan``, ``status``, ``demo``, ``experiment`` and
``grafana-dashboard`` (:data:`raytrain_guard.cli.parser.COMMANDS` lists them)."""

from raytrain_guard.cli.parser import main

__all__ = ["main"]
