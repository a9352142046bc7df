"""GGUF (ggml) block types as quantized tensors: decoded once from the file's bytes, exact.

Every supported type becomes the same small in-memory form, a `GGMLWeight` of an [out, in] weight:

    codes   int8 [out, in]          one integer per weight
    scales  fp32 [out, in / group]  one scale per group of `group` consecutive inputs (16 or 32)
    mins    fp32 [out, in / group]  an offset per group, or None

    W[o, i] = scales[o, i // group] * codes[o, i]  (+ mins[o, i // group])

computed in fp32 exactly as ggml does: every product scale * code is exact in fp32 (a 11-bit fp16
significand times at most 6 + 7 bits of integers), so `dequantize()` equals
`gguf.quants.dequantize` of the same bytes bit for bit. Per type (q: the stored unsigned value):

    Q4_0  q - 8, scale d                      Q4_1  q, scale d, min m
    Q5_0  q - 16, scale d                     Q5_1  q, scale d, min m
    Q8_0  q (int8), scale d
    Q4_K  q, scale d * sc, min -(dmin * m)    per 32 of a 256 super-block (6-bit sc, m)
    Q5_K  the same with 5-bit q
    Q6_K  q - 32, scale d * sc                per 16 of a 256 super-block (int8 sc)

`GGML_FORMATS` describes each (code bits and range, group, min), which is all a kernel needs to
pack the form for its device. Decoding is vectorised numpy over all blocks at once (no loop over
blocks). This module imports nothing of flotilla's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK_K = 256


@dataclass(frozen=True)
class GGMLFormat:
    """What a kernel needs to know of a type's decoded form."""

    name: str
    block: int  # weights per GGUF block
    type_size: int  # bytes per GGUF block
    group: int  # weights per scale (and min)
    bits: int  # bits of a stored code
    code_min: int  # codes lie in [code_min, code_min + 2**bits - 1]
    has_min: bool
    fp16_scales: bool  # scales and mins are fp16 values (exact in fp16): Q4_0 … Q8_0, not the K types

    @property
    def code_max(self) -> int:
        return self.code_min + (1 << self.bits) - 1

    @property
    def bits_per_weight(self) -> float:
        return self.type_size * 8 / self.block


GGML_FORMATS: dict[str, GGMLFormat] = {f.name: f for f in (
    GGMLFormat("Q4_0", 32, 18, 32, 4, -8, False, True),
    GGMLFormat("Q4_1", 32, 20, 32, 4, 0, True, True),
    GGMLFormat("Q5_0", 32, 22, 32, 5, -16, False, True),
    GGMLFormat("Q5_1", 32, 24, 32, 5, 0, True, True),
    GGMLFormat("Q8_0", 32, 34, 32, 8, -128, False, True),
    GGMLFormat("Q4_K", QK_K, 144, 32, 4, 0, True, False),
    GGMLFormat("Q5_K", QK_K, 176, 32, 5, 0, True, False),
    GGMLFormat("Q6_K", QK_K, 210, 16, 6, -32, False, False),
)}


@dataclass(frozen=True, eq=False)
class GGMLWeight:
    """One [out, in] weight in a ggml type's decoded form (see the module docstring)."""

    qtype: str
    codes: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # fp32 [out, in / group]
    mins: torch.Tensor | None  # fp32 [out, in / group]

    @property
    def format(self) -> GGMLFormat:
        return GGML_FORMATS[self.qtype]

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in]: in fp32 bit for bit what ggml computes, then cast to `dtype`."""
        g = self.format.group
        w = self.codes.float().view(self.out_features, -1, g) * self.scales.unsqueeze(-1)  # [out, groups, g]
        if self.mins is not None:
            w = w + self.mins.unsqueeze(-1)
        return w.view(self.shape).to(dtype)

    def dequantize_rows(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `rows` [T] of the weight only (an embedding lookup): [T, in]."""
        return self.take_rows(rows).dequantize(dtype)

    def take_rows(self, rows: torch.Tensor) -> GGMLWeight:
        """The weight's rows `rows` (any order: a permutation, a gather or a slice as indices)."""
        mins = None if self.mins is None else self.mins.index_select(0, rows)
        return GGMLWeight(self.qtype, self.codes.index_select(0, rows), self.scales.index_select(0, rows), mins)

    def narrow(self, dim: int, start: int, length: int) -> GGMLWeight:
        """Outputs (dim 0) or inputs (dim 1) [start, start + length); inputs only at group boundaries."""
        if dim == 0:
            mins = None if self.mins is None else self.mins.narrow(0, start, length)
            return GGMLWeight(self.qtype, self.codes.narrow(0, start, length), self.scales.narrow(0, start, length),
                              mins)
        g = self.format.group
        if start % g or length % g:
            raise ValueError(f"{self.qtype} inputs can only be cut at multiples of its group of {g}, "
                             f"not [{start}, {start + length})")
        mins = None if self.mins is None else self.mins.narrow(1, start // g, length // g)
        return GGMLWeight(self.qtype, self.codes.narrow(1, start, length), self.scales.narrow(1, start // g, length // g),
                          mins)

    def to(self, device) -> GGMLWeight:
        mins = None if self.mins is None else self.mins.to(device)
        return GGMLWeight(self.qtype, self.codes.to(device), self.scales.to(device), mins)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scales, self.mins) if t is not None)

    @staticmethod
    def cat(parts: list[GGMLWeight]) -> GGMLWeight:
        """Stack weights of one type along the output axis."""
        types = {p.qtype for p in parts}
        if len(types) != 1:
            raise ValueError(f"cannot stack weights of different types {sorted(types)}")
        mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts])
        return GGMLWeight(parts[0].qtype, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                          mins)


