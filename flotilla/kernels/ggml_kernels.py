"""Kernels for linears whose weights are GGUF blocks (flotilla.kernels.ggml), chosen per device.

    kernel = ggml_linear(parts, device, dtype)   # parts: the output slices, in order
    y = kernel(x, bias)                          # x [..., in] -> y [..., sum of the parts' rows]
    kernel.name                                  # the form it runs, e.g. "cpu Q4_1" or "torch fp32"
    kernel.part_forms                            # per part, the form it runs in (for the load report)
    kernel.nbytes                                # bytes its form holds (every backend)
    rows = kernel.rows(ids)                      # weight rows [T, in] in dtype (an embedding lookup)

A part is a GGMLWeight, or a dense fp32 tensor (an unquantized GGUF tensor, or a type flotilla has
no kernel for, dequantized by the source). Merged linears (q/k/v, gate/up) may mix types, as
Q4_K_M files do. Backends:

    cpu     the compiled AVX2/AVX-512 kernels (kernels/cpu) for fp32 activations: each part in its
            own packed form, all parts run by one call
    triton  CUDA: the Triton kernels (kernels/triton_ggml) for the forms they cover
    torch   everywhere: the parts dequantized once to a dense weight in `dtype`, F.linear (the
            reference's numbers; FLOTILLA_KERNEL=dense or reference forces it)
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .ggml import GGMLWeight

ENV_KERNEL = "FLOTILLA_KERNEL"  # the registry's variable (this module imports nothing of flotilla's)
TORCH_ONLY = ("dense", "reference")

Part = GGMLWeight | torch.Tensor


def form_name(part: Part) -> str:
    return part.qtype if isinstance(part, GGMLWeight) else "fp32"


def dequantize_part(part: Part, dtype: torch.dtype) -> torch.Tensor:
    return part.dequantize(dtype) if isinstance(part, GGMLWeight) else part.to(dtype)


def part_rows(part: Part, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of one part, dequantized: [T, in]."""
    if isinstance(part, GGMLWeight):
        return part.dequantize_rows(ids, dtype)
    return F.embedding(ids, part).to(dtype)


class TorchGGMLKernel:
    """The parts dequantized once into one dense [out, in] weight; F.linear."""

    def __init__(self, parts: list[Part], device: torch.device, dtype: torch.dtype):
        self.weight = torch.cat([dequantize_part(p, dtype) for p in parts]).to(device)  # [out, in]
        self.part_forms = [f"{str(dtype)[6:]} (dequantized at load, torch)"] * len(parts)
        self.name = "torch " + "+".join(dict.fromkeys(form_name(p) for p in parts)) + f" -> {str(dtype)[6:]}"

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


def ggml_linear(parts: list[Part], device: torch.device | str, dtype: torch.dtype):
    """The fastest kernel for these parts on `device` with `dtype` activations."""
    device = torch.device(device)
    if os.environ.get(ENV_KERNEL, "").strip() not in TORCH_ONLY and device.type == "cpu" and dtype == torch.float32:
        from .cpu.ggml_pack import cpu_ggml_kernel

        kernel = cpu_ggml_kernel(parts)
        if kernel is not None:
            return kernel
    if os.environ.get(ENV_KERNEL, "").strip() not in TORCH_ONLY and device.type == "cuda":
        from .triton_ggml import triton_ggml_kernel

        kernel = triton_ggml_kernel(parts, device, dtype)
        if kernel is not None:
            return kernel
    return TorchGGMLKernel(parts, device, dtype)
