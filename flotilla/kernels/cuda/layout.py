"""The weight layout the CUDA kernels read (csrc/wqa16.cuh), built once at load from GPTQ.

The input axis is cut into slices of 16 rows and the output axis into chunks of 64 columns. One
(slice, chunk) unit is 32 lanes x 16 bytes at 4 bits (x 2 at 8 bits): exactly what the 32 lanes
of a warp hold as the B operands of eight m16n8k16 tensor-core MMAs (n8 tiles i = 0..7, tile i =
columns 8i..8i+7 of the chunk). Lane l = 4g + t holds rows (2t, 2t+1, 2t+8, 2t+9) of column
8i + g of every tile:

  4 bits: word j (of 4) holds tiles a = 2j and b = 2j + 1; nibble p = r*4 + h*2 + e holds row
          2t + r + 8h of tile a (e = 0) or b (e = 1). So (w & 0x000f000f) is tile a's rows
          (2t, 2t+1) as the low nibbles of two 16-bit halves, (w & 0x00f000f0) tile b's, and
          w >> 8 the same for rows + 8.
  8 bits: 16-byte load h (of 2), word v (of 4) holds tile 4h + v; byte p = h'*2 + r holds row
          2t + r + 8h'.

Units are stored [slice][chunk][load][lane], so a block's tile of several chunks of one slice is
one contiguous run. Scales (and zero points of asymmetric weights) are stored in the activation
dtype as [group][chunk][g][i]: lane g's eight scales, one per tile, are one 16-byte load.

Act-order (`g_idx` that is not i // group_size): rows are sorted by group once here (`perm`);
the activations are gathered through `perm` before the kernel. The input axis is padded with
zero codes to a multiple of K_ALIGN and the output axis to a multiple of N_ALIGN (the kernels
zero-fill activations past in_features and never store columns past out_features). A group that
does not divide in_features leaves a short last group, which needs nothing special. Group
sizes must be multiples of 16 rows (a slice never straddles two groups), 32 at least.

Needs only torch: builds and tests on any device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..gptq import GPTQWeight, check_bits
from ..triton_layout import UnsupportedLayout, sorted_groups

K_ALIGN = 256  # a multiple of every tile's k extent (wqa16.cuh K_ALIGN)
N_ALIGN = 256  # a multiple of every tile's n extent (wqa16.cuh N_ALIGN)
SLICE_ROWS = 16
CHUNK_COLS = 64


class UnsupportedCudaLayout(ValueError):
    """The weight cannot be expressed in the CUDA layout; callers fall back to another kernel."""


@dataclass(frozen=True)
class CudaLayout:
    words: torch.Tensor  # int32 [k_pad / 16, n_pad / 64, bits / 4, 32, 4]
    scales: torch.Tensor  # dtype [groups_pad, n_pad / 64, 8, 8]
    zeros: torch.Tensor | None  # dtype, as scales; None when every zero is `zero_const`
    zero_const: int
    perm: torch.Tensor | None  # int64 [in]: kernel row k reads activation column perm[k]
    bits: int
    group_size: int  # rows per group after the act-order sort (k_pad when one group)
    in_features: int
    out_features: int

    @property
    def k_pad(self) -> int:
        return self.words.shape[0] * SLICE_ROWS

    @property
    def n_pad(self) -> int:
        return self.words.shape[1] * CHUNK_COLS

    @property
    def groups_pad(self) -> int:
        return self.scales.shape[0]

    @property
    def group_magic(self) -> int:
        """ceil(2^32 / slices per group) (at least 2 slices a group): the kernels map a slice s to
        its group as (s * magic) >> 32, exact for s * slices_per_group < 2^32."""
        d = self.group_size // SLICE_ROWS
        return ((1 << 32) + d - 1) // d

    def nbytes(self) -> int:
        """Bytes a kernel reads for the weight (codes, scales, zeros)."""
        total = self.words.numel() * 4 + self.scales.numel() * self.scales.element_size()
        return total + (self.zeros.numel() * self.zeros.element_size() if self.zeros is not None else 0)


def repack(w: GPTQWeight, dtype: torch.dtype) -> CudaLayout:
    """Build the CUDA layout of a GPTQ weight on the weight's own device, for activations of
    `dtype` (float16 or bfloat16: the scales are stored in it)."""
    check_bits(w.bits)
    if dtype not in (torch.float16, torch.bfloat16):
        raise UnsupportedCudaLayout(f"the CUDA kernels compute in float16 or bfloat16, not {dtype}")
    k, n = w.in_features, w.out_features
    if k % 8:
        raise UnsupportedCudaLayout(f"in_features={k} is not a multiple of 8 (16-byte activation loads)")
    try:
        perm, gs = sorted_groups(w)
    except UnsupportedLayout as e:
        raise UnsupportedCudaLayout(str(e)) from e
    k_pad, n_pad = -(-k // K_ALIGN) * K_ALIGN, -(-n // N_ALIGN) * N_ALIGN
    if gs >= k:
        gs = k_pad  # one group
    elif gs % SLICE_ROWS or gs < 2 * SLICE_ROWS:
        raise UnsupportedCudaLayout(f"group size {gs} is not a multiple of {SLICE_ROWS} rows of at least {2 * SLICE_ROWS}")
    groups = -(-k_pad // gs)
    q = w.codes()
    if perm is not None:
        q = q[perm.long()]
    words = interleave(_pad(q, k_pad, n_pad), w.bits)
    scales = _pad(_pad_groups(w.scales.float(), groups), groups, n_pad).to(dtype)
    zeros = w.zeros()
    zero_vals = torch.unique(zeros)
    zero_const, zeros_t = (int(zero_vals.item()), None) if zero_vals.numel() == 1 else (0, zeros)
    if zeros_t is not None:
        zeros_t = order_groups(_pad(_pad_groups(zeros_t.float(), groups), groups, n_pad).to(dtype))
    return CudaLayout(words=words, scales=order_groups(scales), zeros=zeros_t, zero_const=zero_const,
                      perm=None if perm is None else perm.long(), bits=w.bits, group_size=gs,
                      in_features=k, out_features=n)


def _pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if t.shape == (rows, cols):
        return t
    out = t.new_zeros(rows, cols)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def _pad_groups(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Rows for the padded input axis' groups: copies of the last group (finite, never used)."""
    if t.shape[0] >= groups:
        return t[:groups]
    return torch.cat([t, t[-1:].expand(groups - t.shape[0], -1)])


