"""The guard's parts fail open: a part that raises returns None, is logged once, and the
training goes on."""

from __future__ import annotations

import logging

from raytrain_guard.runtime.guard.fail_open import FailOpen


def test_a_failing_part_returns_none_and_is_logged_once_per_part(caplog):
    log = logging.getLogger("test_fail_open")
    guard = FailOpen(log, lambda: "rank 1 step 7")

    def boom():
        raise RuntimeError("probe gone")

    with caplog.at_level(logging.WARNING, logger="test_fail_open"):
        assert guard.call("probe", boom) is None
        assert guard.call("probe", boom) is None
        assert guard.call("timer", boom) is None
        assert guard.call("probe", lambda x: x + 1, 2) == 3
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["rank 1 step 7: guard part 'probe' failed; training goes on (logged once)",
                     "rank 1 step 7: guard part 'timer' failed; training goes on (logged once)"]
    assert caplog.records[0].exc_info[0] is RuntimeError
    assert guard.failed == {"probe", "timer"}
