"""Warnings said once (standard library only).

A warning that a loop or a sampling thread would repeat (a private torch API missing, a probe
failing) is logged the first time its key comes, then kept quiet.
"""

from __future__ import annotations

import logging
from typing import Any

#: keys of warnings already said by this process, per logger (see :func:`warn_once`)
_SAID: set[tuple[str, str]] = set()
#: a set of keys holds at most this many: keys may carry figures, so it is cleared when full
MAX_KEYS = 1000


def warn_once(logger: logging.Logger, key: str, message: str, *args: Any,
              said: set[Any] | None = None) -> bool:
    """Log ``message % args`` at WARNING unless ``key`` was said before; True when logged.

    ``said``: the keys of one object (a monitor's, a coordinator's), for warnings once per
    object; default: once per logger in this process."""
    seen: set[Any] = _SAID if said is None else said
    mark = (logger.name, key) if said is None else key
    if mark in seen:
        return False
    if len(seen) >= MAX_KEYS:
        seen.clear()
    seen.add(mark)
    logger.warning(message, *args)
    return True
