"""What the just-in-time builds of the kernels (kernels/cpu/build.py, kernels/cuda/build.py) share.

This module imports nothing of flotilla's.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from pathlib import Path


def failure_reason(e: BaseException, limit: int) -> str:
    """Why a build failed, for its one warning line: the first non-blank line of the exception's
    message (its type's name when the message is empty), cut to `limit` characters."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    why = lines[0] if lines else type(e).__name__
    return why if len(why) <= limit else why[:limit - 1] + "…"


TORCH_BATON = "lock"  # the file torch.utils.cpp_extension's FileBaton creates in a build directory
# how long a process waits for the build lock before it says it is waiting: another process holds it that long
# only while building (loading the built kernels under it, as pipeline workers starting together do, is quicker)
QUIET_WAIT_S = 3.0


def _lock_within(f, seconds: float) -> bool:
    """Take the exclusive lock on `f` if it comes within `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


@contextlib.contextmanager
def build_lock(directory: Path, what: str):
    """Hold an exclusive lock on `directory` for one build, and clear a stale torch baton.

    torch.utils.cpp_extension guards a build with a `lock` file that it deletes when the build ends;
    a process killed mid-build (Ctrl-C on the first run) leaves the file behind, and every later
    process then waits for it forever, silently. Our lock is an flock(2), which the kernel releases
    when its holder dies, so whoever holds it knows that no live flotilla process is building: a
    baton found then is stale and is removed. A second process waiting for a live build says so."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "flotilla.lock", "a+b") as f:
        if not _lock_within(f, QUIET_WAIT_S):  # a holder only loading the built kernels lets go sooner
            print(f"waiting for another process that is building {what} in {directory}…", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / TORCH_BATON)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
