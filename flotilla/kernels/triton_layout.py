"""The kernel-side layout the Triton dequant-matmul kernels read, built once at load from GPTQ.

GPTQ packs `32 / bits` consecutive input rows of one output column into each int32 word, words
laid out [in * bits / 32, out]. The Triton kernels read the transpose, one row of words per
output column ([out, k_padded * bits / 32], so a tile of words is the tensor-core A operand of
y^T = W^T x^T), and inside each block of `block_k` input rows they order the fields so that one
32-bit AND/OR turns a word into two adjacent input rows as a packed pair of 16-bit floats:

    R = block_k * bits / 32 (words per column per block), P = 16 / bits (pairs per word)
    field f = t + P * j of word [n, b * R + r]  holds  q[b * block_k + t * 2R + 2r + j, n]

so `(word >> t * bits) & (mask | mask << 16)` holds rows (2r, 2r + 1) of the t-th run of 2R
rows in its low and high halves: the (k, k + 1) pair that one register of the matrix unit's A
fragment wants (triton_gemm).

Act-order (`g_idx` that is not `i // group_size`): the input rows are sorted by group once here
(`perm`), which makes every group a contiguous run of `group_size` rows; the kernels read the
activations through `perm` (x[:, perm[k]]).

Zero points: symmetric checkpoints (every zero the same value) keep the zero as a constant and
store no zero tensor; otherwise zeros are stored as uint8 [groups, out]. Scales stay fp16.
Float offsets (`offsets`, GGUF forms with a min: w = s * (q - z) + m; kernels.triton_ggml builds
them) are [groups, out] in the activation dtype, as are those forms' scales.
The input axis is padded with zero codes to a multiple of `block_k` (and the group tensors to
cover the padding); the kernels mask the activations there, so padding never contributes.

Needs only torch: builds and tests on any device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .gptq import GPTQWeight, check_bits


class UnsupportedLayout(ValueError):
    """The GPTQ weight cannot be expressed in the Triton layout (irregular act-order groups)."""


@dataclass(frozen=True)
class TritonLayout:
    words: torch.Tensor  # int32 [out, k_padded * bits / 32]
    scales: torch.Tensor  # fp16 [groups_padded, out]
    zeros: torch.Tensor | None  # uint8 [groups_padded, out]; None when every zero is `zero_const`
    zero_const: int  # the zero point of a symmetric weight (unused when zeros is not None)
    perm: torch.Tensor | None  # int32 [in]: kernel row k reads activation column perm[k]
    bits: int
    group_size: int  # input rows per group after the act-order sort (in_features if one group)
    block_k: int
    in_features: int
    out_features: int
    offsets: torch.Tensor | None = None  # [groups_padded, out] float offset m per group, or None

    @property
    def rows_per_field(self) -> int:
        """R: input rows held by one field position of a block's words."""
        return self.block_k * self.bits // 32

    @property
    def fields_per_word(self) -> int:
        return 32 // self.bits

    @property
    def k_padded(self) -> int:
        return self.words.shape[1] * self.fields_per_word

    def nbytes(self) -> int:
        """Bytes a kernel reads for the weight (codes, scales, zeros)."""
        total = self.words.numel() * 4 + self.scales.numel() * self.scales.element_size()
        total += self.offsets.numel() * self.offsets.element_size() if self.offsets is not None else 0
        return total + (self.zeros.numel() if self.zeros is not None else 0)


def sorted_groups(w: GPTQWeight) -> tuple[torch.Tensor | None, int]:
    """(perm or None, group size) such that rows perm sorted by group form equal runs."""
    k = w.in_features
    gs = k if w.group_size == -1 else w.group_size
    if not w.has_act_order:
        return None, gs
    g = w.g_idx.to(torch.int64)
    perm = torch.argsort(g, stable=True)
    expected = torch.arange(k, device=g.device) // gs
    if not torch.equal(g[perm], expected):
        raise UnsupportedLayout(f"g_idx groups are not runs of {gs} rows after sorting; "
                                f"the Triton layout needs every group to hold group_size rows")
    return perm.to(torch.int32), gs