def is_supported(qtype: str) -> bool:
    return qtype in GGML_FORMATS


def same_type_runs(parts: list) -> list[list]:
    """A merged linear's parts (GGMLWeight or dense tensors) as runs to pack together: consecutive
    GGMLWeights of one type, and each dense part alone."""
    runs: list[list] = []
    for p in parts:
        prev = runs[-1][0] if runs else None
        if isinstance(p, GGMLWeight) and isinstance(prev, GGMLWeight) and prev.qtype == p.qtype:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def decode(raw: np.ndarray, qtype: str, out_features: int, in_features: int) -> GGMLWeight:
    """A GGUF tensor's bytes (uint8, `out_features` rows of `in_features` weights) as a GGMLWeight.

    Reads `raw` once (it may be a memory-mapped view) and allocates only the decoded form."""
    fmt = GGML_FORMATS[qtype]
    if in_features % fmt.block:
        raise ValueError(f"a {qtype} row of {in_features} weights is not whole blocks of {fmt.block}")
    n_blocks = out_features * in_features // fmt.block
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n_blocks, fmt.type_size)
    codes, scales, mins = _DECODERS[qtype](blocks)
    groups = in_features // fmt.group

    def as_tensor(a: np.ndarray, cols: int, dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype).reshape(out_features, cols))

    return GGMLWeight(qtype, as_tensor(codes, in_features, np.int8), as_tensor(scales, groups, np.float32),
                      None if mins is None else as_tensor(mins, groups, np.float32))


# ------------------------------------------------------------------------------- the decoders
# Each takes blocks [n, type_size] (uint8) and returns codes [n, block], scales [n, block / group]
# and mins (or None), following ggml's (and gguf.quants') arithmetic exactly.

def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 field at byte `offset` of every block, as fp32 [n, 1]."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view(np.float16).astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """16 bytes a block -> 32 values: the low nibbles first, then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """A little-endian uint32 a block -> its 32 bits, bit j for value j: [n, 32] of 0/1."""
    bits = np.ascontiguousarray(qh).view(np.uint32) >> np.arange(32, dtype=np.uint32)  # [n, 32]
    return (bits & 1).astype(np.uint8)


def _q4_0(b):
    return _nibbles32(b[:, 2:18]).astype(np.int8) - np.int8(8), _f16(b, 0), None


def _q4_1(b):
    return _nibbles32(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _q5_0(b):
    q = _nibbles32(b[:, 6:22]) | (_high_bits32(b[:, 2:6]) << 4)
    return q.astype(np.int8) - np.int8(16), _f16(b, 0), None


def _q5_1(b):
    return _nibbles32(b[:, 8:24]) | (_high_bits32(b[:, 4:8]) << 4), _f16(b, 0), _f16(b, 2)


def _q8_0(b):
    return np.ascontiguousarray(b[:, 2:34]).view(np.int8), _f16(b, 0), None


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins packed in 12 bytes (Q4_K, Q5_K): [n, 8] each."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 values: per 32 bytes, 32 low nibbles then 32 high ones: [n, 8, 32]."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(-1, 8, 32)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K per-32 scale d * sc and min -(dmin * m), fp32 [n, 8] (each product exact)."""
    sc, mn = _k_scale_min(b[:, 4:16])
    return _f16(b, 0) * sc.astype(np.float32), -(_f16(b, 2) * mn.astype(np.float32))


def _q4_k(b):
    scales, mins = _k_scales(b)
    return _k_nibbles(b[:, 16:144]).reshape(-1, QK_K), scales, mins


def _q5_k(b):
    scales, mins = _k_scales(b)
    qh = b[:, 16:48].reshape(-1, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)  # [n, 1, 8, 32]
    q = _k_nibbles(b[:, 48:176]) | ((qh.reshape(-1, 8, 32) & 1) << 4)
    return q.reshape(-1, QK_K), scales, mins


def _q6_k(b):
    ql = b[:, 0:128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)  # [n, 2, 2, 64]
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = (ql & 0x0F).reshape(-1, 8, 32) | ((qh & 0x03).reshape(-1, 8, 32) << 4)  # [n, 8, 32]
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)  # [n, 16]
    return q.reshape(-1, QK_K).astype(np.int8) - np.int8(32), _f16(b, 208) * sc, None


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
             "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
