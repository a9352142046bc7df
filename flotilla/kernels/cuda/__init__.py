"""flotilla's CUDA kernels: W4A16 / W8A16 dequant-matmul for NVIDIA GPUs (sm_80+).

    CudaGPTQKernel(w, dtype)    GPTQ W4/W8, fp16/bf16 activations, group sizes that are multiples
                                of 16 rows (32 at least; a short last group too), sym/asym,
                                act-order; the registry entry "cuda" (FLOTILLA_KERNEL=cuda)
    repack(w, dtype)            the kernels' weight layout (pure torch; layout.py)

Ranked below the Triton kernels: on the H200 they are correct but not yet faster at batch 1-64
(bench/NOTES-kernels.md); they serve where Triton is missing, or when forced. The sources (csrc/)
are compiled with nvcc once per GPU architecture and cached (build.py), when this entry is first
chosen; where nvcc is missing or the build fails, one warning line is printed and the Triton
kernels serve instead.
"""
from __future__ import annotations

from .kernel import CudaGPTQKernel, Plan, choose_plan, make_kernel, supports
from .layout import CudaLayout, UnsupportedCudaLayout, repack

PRIORITY = 15  # below "triton" (20), which measured faster; above "dense" (10)


def register_kernels(register) -> None:
    from ..registry import KernelEntry

    register(KernelEntry("cuda", make_kernel, supports, priority=PRIORITY))


__all__ = ["CudaGPTQKernel", "CudaLayout", "Plan", "UnsupportedCudaLayout", "choose_plan", "make_kernel", "repack",
           "register_kernels", "supports"]
