"""A hung step in the shared train loop: the watchdog names it, the coordinator hears of it, and
the process ends so that Ray restarts the group from the last checkpoint."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

HANG_EXIT_CODE = 75     # EX_TEMPFAIL: the watchdog ended a hung process; Ray restarts the group
#: the least time between a hang being named and the process ending: the other ranks'
#: watchdogs (which check every 0.5 s) name theirs too before this rank's exit breaks their
#: collectives
HANG_EXIT_PAUSE_S = 1.0


class HangExit:
    """The watchdog's call (on its thread): write the hang down, send it to the decision
    source's coordinator (which names the hung rank from every rank's record; the send waits
    at most 1.5 s), and with ``act`` end the process: the hung step never returns."""

    def __init__(self, recorder: Any, *, source: Any, act: bool,
                 exit: Callable[[int], None] = os._exit) -> None:
        self.recorder = recorder
        self.source = source
        self.act = act
        self._exit = exit

    def __call__(self, record: Mapping[str, Any]) -> None:
        fired = time.monotonic()
        logger.error("hang: %s", record["reason"])
        self.recorder.event("hang", **record, acted=self.act)
        verdict = self._report(record)
        if verdict is not None:
            logger.error("hang: the coordinator says so far: %s", verdict.get("reason"))
            self.recorder.event("hang_verdict", **verdict)
        if self.act:
            time.sleep(max(0.0, HANG_EXIT_PAUSE_S - (time.monotonic() - fired)))
            logging.shutdown()
            self._exit(HANG_EXIT_CODE)

    def _report(self, record: Mapping[str, Any]) -> Mapping[str, Any] | None:
        report = getattr(self.source, "report_hang", None)
        try:
            return report(record) if callable(report) else None
        except Exception:
            logger.warning("rank %s: the hang record did not reach the coordinator",
                           record.get("world_rank"), exc_info=True)
            return None
