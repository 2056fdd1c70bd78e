"""The guard fails open: a part of it that raises is logged once and training goes on."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any


class FailOpen:
    """The parts of one guard that failed, each logged once (with its traceback) to
    ``logger``. ``where()`` says which rank and step, for the log line."""

    def __init__(self, logger: logging.Logger, where: Callable[[], str]) -> None:
        self._logger = logger
        self._where = where
        self.failed: set[str] = set()

    def call(self, part: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, or None when it raises (logged once per ``part``)."""
        try:
            return fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - the guard fails open
            self.note(part)
            return None

    def note(self, part: str) -> None:
        """Log the exception being handled, once per ``part``: call it from an except block."""
        if part not in self.failed:
            self.failed.add(part)
            self._logger.warning("%s: guard part %r failed; training goes on (logged once)",
                                 self._where(), part, exc_info=True)
