"""What every subcommand shares: exit codes and the parsing of size, count and factory flags.

Exit codes: 0 success (for ``plan``: the plan fits), 1 the plan does not fit or the command could
not run, 2 bad input (one line on stderr naming the input and the fix).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from raytrain_guard.errors import GuardError, PlanInputError, check_int, one_line
from raytrain_guard.units import MiB, TiB, parse_bytes

EXIT_OK, EXIT_DOES_NOT_FIT, EXIT_BAD_INPUT = 0, 1, 2

#: sizes written without a unit below this are refused: "--gpu-mem 80" meant GiB, not bytes
MIN_UNITLESS_BYTES = MiB
#: no memory a plan reads (a card, a node's RAM, a batch) comes near 1 PiB: "1e40" is a typo
MAX_SIZE_BYTES = 1024 * TiB
#: --params above this is no model: 1000 T parameters, hundreds of times the largest trained
MAX_PARAMS = 1e15


def call_user(factory: Callable[[], Any], flag: str) -> Any:
    """``factory()``; what it raises is bad input naming ``flag``."""
    try:
        return factory()
    except GuardError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's factory raised
        raise PlanInputError(flag, f"the factory raised {one_line(exc)}",
                             fix="make the factory run on its own (python -c \"from m import "
                                 "f; f()\")") from None


def import_path() -> None:
    """Let ``MODULE:FACTORY`` name modules of the current directory, as ``python -m`` does."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())


def positive_int(text, flag: str, default: Any = ...) -> Any:
    """A flag's text as an integer >= 1; ``default`` when the flag is absent (none: required)."""
    if text is None:
        if default is ...:
            raise PlanInputError(flag, "is required", fix=f"pass {flag} N")
        return default
    return check_int(flag, text, at_least=1, parse=True, error=PlanInputError,
                     fix=f"pass {flag} as a positive integer, e.g. {flag} 8")


def size(text, flag: str) -> int | None:
    """A size flag: refused without a unit below MIN_UNITLESS_BYTES, and above MAX_SIZE_BYTES."""
    return None if text is None else parse_bytes(text, field=flag,
                                                 unitless_min_bytes=MIN_UNITLESS_BYTES,
                                                 at_most=MAX_SIZE_BYTES)