def order_groups(t: torch.Tensor) -> torch.Tensor:
    """[groups, n_pad] -> [groups, n_pad / 64, 8 (g), 8 (i)]: column c*64 + 8i + g at [c, g, i]."""
    groups, n_pad = t.shape
    return t.reshape(groups, n_pad // CHUNK_COLS, 8, 8).transpose(2, 3).contiguous()


def unorder_groups(t: torch.Tensor) -> torch.Tensor:
    groups, chunks = t.shape[:2]
    return t.transpose(2, 3).reshape(groups, chunks * CHUNK_COLS)




def interleave(q: torch.Tensor, bits: int, chunk_slices: int = 64) -> torch.Tensor:
    """Codes [k_pad, n_pad] -> int32 words [k_pad / 16, n_pad / 64, bits / 4, 32, 4]."""
    rows, cols = q.shape
    kk_total, nc = rows // SLICE_ROWS, cols // CHUNK_COLS
    out = torch.empty((kk_total, nc, bits // 4, 32, 4), dtype=torch.int32, device=q.device)
    fields = 32 // bits
    shifts = torch.arange(fields, dtype=torch.int64, device=q.device) * bits
    for s0 in range(0, kk_total, chunk_slices):
        s1 = min(kk_total, s0 + chunk_slices)
        part = q[s0 * SLICE_ROWS: s1 * SLICE_ROWS].to(torch.int64)
        if bits == 4:
            # [KK, h, t, r, C, j, e, g] -> [KK, C, g, t, j, r, h, e]; lane = 4g + t
            v = part.reshape(s1 - s0, 2, 4, 2, nc, 4, 2, 8).permute(0, 4, 7, 2, 5, 3, 1, 6)
            v = v.reshape(s1 - s0, nc, 1, 32, 4, fields)
        else:
            # [KK, h', t, r, C, h, v, g] -> [KK, C, h, g, t, v, h', r]
            v = part.reshape(s1 - s0, 2, 4, 2, nc, 2, 4, 8).permute(0, 4, 5, 7, 2, 6, 1, 3)
            v = v.reshape(s1 - s0, nc, 2, 32, 4, fields)
        word = (v << shifts).sum(dim=-1)  # each < 2**32
        out[s0:s1] = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return out


def deinterleave(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of interleave: words -> codes [k_pad, n_pad] (int32)."""
    kk_total, nc = words.shape[:2]
    fields = 32 // bits
    shifts = torch.arange(fields, dtype=torch.int64, device=words.device) * bits
    f = ((words.to(torch.int64) & 0xFFFFFFFF).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    if bits == 4:
        f = f.reshape(kk_total, nc, 8, 4, 4, 2, 2, 2)  # [KK, C, g, t, j, r, h, e]
        q = f.permute(0, 6, 3, 5, 1, 4, 7, 2)  # [KK, h, t, r, C, j, e, g]
    else:
        f = f.reshape(kk_total, nc, 2, 8, 4, 4, 2, 2)  # [KK, C, h, g, t, v, h', r]
        q = f.permute(0, 6, 4, 7, 1, 2, 5, 3)  # [KK, h', t, r, C, h, v, g]
    return q.reshape(kk_total * SLICE_ROWS, nc * CHUNK_COLS).to(torch.int32)


def unpack_layout(layout: CudaLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [in, out], zero points [in, out], scales [in, out] as float32), in the original row
    order: the weight is scales * (codes - zeros). For tests."""
    k, n = layout.in_features, layout.out_features
    q = deinterleave(layout.words, layout.bits)[:k, :n]
    rows = torch.arange(k, device=q.device) // layout.group_size
    s = unorder_groups(layout.scales).float()[rows, :n]
    if layout.zeros is None:
        z = torch.full_like(q, layout.zero_const)
    else:
        z = unorder_groups(layout.zeros).float()[rows, :n].round().to(torch.int32)
    if layout.perm is not None:
        inv = torch.empty_like(layout.perm)
        inv[layout.perm] = torch.arange(k, device=inv.device)
        q, z, s = q[inv], z[inv], s[inv]
    return q, z, s
