"""Programmatic dependent launch (PDL): whether a kernel on this device may be launched so that it
starts while the kernel before it in the stream still runs.

On sm_90+ (Hopper) a kernel launched as a programmatic dependent is placed on the SMs once every
block of the kernel before it has signalled `griddepcontrol.launch_dependents` (or ended), and
waits in `griddepcontrol.wait` for that kernel's completion (and its writes) before it reads what
that kernel wrote. The decode step's kernels that take part: the CUDA GEMV (cuda/gemv_mma.cuh:
its weight loads go before the wait) and the small Triton kernels of triton_fused and the paged
attention's decode kernel (the wait first, then the signal, so the GEMV after them starts at
once). Inside a CUDA graph the launches become programmatic edges (CUDA >= 12.3).

    enabled(tensor)          # True on an sm_90+ GPU unless FLOTILLA_PDL=0 or Triton interprets
    enabled(tensor, rows)    # and rows <= MAX_ROWS: the Triton kernels take part only at the
                             # batches where the GEMV follows them (bench/NOTES-gpu-decode.md, run 13:
                             # at 16 and 64 rows PDL measured ~1% slower)

`ENABLED = False` (or FLOTILLA_PDL=0 in the environment) turns it off for every later launch (a
CUDA graph keeps what it captured); bench/gpu_decode.py measures both.

This module imports nothing of flotilla's.
"""
from __future__ import annotations

import os

import torch

ENV = "FLOTILLA_PDL"
ENABLED = os.environ.get(ENV, "1") != "0"
MIN_CAPABILITY = (9, 0)
MAX_ROWS = 8  # the CUDA GEMV's M <= 8 plans' rows (cuda/gemv.py ROW_TILES; its wide plan launches without PDL)

_capable: dict[int, bool] = {}


def enabled(t: torch.Tensor, rows: int = 1) -> bool:
    """Launch a kernel of `rows` tokens on `t`'s device as a programmatic dependent."""
    if not ENABLED or rows > MAX_ROWS or t.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    ok = _capable.get(index)
    if ok is None:
        ok = _capable[index] = tuple(torch.cuda.get_device_capability(index)) >= MIN_CAPABILITY
    return ok
