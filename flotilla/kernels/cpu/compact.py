"""Plain (unquantized) linears: batch-invariant, and in fewer bytes where no weight changes.

A decode step on a CPU reads every weight once, so bytes are time. `compact_linear(weight)`
looks at an fp32 [out, in] weight and, only when the smaller form reproduces every value
exactly, stores it as

    int8 x block scale   weight[o, i] == scale[o, i // 32] * code[o, i], code in [-127, 127]
                         (what a GGUF Q8_0 tensor dequantizes to: ~1.06 bytes a weight)
    fp16                 weight.half().float() == weight (2 bytes a weight)

and returns a callable `y = f(x, bias=None)` for fp32 x [..., in] (the extension's
PackedLinear; `f.name` says the form: "int8-block32" or "fp16"; `f.nbytes` its size). The products and sums are
fp32 (the int8 form sums each block's x * code, then scales: the same real-number weights,
rounded differently from a BLAS dot product, and batch-invariant). When neither form is
exact it returns None and the caller keeps its fp32 weight.

`plain_linear(weight)` always gives a kernel (None only when the kernels are unavailable): the
smallest exact form, else the fp32 weights in the kernels' tiled layout. Unlike MKL's
F.linear, whose result for a row changes with the batch size, every form is batch-invariant:
use it for plain linears where batched and single-sequence runs must agree bit for bit.
"""
from __future__ import annotations

import torch

from . import build
from .packing import pack_float, pack_half, pack_int8_blocks

INT8_BLOCK = 32


def _check_weight(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.dtype == torch.float32 and weight.device.type == "cpu"


def half_linear(weight: torch.Tensor):
    """The fp16-weight kernel for an fp32 [out, in] weight, or None (not exact in fp16, not a
    2-D fp32 CPU tensor, or the kernels are unavailable)."""
    if not _check_weight(weight) or not torch.equal(weight.half().float(), weight):
        return None
    ext = build.load()
    if ext is None:
        return None
    return _named(pack_half(weight.detach()).build(ext), "fp16")


def int8_block_codes(weight: torch.Tensor, block: int = INT8_BLOCK) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes int8 [out, in], scales fp32 [out, ceil(in / block)]) with scale * code == weight
    exactly in fp32, or None. The scale of a block is its largest magnitude over 127, rounded
    to fp16 (as GGUF's Q8_0 stores it)."""
    n, k = weight.shape
    groups = -(-k // block)
    padded = torch.zeros(n, groups * block, dtype=torch.float32)
    padded[:, :k] = weight
    blocks = padded.view(n, groups, block)
    scale = (blocks.abs().amax(dim=-1) / 127).half().float()  # [out, groups]
    if not bool(torch.isfinite(scale).all()):
        return None
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    codes = torch.round(blocks / safe).clamp(-127, 127)
    if not torch.equal(codes * scale.unsqueeze(-1), blocks):
        return None
    return codes.view(n, -1)[:, :k].to(torch.int8), scale


def compact_linear(weight: torch.Tensor):
    """The smallest exact form of an fp32 [out, in] weight (int8 x block scale, then fp16), or None."""
    if not _check_weight(weight):
        return None
    weight = weight.detach()
    found = int8_block_codes(weight)
    if found is None:
        return half_linear(weight)
    ext = build.load()
    if ext is None:
        return None
    return _named(pack_int8_blocks(*found, INT8_BLOCK).build(ext), f"int8-block{INT8_BLOCK}")


def plain_linear(weight: torch.Tensor):
    """A batch-invariant kernel for an fp32 [out, in] weight: compact_linear's exact forms,
    else fp32 ("fp32"). None only when the kernels are unavailable or weight is not a 2-D fp32
    CPU tensor."""
    found = compact_linear(weight)
    if found is not None or not _check_weight(weight):
        return found
    ext = build.load()
    if ext is None:
        return None
    return _named(pack_float(weight.detach()).build(ext), "fp32")


def _named(op, name: str):
    op.name = name
    return op
