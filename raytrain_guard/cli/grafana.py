"""``raytrain-guard grafana-dashboard``: the guard's Grafana dashboard, as JSON."""

from __future__ import annotations

import argparse
import sys

from raytrain_guard.cli.args import EXIT_BAD_INPUT, EXIT_OK
from raytrain_guard.cluster.grafana import dashboard_json


def add_grafana_dashboard_command(subparsers) -> None:
    p = subparsers.add_parser(
        "grafana-dashboard", help="print the Grafana dashboard of the guard's metrics (JSON)",
        description="Write the Grafana dashboard of the guard's metrics: per-rank step time and "
                    "phases, data wait, memory against the watermark and critical lines, "
                    "straggler scores, decisions (also as annotations), node GPU memory, "
                    "utilization, temperature and throttle reasons. Import it into the Grafana "
                    "of Ray's metrics setup (Dashboards > New > Import), or copy it into the "
                    "folder that Grafana provisions from (on the head: "
                    "/tmp/ray/session_latest/metrics/grafana/dashboards). Its 'run' variable "
                    "filters on ray_train_run_name, as Ray Train's own panels do. Exit 0.")
    p.add_argument("--out", default=None, help="write the JSON to this file (default: stdout)")
    p.set_defaults(run=run_grafana_dashboard)


def run_grafana_dashboard(args: argparse.Namespace) -> int:
    text = dashboard_json()
    if args.out is None:
        sys.stdout.write(text)
        return EXIT_OK
    try:
        with open(args.out, "w") as f:
            f.write(text)
    except OSError as exc:
        print(f"raytrain-guard grafana-dashboard: error: --out: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"wrote {args.out}")
    return EXIT_OK
