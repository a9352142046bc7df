"""Chooses a dequant-matmul kernel per device and bit width.

Each entry says which devices and bit widths it serves and how much it should be preferred.
`FLOTILLA_KERNEL=<name>` forces one (for debugging); an unknown name is an error that lists the
valid ones.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from .gptq import GPTQWeight
from .reference import DenseKernel, ReferenceKernel

ENV_KERNEL = "FLOTILLA_KERNEL"


class KernelChoiceError(ValueError):
    """FLOTILLA_KERNEL names no kernel, or one that does not serve this case (a user's setting: the CLI
    says it in one line)."""


@dataclass(frozen=True)
class KernelEntry:
    name: str
    factory: Callable[[GPTQWeight, torch.dtype], Callable]
    supports: Callable[[torch.device, int], bool]
    priority: int  # higher wins among those that support the case


_REGISTRY: dict[str, KernelEntry] = {}


def register(entry: KernelEntry) -> None:
    _REGISTRY[entry.name] = entry


def kernel_names() -> list[str]:
    _load_optional()
    return sorted(_REGISTRY)


def select(w: GPTQWeight, device: torch.device, dtype: torch.dtype):
    """Build the kernel object for one quantized linear whose tensors already sit on `device`."""
    _load_optional()
    forced = os.environ.get(ENV_KERNEL, "").strip()
    if forced:
        if forced not in _REGISTRY:
            raise KernelChoiceError(f"{ENV_KERNEL}={forced!r} is not a kernel; valid: {', '.join(sorted(_REGISTRY))} "
                                    f"(unset it for the fastest)")
        entry = _REGISTRY[forced]
        if not entry.supports(device, w.bits):
            raise KernelChoiceError(f"{ENV_KERNEL}={forced!r} does not support {device.type} at {w.bits} bits "
                                    f"(unset it for the fastest)")
        return entry.factory(w, dtype)
    candidates = [e for e in _REGISTRY.values() if e.supports(device, w.bits)]
    best = max(candidates, key=lambda e: e.priority)
    return best.factory(w, dtype)


_optional_loaded = False


def _load_optional() -> None:
    """Register kernels whose imports are optional (Triton on CUDA, compiled CPU kernels)."""
    global _optional_loaded
    if _optional_loaded:
        return
    _optional_loaded = True
    for module in _OPTIONAL_MODULES:
        try:
            __import__(module, fromlist=["register_kernels"]).register_kernels(register)
        except ImportError:
            pass


_OPTIONAL_MODULES: list[str] = [
    f"{__package__}.triton_linear",  # Triton on CUDA
    f"{__package__}.cuda",  # compiled CUDA kernels (nvcc): where Triton is missing, or forced
    f"{__package__}.cpu",  # compiled CPU kernels (AVX2/AVX-512)
]

register(KernelEntry("reference", ReferenceKernel, lambda d, b: True, priority=0))
register(KernelEntry("dense", DenseKernel, lambda d, b: True, priority=10))
