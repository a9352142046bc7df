"""Progress bars off a terminal (a log, CI): a line per redraw, LOG_INTERVAL apart, never one line held
together by carriage returns."""
from __future__ import annotations

import io
import sys

from flotilla import progress


def test_off_a_terminal_each_redraw_is_its_own_line(monkeypatch):
    err = io.StringIO()  # not a terminal
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(progress, "LOG_INTERVAL", 0.0)  # every update redraws, from the start
    for _ in progress.progress_bar(range(5), desc="quantize", unit="layer"):
        pass
    text = err.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    assert len(lines) >= 2 and all(line.startswith("quantize") for line in lines)
    assert "5/5" in lines[-1]


def test_disabled_bars_write_nothing(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    for _ in progress.progress_bar(range(3), disable=True):
        pass
    assert err.getvalue() == ""


def test_off_a_terminal_a_quick_cleared_bar_says_nothing_and_a_kept_one_its_start_and_end(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    for _ in progress.progress_bar(range(3), desc="loading", leave=False):  # done within LOG_INTERVAL: no line
        pass
    assert err.getvalue() == ""
    for _ in progress.progress_bar(range(3), desc="quantize"):
        pass
    lines = err.getvalue().splitlines()  # its first state, and its last at the close
    assert lines[0].startswith("quantize") and "0/3" in lines[0] and "3/3" in lines[-1] and len(lines) == 2


def test_off_a_terminal_a_long_cleared_bar_says_how_far_it_is(monkeypatch):
    import time

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(progress, "LOG_INTERVAL", 0.05)
    for _ in progress.progress_bar(range(4), desc="loading", leave=False):
        time.sleep(0.06)
    lines = err.getvalue().splitlines()
    assert lines and all(line.startswith("loading") for line in lines) and "\r" not in err.getvalue()
