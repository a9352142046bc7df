"""Programmatic dependent launch for flotilla's Triton kernels (kernels/pdl.py says when it is on).

    @triton.jit
    def _kernel(..., PDL: tl.constexpr):
        pdl_enter(PDL)                      # before any store, and any load of what the kernels
                                            # of this step wrote (a weight, or the step's inputs
                                            # written before its first kernel, may come first)
        ...
    _kernel[grid](..., **launch_args(x, rows))    # PDL and Triton's launch_pdl together

A kernel launched so waits for the kernel before it (its writes visible) and then at once lets the
next kernel of the stream launch: the CUDA GEMV after a norm, silu * up or attention places its
blocks and issues its weight loads while this kernel runs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import pdl


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the kernel before this one, then let the next one launch (nothing when not PDL)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def launch_args(t: torch.Tensor, rows: int) -> dict:
    """A launch's PDL arguments for a kernel taking `PDL: tl.constexpr` over `rows` tokens on `t`'s device."""
    on = pdl.enabled(t, rows)
    return {"PDL": on, "launch_pdl": on} if on else {"PDL": False}