def interleave_block_rows(q: torch.Tensor, bits: int, block_k: int) -> torch.Tensor:
    """Pack codes q [k_padded, out] into words [out, k_padded * bits / 32] (module docstring)."""
    fields = 32 // bits
    pairs = fields // 2
    rows, cols = q.shape
    r = block_k // fields
    # k = b * block_k + t * 2R + 2r + j  ->  [b, t, r, j, out]; field f = t + pairs * j
    q = q.to(torch.int64).reshape(rows // block_k, pairs, r, 2, cols)
    q = q.permute(0, 2, 3, 1, 4).reshape(rows // block_k, r, fields, cols)  # field index j * P + t
    shifts = (torch.arange(fields, dtype=torch.int64, device=q.device) * bits).view(1, 1, fields, 1)
    word = (q << shifts).sum(dim=2)  # [blocks, r, out], each < 2**32
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return word.reshape(rows // fields, cols).t().contiguous()


def default_block_k(bits: int, group_size: int) -> int:
    """256 rows at 4 bits, 128 at 8 (32 words of each column per block either way: more bytes in
    flight per load, fewer loop trips), halved while a group cannot hold a run of 2R rows."""
    block_k, fields = 256 if bits == 4 else 128, 32 // bits
    while 0 < group_size < block_k and group_size % (2 * block_k // fields) and block_k > 8 * fields:
        block_k //= 2
    return block_k


def repack(w: GPTQWeight, block_k: int | None = None) -> TritonLayout:
    """Build the Triton layout of a GPTQ weight on the weight's own device."""
    check_bits(w.bits)
    fields = 32 // w.bits
    if block_k is None:
        block_k = default_block_k(w.bits, w.group_size)
    if block_k & (block_k - 1) or block_k // fields < 8:
        raise ValueError(f"block_k={block_k} must be a power of two of at least {8 * fields} rows "
                         f"at {w.bits} bits (the matrix unit's 16-row step is two words deep)")
    perm, gs = sorted_groups(w)
    k, n = w.in_features, w.out_features
    r = block_k // fields
    one_group = gs >= k  # per-channel: every block reads group 0
    if not one_group and gs < block_k and (block_k % gs or gs % (2 * r)):
        raise UnsupportedLayout(f"group size {gs} does not tile blocks of {block_k} rows in runs of {2 * r}")
    if not one_group and gs > block_k and gs % block_k:
        raise UnsupportedLayout(f"group size {gs} is not a multiple of the {block_k}-row block")
    k_padded = -(-k // block_k) * block_k
    q = w.codes()  # [k, n]
    if perm is not None:
        q = q[perm.long()]
    if k_padded != k:
        q = torch.cat([q, q.new_zeros(k_padded - k, n)])
    words = interleave_block_rows(q, w.bits, block_k)
    if one_group:
        gs = k_padded
    groups = -(-k_padded // gs)
    scales = pad_rows(w.scales.to(torch.float16), groups)
    zeros = w.zeros()
    zero_vals = torch.unique(zeros)
    if zero_vals.numel() == 1:
        zero_const, zeros_t = int(zero_vals.item()), None
    else:
        zero_const, zeros_t = 0, pad_rows(zeros.to(torch.uint8), groups)
    return TritonLayout(words=words.contiguous(), scales=scales.contiguous(), zeros=zeros_t,
                        zero_const=zero_const, perm=perm, bits=w.bits, group_size=gs, block_k=block_k,
                        in_features=k, out_features=n)


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] >= rows:
        return t[:rows].contiguous()
    return torch.cat([t, t[-1:].expand(rows - t.shape[0], -1)]).contiguous()


def unpack_words(words: torch.Tensor, bits: int, block_k: int, rows: int) -> torch.Tensor:
    """Inverse of interleave_block_rows: words [cols, k_padded * bits / 32] -> codes [rows, cols]
    (int64), in the layout's row order."""
    fields = 32 // bits
    r = block_k // fields
    words = words.t().to(torch.int64) & 0xFFFFFFFF  # [k_padded / fields, cols]
    blocks = words.shape[0] // r
    w = words.reshape(blocks, r, 1, -1)
    shifts = (torch.arange(fields, device=words.device) * bits).view(1, 1, fields, 1)
    q = (w >> shifts) & ((1 << bits) - 1)  # [blocks, r, j * P + t, cols]
    q = q.reshape(blocks, r, 2, fields // 2, -1).permute(0, 3, 1, 2, 4)  # [b, t, r, j, cols]
    return q.reshape(blocks * block_k, -1)[:rows]


def unpack_layout(layout: TritonLayout) -> torch.Tensor:
    """Inverse of the packing: codes [in, out] in the original (unsorted) row order. For tests."""
    q = unpack_words(layout.words, layout.bits, layout.block_k, layout.in_features)
    if layout.perm is not None:
        out = torch.empty_like(q)
        out[layout.perm.long()] = q
        q = out
    return q.to(torch.int32)
