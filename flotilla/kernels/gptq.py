"""The GPTQ tensor layout, bit for bit.

Per quantized linear with `in_features` inputs and `out_features` outputs:

    qweight  int32 [in * bits / 32, out]   packed along the input axis, LSB first:
                                           qweight[r, o] holds q[r * 32/bits + j, o] in bits
                                           [j * bits, (j + 1) * bits)
    qzeros   int32 [groups, out * bits / 32] packed along the output axis, LSB first; each
                                           field holds (zero - 1) (the "gptq" / v1 convention)
    scales   fp16  [groups, out]
    g_idx    int32 [in]                    the group of each input row

    W[i, o] = scales[g_idx[i], o] * (q[i, o] - zero[g_idx[i], o])

Groups: without act-order g_idx[i] = i // group_size and there are ceil(in / group_size) groups;
a group size that does not divide `in` leaves the last group short (576 inputs at group 128:
four groups of 128 and one of 64). group_size -1 is one group over the whole input axis.

Only 4 and 8 bits are supported: their fields never straddle an int32 word. A stored zero field
is read as `field + 1` without masking, exactly as AutoGPTQ, GPTQModel, vLLM and transformers do;
a writer must therefore keep zeros in [1, 2**bits - 1]. GPTQModel's "gptq_v2" format stores the
zero itself (`zero_offset` 0, zeros in [0, 2**bits - 1]); flotilla reads AutoAWQ and bitsandbytes
checkpoints into that form (models/awq_layout.py, models/bnb_layout.py).

This module imports nothing of flotilla's; the checkpoint format module and every kernel use it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (4, 8)


def check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bit width {bits}: expected one of {SUPPORTED_BITS}")


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes [rows, cols] into int32 [rows * bits / 32, cols] along dim 0."""
    check_bits(bits)
    per_word = 32 // bits
    rows, cols = q.shape
    if rows % per_word:
        raise ValueError(f"cannot pack {rows} rows at {bits} bits: rows must be a multiple of {per_word}")
    q = q.to(torch.int64).reshape(rows // per_word, per_word, cols)
    shifts = (torch.arange(per_word, dtype=torch.int64, device=q.device) * bits).view(1, per_word, 1)
    word = (q << shifts).sum(dim=1)  # [rows/per_word, cols], each < 2**32
    return _as_int32(word)


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_rows: int32 [R, cols] -> int32 codes [R * 32 / bits, cols]."""
    check_bits(bits)
    per_word = 32 // bits
    shifts = (torch.arange(per_word, dtype=torch.int32, device=packed.device) * bits).view(1, per_word, 1)
    codes = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)  # [R, per_word, cols]
    return codes.reshape(packed.shape[0] * per_word, packed.shape[1])


def pack_cols(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes [rows, cols] into int32 [rows, cols * bits / 32] along dim 1."""
    return pack_rows(q.t(), bits).t().contiguous()


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    return unpack_rows(packed.t(), bits).t().contiguous()


def _as_int32(word: torch.Tensor) -> torch.Tensor:
    # Reinterpret unsigned 32-bit values held in int64 as int32 bit patterns.
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def default_g_idx(in_features: int, group_size: int, device=None) -> torch.Tensor:
    gs = in_features if group_size == -1 else group_size
    return (torch.arange(in_features, dtype=torch.int32, device=device) // gs).to(torch.int32)


def num_groups(in_features: int, group_size: int) -> int:
    """Rows of scales/qzeros: ceil(in / group_size), the last group possibly partial."""
    return 1 if group_size == -1 else -(-in_features // group_size)


def group_width(in_features: int, group_size: int) -> int:
    """The inputs a group spans where they are padded to whole groups: the group size, or the input
    itself where one group covers it (-1, or a group at least as wide: padding to it would only add
    zeros, up to 7x the work for a 4096-wide group on a 576-wide input)."""
    return in_features if group_size == -1 or group_size >= in_features else group_size


@dataclass
class GPTQWeight:
    """The four GPTQ tensors of one linear, plus what is needed to read them."""

    qweight: torch.Tensor  # int32 [in * bits / 32, out]
    qzeros: torch.Tensor  # int32 [groups, out * bits / 32]
    scales: torch.Tensor  # fp16 [groups, out]
    g_idx: torch.Tensor  # int32 [in]
    bits: int
    group_size: int  # -1: one group over the whole input axis
    zero_offset: int = 1  # added to a stored zero field: 1 in the "gptq" (v1) format, 0 in "gptq_v2"

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * 32 // self.bits

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def has_act_order(self) -> bool:
        """True when g_idx is not the plain i // group_size mapping."""
        expected = default_g_idx(self.in_features, self.group_size, self.g_idx.device)
        return not torch.equal(self.g_idx.to(torch.int32), expected)

    def codes(self) -> torch.Tensor:
        """Integer codes q [in, out] (int32)."""
        return unpack_rows(self.qweight, self.bits)

    def zeros(self) -> torch.Tensor:
        """Zero points [groups, out] (int32), with the stored offset (+1 in the gptq format) applied."""
        return unpack_cols(self.qzeros, self.bits) + self.zero_offset

    @classmethod
    def from_codes(cls, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                   g_idx: torch.Tensor, bits: int, group_size: int, zero_offset: int = 1) -> "GPTQWeight":
        """Pack codes q [in, out] and zero points [groups, out] into the GPTQ layout (zero_offset 1:
        the "gptq" format, 0: "gptq_v2")."""
        check_bits(bits)
        if int(zeros.min()) < zero_offset or int(zeros.max()) > (1 << bits) - 1:
            fmt = "gptq" if zero_offset else "gptq_v2"
            raise ValueError(f"zero points must lie in [{zero_offset}, {(1 << bits) - 1}] for the {fmt} format")
        return cls(
            qweight=pack_rows(q, bits),
            qzeros=pack_cols(zeros - zero_offset, bits),
            scales=scales.to(torch.float16).contiguous(),
            g_idx=g_idx.to(torch.int32).contiguous(),
            bits=bits,
            group_size=group_size,
            zero_offset=zero_offset,
        )

    def to(self, device) -> "GPTQWeight":
        return GPTQWeight(self.qweight.to(device), self.qzeros.to(device), self.scales.to(device),
                          self.g_idx.to(device), self.bits, self.group_size, self.zero_offset)
