"""flotilla's own CPU kernels: compiled C++ (AVX2/AVX-512) dequant-GEMM for fp32 activations.

    cpu_gptq_kernel(w)          GPTQ W4/W8, any group size, sym/asym, act-order; the registry
                                entry "cpu" (FLOTILLA_KERNEL=cpu forces it)
    compact_linear(weight)      an exact int8 x block-scale or fp16 form of a plain fp32 linear
                                (the lm_head), or None
    half_linear(weight)         the fp16 form only, or None
    plain_linear(weight)        always a kernel: the smallest exact form, else fp32 (batch-invariant,
                                unlike MKL's F.linear)
    available()                 whether the compiled kernels load on this machine

The C++ sources are compiled once per machine and cached (see build.py); when that is
impossible, everything falls back to the dense kernel after one warning line.
"""
from __future__ import annotations

from . import build
from .compact import compact_linear, half_linear, plain_linear
from .kernel import cpu_gptq_kernel, make_kernel, supports

PRIORITY = 20  # above "dense" (10): faster wherever it is supported


def available() -> bool:
    return build.load() is not None


def register_kernels(register) -> None:
    from ..registry import KernelEntry

    register(KernelEntry("cpu", make_kernel, supports, priority=PRIORITY))


__all__ = ["cpu_gptq_kernel", "available", "compact_linear", "half_linear", "plain_linear", "register_kernels"]
