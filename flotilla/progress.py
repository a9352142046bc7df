"""Progress bars (tqdm) that read well at a terminal and in a log file.

At a terminal a bar redraws in place, ten times a second at most. Written to a file or a pipe (a
log, CI), every redraw would be one more piece of a single line held together by carriage returns
(a quantize run's calibration made one of about 20 KB); there a bar redraws every LOG_INTERVAL
seconds, each redraw on a line of its own, the last when the bar closes; a bar that a terminal would
clear at its end (leave=False: loading, calibration text) starts its lines only once it has run that long
(a quick load says nothing; a long one says how far it is every LOG_INTERVAL seconds).
"""
from __future__ import annotations

import re
import sys

from tqdm import tqdm

LOG_INTERVAL = 30.0  # seconds between a bar's lines when stderr is not a terminal


def say_line(line: str) -> None:
    """One line on stderr with its newline in one write: print() writes the newline apart, and another thread's
    line (the engine's log, a pipeline worker's) can land between the two."""
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()
_CURSOR = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class _Lines:
    """stderr for tqdm off a terminal: each redraw ends its line (tqdm starts each with a carriage return)."""

    def write(self, text: str) -> None:
        text = _CURSOR.sub("", text).replace("\r", "")  # no cursor moves (nested bars) in a log
        if text.strip():
            sys.stderr.write(text.rstrip("\n") + "\n")

    def flush(self) -> None:
        sys.stderr.flush()


def progress_bar(iterable=None, **kwargs) -> tqdm:
    """tqdm(iterable, **kwargs) on stderr: in place at a terminal, a line every LOG_INTERVAL s elsewhere."""
    if not kwargs.get("disable") and not _at_terminal():
        kwargs = {"mininterval": LOG_INTERVAL, "file": _Lines(), "ncols": 100, **kwargs}
        if kwargs.get("leave") is False:
            kwargs.setdefault("delay", LOG_INTERVAL)
    return tqdm(iterable, **kwargs)


def _at_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False
