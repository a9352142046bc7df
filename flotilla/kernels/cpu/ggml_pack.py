"""GGUF block types (flotilla.kernels.ggml) in the compiled kernels' packed layouts (csrc/kernels.h).

    Q4_0            W4: signed nibbles (q - 8), fp16 scale per 32
    Q4_1, Q4_K      U4: unsigned nibbles, scale and min per 32 (fp16 for Q4_1, fp32 for Q4_K,
                    whose d * sc needs up to 17 bits)
    Q5_0            W5: nibbles + a plane of fifth bits, signed (q - 16), fp16 scale per 32
    Q5_1, Q5_K      U5: the same unsigned, with scale and min
    Q8_0            W8: int8, fp16 scale per 32
    Q6_K            W8: int8 (q - 32), fp32 scale per 16

Each group of 32 (16) inputs of a tile of 32 outputs is one record, [codes][fifth bits][scales]
[mins] (the blocked layout of csrc/kernels.h): a decode step then streams one run of memory per
tile instead of codes and two tables apart. Every packed weight is exactly the GGMLWeight's:
the kernels decode the same integers and read the same scales and mins. A merged linear whose parts differ in type (Q4_K_M files) becomes an
extension StackedLinear of one PackedLinear per run of same-type parts, run by one call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ggml import GGMLWeight, same_type_runs
from . import build
from .compact import plain_linear
from .packing import TILE, U4, U5, W4, W5, W8, _pad_cols, _tile_major


def _nibble_words(fields: torch.Tensor) -> torch.Tensor:
    """Fields [K, N] (0..15) -> int32 [K / 8, N]: word w holds fields 8w..8w+7, LSB first."""
    k, n = fields.shape
    f = fields.view(k // 8, 8, n)
    word = torch.zeros(k // 8, n, dtype=torch.int32)
    for j in range(8):  # one eighth of the weight at a time: no int64 copy of the whole tensor
        word |= f[:, j].to(torch.int32) << (4 * j)
    return word


def _bit_plane(bits: torch.Tensor) -> torch.Tensor:
    """Bits [K, N] (0/1) -> uint8 [K / 8, N]: bit j of byte w is bits[8w + j]."""
    k, n = bits.shape
    b = bits.view(k // 8, 8, n)
    plane = torch.zeros(k // 8, n, dtype=torch.uint8)
    for j in range(8):
        plane |= b[:, j].to(torch.uint8) << j
    return plane


@dataclass(frozen=True)
class BlockedPack:
    """Arguments of the extension's PackedLinear.blocked: one record per group of a tile."""

    format: int
    in_features: int
    out_features: int
    blob: torch.Tensor  # uint8 [tiles, groups, record bytes]
    group: int
    half_tables: bool
    with_mins: bool

    def build(self, ext):
        return ext.PackedLinear.blocked(self.format, self.in_features, self.out_features, self.blob, self.group,
                                        self.half_tables, self.with_mins)


def _records(t: torch.Tensor, groups: int) -> torch.Tensor:
    """A tile-major tensor [tiles, rows, 32] whose rows split evenly into `groups` as bytes
    [tiles, groups, bytes of a group's rows]."""
    tiles = t.shape[0]
    return t.contiguous().view(torch.uint8).view(tiles, groups, -1)


def _table_records(table_ng: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A per-group table [N, G] as bytes [tiles, G, 32 entries]."""
    padded = _pad_cols(table_ng.t(), dtype)  # [G, tiles * 32]
    g = padded.shape[0]
    return padded.view(g, -1, TILE).permute(1, 0, 2).contiguous().view(torch.uint8).view(-1, g, TILE * dtype.itemsize)


def pack_ggml(w: GGMLWeight) -> BlockedPack:
    """One GGMLWeight [out, in] as the kernels' blocked records."""
    fmt = w.format
    n, k = w.shape
    groups = k // fmt.group
    codes = w.codes.t()  # [K, N] int8
    parts = []
    if fmt.bits in (4, 5):
        signed = fmt.code_min < 0
        fields = (codes & 0x0F).to(torch.uint8)  # the low four bits of the (two's complement) code
        parts.append(_records(_tile_major(_nibble_words(fields), 0), groups))
        if fmt.bits == 5:
            parts.append(_records(_tile_major(_bit_plane(((codes >> 4) & 1).to(torch.uint8)), 0), groups))
            form = W5 if signed else U5
        else:
            form = W4 if signed else U4
    else:  # 6 and 8 bits: one int8 a weight
        parts.append(_records(_tile_major(codes.contiguous(), 0), groups))
        form = W8
    table = torch.float16 if fmt.fp16_scales else torch.float32
    parts.append(_table_records(w.scales, table))
    if w.mins is not None:
        parts.append(_table_records(w.mins, table))
    blob = torch.cat(parts, dim=2).contiguous()
    return BlockedPack(form, k, n, blob, fmt.group, fmt.fp16_scales, w.mins is not None)


def describe(w: GGMLWeight, isa: str) -> str:
    """The packed form of `w`, for the load report."""
    fmt = w.format
    bits = {4: "4-bit", 5: "5-bit", 6: "int8", 8: "int8"}[fmt.bits]
    table = "fp16" if fmt.fp16_scales else "fp32"
    extra = " + min" if fmt.has_min else ""
    return f"cpu {bits} x {table} scale{extra} per {fmt.group} ({isa})"


def cpu_ggml_kernel(parts: list):
    """The compiled kernel for a linear made of `parts` (GGMLWeight or fp32 [rows, in] tensors),
    or None when the kernels are unavailable. The kernel has `part_forms` (one per part)."""
    ext = build.load()
    if ext is None:
        return None
    ops, forms = [], []
    for run in same_type_runs(parts):
        if isinstance(run[0], GGMLWeight):
            op = pack_ggml(GGMLWeight.cat(run) if len(run) > 1 else run[0]).build(ext)
            forms += [describe(p, ext.isa()) for p in run]
        else:
            op = plain_linear(run[0].float().contiguous())
            if op is None:
                return None
            forms.append(f"cpu {op.name} ({ext.isa()})")
        ops.append(op)
    kernel = ops[0] if len(ops) == 1 else ext.StackedLinear(ops)
    kernel.name = "cpu " + "+".join(dict.fromkeys(f.split(" (")[0][4:] for f in forms))
    return _with_forms(kernel, forms)


def _with_forms(kernel, forms: list[str]):
    kernel.part_forms = forms
    return kernel


__all__ = ["cpu_ggml_kernel", "pack_ggml", "describe", "TILE"]
