"""The GPTQ dequant-GEMM kernel for CPUs: W4/W8, fp32 activations, compiled C++ (csrc/)."""
from __future__ import annotations

import torch

from ..gptq import GPTQWeight
from ..reference import DenseKernel
from . import build
from .packing import pack_gptq


def cpu_gptq_kernel(w: GPTQWeight):
    """The compiled kernel for one GPTQ linear: `kernel(x, bias=None) -> y` for fp32 x [..., in].

    Returns the extension's PackedLinear itself (no Python frame per call), or None when the
    kernels are unavailable. Results are batch-invariant: a row's output is bit-identical
    whatever the other rows of the call.
    """
    ext = build.load()
    if ext is None:
        return None
    return pack_gptq(w).build(ext)


def make_kernel(w: GPTQWeight, dtype: torch.dtype):
    """The registry's factory: ours for fp32 activations on CPU, else the dense kernel (the
    reference's numbers at MKL speed)."""
    kernel = None
    if dtype == torch.float32 and w.qweight.device.type == "cpu":
        kernel = cpu_gptq_kernel(w)
    return kernel if kernel is not None else DenseKernel(w, dtype)


def supports(device: torch.device, bits: int) -> bool:
    return device.type == "cpu" and bits in (4, 8) and build.load() is not None
