"""The ``raytrain-guard`` parser and entry point.

Each subcommand is one ``add_<name>_command(subparsers)`` function that adds its parser and sets
``run=<function(args) -> exit code>``; :data:`COMMANDS` lists them. Adding a subcommand is one
new function and one entry in that tuple. Exit codes: :mod:`raytrain_guard.cli.args`; argparse's
own errors are one line too (:class:`OneLineArgumentParser`).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from raytrain_guard.cli.args import EXIT_BAD_INPUT
from raytrain_guard.cli.experiment import add_demo_command, add_experiment_command
from raytrain_guard.cli.grafana import add_grafana_dashboard_command
from raytrain_guard.cli.plan import add_plan_command
from raytrain_guard.cli.status import add_status_command
from raytrain_guard.errors import GuardError

#: one entry per subcommand; each adds its parser and sets ``run``
COMMANDS: tuple[Callable[[Any], None], ...] = (
    add_plan_command,
    add_status_command,
    add_demo_command,
    add_experiment_command,
    add_grafana_dashboard_command,
)


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr (exit 2), like every other bad input;
    ``--help`` is unchanged. Subcommand parsers are of this class too (argparse's default)."""

    _arg_strings: Sequence[str] = ()
    #: subcommand name -> its parser (set by build_parser), to report leftovers as the command
    commands: dict[str, argparse.ArgumentParser] | None = None

    def parse_args(self, args=None, namespace=None):
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            parser = (self.commands or {}).get(getattr(parsed, "command", None), self)
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed

    def parse_known_args(self, args=None, namespace=None):
        self._arg_strings = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        hint = _dash_value_hint(message, self._arg_strings) or f"; see {self.prog} --help"
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}{hint}\n")


def _dash_value_hint(message: str, arg_strings: Sequence[str]) -> str:
    """For ``--params -7B``, which argparse reads as two options: say so, and the fix."""
    m = re.fullmatch(r"argument (\S+): expected one argument", message)
    if m is None:
        return ""
    options = m.group(1).split("/")
    for option, value in itertools.pairwise(arg_strings):
        if option in options and re.match(r"-\.?\d", value):
            return (f" (got {value!r}, which reads as an option): {option} takes a positive "
                    f"value, e.g. {option} {value[1:]}; write {option}={value} to pass a value "
                    f"that starts with '-'")
    return ""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="raytrain-guard",
        description="Keep distributed PyTorch training on Ray inside its GPU-memory, "
                    "host-memory and communication limits.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(subparsers)
    parser.commands = dict(subparsers.choices)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, run the subcommand, map errors to exit codes (2 for bad input, no traceback)."""
    args = build_parser().parse_args(argv)      # argparse errors: one line, exit 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except GuardError as err:
        print(f"raytrain-guard {args.command}: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT

