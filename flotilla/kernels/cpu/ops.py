"""The per-layer ops of a CPU step in one compiled pass each (csrc/ops.cpp), for fp32 tensors.

    rms_norm(x, weight, eps)                  x [..., H] -> [..., H]
    add_rms_norm(x, delta, weight, eps)       -> (x + delta, rms_norm(x + delta))
    silu_mul(gate_up)                         [..., 2I] -> silu(first half) * second half
    rope(x, cos, sin)                         x [T, H, D] -> x * cos + roll(x, D/2) * sin
    CpuDecode.for_step(meta)                  paged decode attention reading the cache blocks in place

A small model's decode step on a CPU is mostly per-op overhead: torch's rms_norm is seven kernels,
and its CPU SDPA costs ~45 µs a call for one query row. `ready(*tensors)` says whether these ops
take the tensors (fp32 on the CPU, the kernels compiled, and FLOTILLA_KERNEL not forcing torch);
kernels/fused.py and kernels/attention.py dispatch on it. Whether the ops run at all is decided
once, at first use (FLOTILLA_KERNEL and the build are not looked up per call: a decode step makes
a few hundred of these calls); `reset()` forgets the decision, so that a test which changes
FLOTILLA_KERNEL gets a fresh one. Each row is computed alone, in one fixed order, so results are
batch-invariant.
"""
from __future__ import annotations

import os

import torch

from . import build

_TORCH_ONLY = ("dense", "reference")  # FLOTILLA_KERNEL values that mean "torch all the way"
_UNDECIDED = object()
_ext = _UNDECIDED  # the compiled module, or None (torch): decided at first use


def extension():
    """The compiled module these ops run in, or None where torch runs them (decided once)."""
    global _ext
    if _ext is _UNDECIDED:
        _ext = None if os.environ.get("FLOTILLA_KERNEL", "").strip() in _TORCH_ONLY else build.load()
    return _ext


def reset() -> None:
    """Decide again at the next use (after a test changed FLOTILLA_KERNEL)."""
    global _ext
    _ext = _UNDECIDED


def ready(*tensors: torch.Tensor) -> bool:
    """The compiled ops take these tensors (fp32 on the CPU); the tensors are looked at first, so that
    a GPU process never builds the CPU extension for an op it runs elsewhere."""
    if not all(t.is_cpu and t.dtype == torch.float32 for t in tensors):
        return False
    return (_ext if _ext is not _UNDECIDED else extension()) is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return extension().rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    total, normed = extension().add_rms_norm(x, delta, weight, eps)
    return total, normed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return extension().silu_mul(gate_up)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return extension().rope(x, cos, sin)


class CpuDecode:
    """The decode rows of one step: each query head over its sequence's cached keys and values,
    read through the block table (no gather, no mask)."""

    def __init__(self, block_tables: torch.Tensor, seq_lens: torch.Tensor):
        self.block_tables, self.seq_lens = block_tables, seq_lens

    @classmethod
    def for_step(cls, meta) -> "CpuDecode | None":
        nd = meta.num_decodes
        if not nd or extension() is None or meta.block_tables.device.type != "cpu":
            return None
        return cls(meta.block_tables[:nd].contiguous(), meta.seq_lens[:nd].contiguous())

    def __call__(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        return extension().decode_attention(q.contiguous(), key_cache, value_cache, self.block_tables,
                                            self.seq_lens, scale, window, softcap)
