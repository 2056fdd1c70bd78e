"""Warnings said once (raytrain_guard.log.warn_once) and one-line error text
(raytrain_guard.errors.one_line)."""

from __future__ import annotations

import logging

import pytest

from raytrain_guard import log
from raytrain_guard.errors import one_line

logger = logging.getLogger("raytrain_guard.test_log")


@pytest.fixture
def said(monkeypatch):
    monkeypatch.setattr(log, "_SAID", set())


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger.name]


def test_a_key_is_said_once_per_logger_in_the_process(said, caplog):
    caplog.set_level(logging.WARNING, logger=logger.name)
    assert log.warn_once(logger, "probe", "probe failed (%s)", "gone") is True
    assert log.warn_once(logger, "probe", "probe failed (%s)", "again") is False
    assert log.warn_once(logger, "other", "other failed") is True
    assert _warnings(caplog) == ["probe failed (gone)", "other failed"]


def test_an_objects_own_keys_are_said_once_per_object(said, caplog):
    caplog.set_level(logging.WARNING, logger=logger.name)
    first, second = set(), set()
    for keys in (first, first, second):
        log.warn_once(logger, "metrics", "[node %s] metrics failed", id(keys), said=keys)
    assert len(_warnings(caplog)) == 2 and log._SAID == set()


def test_a_full_set_of_keys_is_cleared_so_keys_with_figures_stay_bounded(said, caplog):
    caplog.set_level(logging.WARNING, logger=logger.name)
    keys: set[str] = set()
    for i in range(log.MAX_KEYS + 1):
        log.warn_once(logger, f"memory at {i}%", "note", said=keys)
    assert len(keys) == 1                          # cleared at MAX_KEYS, then the last one
    assert log.warn_once(logger, "memory at 0%", "note", said=keys) is True


@pytest.mark.parametrize("exc, text", [
    (ValueError("no data\n  on this\tmachine"), "ValueError: no data on this machine"),
    (KeyError(), "KeyError"),
    (RuntimeError("x" * 400), "RuntimeError: " + "x" * 283 + "..."),
])
def test_one_line_names_the_type_and_joins_the_message(exc, text):
    assert one_line(exc) == text and len(one_line(exc)) <= 300
