"""Repack weights into the layouts of csrc/kernels.h (done once, at load).

GPTQ weights (any bits/sym/group size/act-order) become:

    codes   W4: int32 [tiles, Kp / 8, 32] of codes XOR 8 (a nibble read as a signed 4-bit
            number is then code - 8), W8: int8 [tiles, Kp, 32] (code - 128)
    scales  fp32 [G, tiles * 32]
    zoff    fp32 [G, tiles * 32]: zero - 8 (W4) or zero - 128 (W8); None when all are 0
            (symmetric checkpoints), which skips the correction entirely
    gstart  int32 [G + 1]: input rows sorted by group, each group padded to a multiple of 8
    src     int64 [Kp]: the input feature each packed row reads (-1 for padding), or None when
            that is the identity (no act-order, groups already aligned)

Output columns are padded to whole tiles of 32 with zero scales. Since rows are sorted by
group, act-order checkpoints cost one gather of x per call and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..gptq import GPTQWeight, pack_rows

TILE = 32  # csrc/kernels.h kTile


# csrc/kernels.h Format: signed (two's complement) or unsigned 4- and 5-bit fields, int8, fp16, fp32
W4, U4, W5, U5, W8, F16, F32 = 4, 3, 5, 6, 8, 16, 32


@dataclass(frozen=True)
class Packed:
    """Arguments of the extension's PackedLinear constructor."""

    format: int  # one of W4 … F32 above
    in_features: int
    out_features: int
    codes: torch.Tensor
    scales: torch.Tensor | None  # fp32, or fp16 (then zoff and mins are fp16 too)
    zoff: torch.Tensor | None
    gstart: torch.Tensor
    src: torch.Tensor | None
    mins: torch.Tensor | None = None
    hi: torch.Tensor | None = None  # W5/U5: the high-bit plane

    def build(self, ext):
        return ext.PackedLinear(self.format, self.in_features, self.out_features, self.codes, self.scales,
                                self.zoff, self.gstart, self.src, self.mins, self.hi)


def _tiles(n: int) -> int:
    return -(-n // TILE)


def _tile_major(rows_by_cols: torch.Tensor, fill) -> torch.Tensor:
    """[rows, N] -> [tiles, rows, 32], padding N up to whole tiles with `fill`."""
    rows, n = rows_by_cols.shape
    padded = torch.full((rows, _tiles(n) * TILE), fill, dtype=rows_by_cols.dtype)
    padded[:, :n] = rows_by_cols
    return padded.view(rows, -1, TILE).permute(1, 0, 2).contiguous()


def _pad_cols(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out = torch.zeros(t.shape[0], _tiles(t.shape[1]) * TILE, dtype=dtype)
    out[:, :t.shape[1]] = t
    return out


def group_layout(g_idx: torch.Tensor, num_groups: int, align: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Sort input rows by group and pad each group to a multiple of `align`.

    Returns src (int64 [Kp], -1 for padding), gstart (int32 [G + 1]) and the ids of the
    non-empty groups, in order (empty groups contribute nothing and are dropped).
    """
    g = g_idx.to(torch.int64)
    order = torch.argsort(g, stable=True)
    counts = torch.bincount(g, minlength=num_groups).tolist()
    src, gstart, kept, pos = [], [0], [], 0
    for gid, n in enumerate(counts):
        if n == 0:
            continue
        padded = -(-n // align) * align
        src.append(order[pos:pos + n])
        src.append(torch.full((padded - n,), -1, dtype=torch.int64))
        pos += n
        gstart.append(gstart[-1] + padded)
        kept.append(gid)
    return torch.cat(src), torch.tensor(gstart, dtype=torch.int32), kept


def pack_gptq(w: GPTQWeight) -> Packed:
    w = w.to("cpu")
    bits, k, n = w.bits, w.in_features, w.out_features
    groups = w.scales.shape[0]
    if int(w.g_idx.min()) < 0 or int(w.g_idx.max()) >= groups:
        raise ValueError(f"g_idx holds groups outside [0, {groups}) of the scales")
    src, gstart, kept = group_layout(w.g_idx, groups, align=8)
    offset = 1 << (bits - 1)
    q = w.codes()  # [K, N] int32
    rows = torch.where(src[:, None] >= 0, q[src.clamp(min=0)], offset)  # [Kp, N]; padding decodes to 0
    if bits == 4:
        codes = _tile_major(pack_rows(rows ^ 8, 4), 0)  # padded columns decode to 0
    else:
        codes = _tile_major((rows - offset).to(torch.int8), 0)
    kept_t = torch.tensor(kept, dtype=torch.int64)
    scales = _pad_cols(w.scales.to(torch.float32)[kept_t])
    zoff = (w.zeros()[kept_t] - offset).to(torch.float32)
    zoff = _pad_cols(zoff) if bool(zoff.ne(0).any()) else None
    identity = src.numel() == k and bool(torch.equal(src, torch.arange(k)))
    return Packed(bits, k, n, codes, scales.contiguous(), zoff, gstart, None if identity else src)


def pack_half(weight: torch.Tensor) -> Packed:
    """An [out, in] weight (already checked to be exact in fp16) as F16 tiles."""
    n, k = weight.shape
    codes = _tile_major(weight.t().to(torch.float16).view(torch.int16), 0)
    return Packed(16, k, n, codes, None, None, torch.tensor([0, k], dtype=torch.int32), None)


def pack_float(weight: torch.Tensor) -> Packed:
    """An fp32 [out, in] weight as F32 tiles."""
    n, k = weight.shape
    codes = _tile_major(weight.t().to(torch.float32), 0.0)
    return Packed(32, k, n, codes, None, None, torch.tensor([0, k], dtype=torch.int32), None)


def pack_int8_blocks(codes_nk: torch.Tensor, scales_ng: torch.Tensor, block: int) -> Packed:
    """An [out, in] weight equal to scale[o, i // block] * code[o, i] (int8), as W8 tiles."""
    n, k = codes_nk.shape
    groups = scales_ng.shape[1]
    codes = _tile_major(codes_nk.t().to(torch.int8), 0)
    gstart = torch.tensor([min(g * block, k) for g in range(groups + 1)], dtype=torch.int32)
    return Packed(8, k, n, codes, _pad_cols(scales_ng.t().to(torch.float32)).contiguous(), None, gstart, None)
