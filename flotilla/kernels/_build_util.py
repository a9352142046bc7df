"""What the just-in-time builds of the kernels (kernels/cpu/build.py, kernels/cuda/build.py) share.

This module imports nothing of flotilla's.
"""
from __future__ import annotations


def failure_reason(e: BaseException, limit: int) -> str:
    """Why a build failed, for its one warning line: the first non-blank line of the exception's
    message (its type's name when the message is empty), cut to `limit` characters."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    why = lines[0] if lines else type(e).__name__
    return why if len(why) <= limit else why[:limit - 1] + "…"
