"""rrefrt/userlog.py: a warning the user must see reaches stderr when logging is not
configured, and goes through logging (only) when it is."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from rrefrt import userlog

pytestmark = pytest.mark.timeout(10)


def test_unconfigured_logging_writes_to_stderr(monkeypatch):
    logger = logging.getLogger("rrefrt.test_userlog_a")
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    userlog.warn(logger, "waiting for rank(s) %s at %s", "1, 2", "host:1")
    assert "waiting for rank(s) 1, 2 at host:1" in err.getvalue()


def test_a_configured_handler_gets_the_record_and_stderr_stays_quiet(monkeypatch):
    logger = logging.getLogger("rrefrt.test_userlog_b")
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        userlog.warn(logger, "On worker %r: boom", "w1")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["On worker 'w1': boom"] and err.getvalue() == ""


def test_a_level_above_warning_silences_it(monkeypatch):
    logger = logging.getLogger("rrefrt.test_userlog_c")
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    logger.setLevel(logging.ERROR)
    try:
        userlog.warn(logger, "not shown")
    finally:
        logger.setLevel(logging.NOTSET)
    assert err.getvalue() == ""


def test_a_huge_user_error_is_shown_cut_on_the_worker_that_ran_it():
    """The worker's log shows at most LOG_TEXT_MAX characters of each part of a user
    function's error (its head and tail); its caller gets the error whole."""
    from rrefrt.runtime.callee import LOG_TEXT_MAX, _cut

    assert _cut("short") == "short"
    text = "a" * 1000 + "x" * (2 << 20) + "z" * 1000
    cut = _cut(text)
    assert len(cut) < LOG_TEXT_MAX + 100 and cut.startswith("a" * 1000) and cut.endswith("z" * 1000)
    assert f"[{len(text) - LOG_TEXT_MAX} characters left out]" in cut
