"""``raytrain-guard status``: the live coordinator's view of a running guarded training."""

from __future__ import annotations

import argparse
import json
import sys

from raytrain_guard.cli.args import EXIT_BAD_INPUT, EXIT_OK
from raytrain_guard.cluster.status import format_status, read_status


def add_status_command(subparsers) -> None:
    p = subparsers.add_parser(
        "status", help="nodes, ranks, memory, step time, stragglers and decisions of a live run",
        description="Read the live coordinator of a guarded run (found by name in the "
                    "namespace). Sets RAY_AUTH_MODE=token when a Ray token exists and the "
                    "variable is unset. Exit 0 success, 2 no cluster at --address (within "
                    "about 15 s), no coordinator or bad input.")
    p.add_argument("--address", default=None, help="host:port of the Ray head (default: a "
                   "cluster started on this machine)")
    p.add_argument("--namespace", default="raytrain_guard", help="the run's Ray namespace")
    p.add_argument("--run-id", default=None, help="which run, when several are live")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.set_defaults(run=run_status)


def run_status(args: argparse.Namespace) -> int:
    try:
        status = read_status(args.address, args.namespace, args.run_id)
    except ConnectionError as exc:
        print(f"raytrain-guard status: error: --address: cannot connect ({exc}); start the "
              "cluster or pass its address", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(status, indent=2, default=str) if args.json else format_status(status))
    return EXIT_OK
