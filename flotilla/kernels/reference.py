"""Torch reference for dequant-matmul over the GPTQ layout: the oracle for every other kernel.

Runs on any device. Deliberately simple: unpack, subtract zero, scale, matmul.
"""
from __future__ import annotations

import torch

from .gptq import GPTQWeight


def dequantize(w: GPTQWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Return the dense weight W [in, out] in `dtype`."""
    g = w.g_idx.long()
    q = w.codes()  # [in, out]
    zeros = w.zeros()[g]  # [in, out]
    scales = w.scales.to(torch.float32)[g]  # [in, out]
    return ((q - zeros).to(torch.float32) * scales).to(dtype)


def gptq_matmul(x: torch.Tensor, w: GPTQWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W + bias for x [..., in]; computed in x's dtype (fp32 accumulate on CPU)."""
    y = x @ dequantize(w, x.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


class ReferenceKernel:
    """Dequantizes on every call. Slow; use it to check others or with FLOTILLA_KERNEL=reference."""

    name = "reference"
    keeps_source = True  # it reads the GPTQ tensors on every call: QuantLinear keeps them

    def __init__(self, w: GPTQWeight, dtype: torch.dtype):
        self.w = w

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return gptq_matmul(x, self.w, bias)


class DenseKernel:
    """Dequantizes once at load and keeps a dense weight; the matmul is the BLAS one.

    Numerically the reference (same dequantized values, same matmul); it trades memory for
    speed, which is the right trade for small models on a CPU, where torch's packed int4/int8
    CPU kernels lose to MKL's fp32 GEMV (see bench/cpu_kernels.py).
    """

    name = "dense"

    def __init__(self, w: GPTQWeight, dtype: torch.dtype):
        self.weight = dequantize(w, dtype).t().contiguous()  # [out, in], as nn.Linear keeps it

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, bias)
