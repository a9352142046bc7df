"""GGUF forms (flotilla.kernels.ggml) on CUDA: repacked at load into the GPTQ Triton layout
(kernels.triton_layout) and run by the same dequant-matmul kernel (triton_gemm.w_dot_kernel).

Per form, the layout's codes u = code - code_min (unsigned), the zero and the group:

    Q4_0                4-bit words, zero 8,   group 32   w = d * (u - 8)
    Q4_1, Q4_K          4-bit words, zero 0,   group 32   w = s * u + m   (float offset per group)
    Q8_0                8-bit words, zero 128, group 32   w = d * (u - 128)
    Q5_0                8-bit words, zero 16,  group 32
    Q5_1, Q5_K          8-bit words, zero 0,   group 32   float offset per group
    Q6_K                8-bit words, zero 32,  group 16

(5- and 6-bit codes take the 8-bit layout: their fields would straddle the 32-bit words.)
Group 32 sets the layout's block to 128 rows at 4 bits and 64 at 8 (32 at group 16), so that a
run of the pair decode lies in one group; the scale (and offset) is applied on the weight side,
one packed multiply (fused multiply-add with the offset) per pair of weights.

Precision on the GPU: the scales and offsets are stored in the activation dtype. Q4_0, Q8_0 and
Q5_0 in fp16 dequantize bit for bit as `GGMLWeight.dequantize(torch.float16)` (d is an fp16 value
and d * (u - z) is rounded once either way); the offset forms round d * u + m once (the CPU
truth rounds the fp32 sum, so a weight may differ by one fp16 ulp); the K types' fp32 products
d * sc and dmin * m are rounded to the activation dtype first (relative 2^-11 in fp16, 2^-8 in
bf16). The exact forms stay the CPU's (kernels/ggml.py, kernels/cpu).

`TritonGGMLKernel(parts, device, dtype)` takes a merged linear's parts (GGMLWeight or dense
tensors; runs of one type share a launch, dense parts go through torch) and writes each into its
columns of one output. Runs under TRITON_INTERPRET=1 on CPU tensors (how the tests check it).
This module imports Triton lazily (through triton_linear), and nothing of flotilla's.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from .fused import silu_mul
from .ggml import GGMLWeight, same_type_runs
from .triton_layout import TritonLayout, default_block_k, interleave_block_rows, pad_rows, unpack_words
from .triton_linear import TritonLayoutKernel

TRITON_FORMS = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")
REPACK_COLUMNS = 4096  # output columns repacked at a time (bounds the int64 temporaries)


def repack_ggml(w: GGMLWeight, dtype: torch.dtype, device: torch.device | str) -> TritonLayout:
    """The Triton layout of a GGUF form on `device`, scales and offsets in `dtype`."""
    fmt = w.format
    bits = 4 if fmt.bits == 4 else 8
    block_k = default_block_k(bits, fmt.group)
    k, n = w.in_features, w.out_features
    k_padded = -(-k // block_k) * block_k
    chunks = []
    for c in range(0, n, REPACK_COLUMNS):
        codes = w.codes[c:c + REPACK_COLUMNS].to(device)  # [cols, K] int8
        q = codes.t().to(torch.int32) - fmt.code_min  # [K, cols], unsigned codes
        if k_padded != k:
            q = torch.cat([q, q.new_zeros(k_padded - k, q.shape[1])])
        chunks.append(interleave_block_rows(q, bits, block_k))  # [cols, k_padded * bits / 32]
    groups = k_padded // fmt.group

    def table(t: torch.Tensor) -> torch.Tensor:  # [N, K / group] fp32 -> [groups_padded, N]
        return pad_rows(t.to(device).t().to(dtype), groups)

    return TritonLayout(words=torch.cat(chunks).contiguous(), scales=table(w.scales), zeros=None,
                        zero_const=-fmt.code_min, perm=None, bits=bits, group_size=fmt.group, block_k=block_k,
                        in_features=k, out_features=n, offsets=table(w.mins) if fmt.has_min else None)


def layout_rows(layout: TritonLayout, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` (output features) of a repacked GGUF form, dequantized in fp32 then cast: [T, K]."""
    ids = ids.reshape(-1)
    k, g = layout.in_features, layout.group_size
    q = unpack_words(layout.words.index_select(0, ids), layout.bits, layout.block_k, k)  # [K, T]
    groups = k // g
    w = (q.float() - layout.zero_const).view(groups, g, -1)  # [groups, g, T]
    w = w * layout.scales[:groups].index_select(1, ids).float().unsqueeze(1)
    if layout.offsets is not None:
        w = w + layout.offsets[:groups].index_select(1, ids).float().unsqueeze(1)
    # contiguous [T, K]: the step's fused norm (kernels/fused) takes the embedded rows only so (the transposed
    # view went to the torch expression on every step with more than one token)
    return w.view(k, -1).t().to(dtype).contiguous()  # (to() alone keeps the transposed strides)


def part_form(layout: TritonLayout) -> str:
    table = str(layout.scales.dtype)[6:]
    offset = " + min" if layout.offsets is not None else ""
    return f"triton {layout.bits}-bit x {table} scale{offset} per {layout.group_size}"


class TritonGGMLKernel:
    """A merged linear's parts on CUDA: the Triton layout kernel for the GGUF forms, torch for
    dense parts."""

    def __init__(self, parts: list, device: torch.device, dtype: torch.dtype):
        self.dtype = dtype
        self.runs: list[tuple[int, int, object]] = []  # (first column, columns, TritonLayoutKernel or dense weight)
        self.part_forms: list[str] = []
        col = 0
        for run in same_type_runs(parts):
            n = sum(p.shape[0] for p in run)
            if isinstance(run[0], GGMLWeight):
                op = TritonLayoutKernel(repack_ggml(GGMLWeight.cat(run) if len(run) > 1 else run[0], dtype, device),
                                        dtype)
                self.part_forms += [part_form(op.layout)] * len(run)
            else:
                op = run[0].to(device=device, dtype=dtype)
                self.part_forms.append(f"{str(dtype)[6:]} (torch)")
            self.runs.append((col, n, op))
            col += n
        self.in_features, self.out_features = parts[0].shape[1], col
        self.name = "triton " + "+".join(dict.fromkeys(f.split(" x ")[0].split(" (")[0][7:] or f for f in self.part_forms))

    @property
    def nbytes(self) -> int:
        return sum(op.layout.nbytes() if isinstance(op, TritonLayoutKernel) else op.nbytes for _, _, op in self.runs)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        if len(self.runs) == 1 and isinstance(self.runs[0][2], TritonLayoutKernel):
            y = self.runs[0][2](x2, bias)
            return y.view(*x.shape[:-1], self.out_features)
        y = torch.empty(x2.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        for col, n, op in self.runs:
            b = None if bias is None else bias[col:col + n]
            if isinstance(op, TritonLayoutKernel):
                op(x2, b, out=y[:, col:col + n])
            else:
                y[:, col:col + n] = F.linear(x2, op, None if b is None else b.to(op.dtype))
        return y.view(*x.shape[:-1], self.out_features)

    def silu_mul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """silu(gate) * up of a [gate | up] linear [..., 2 I] -> [..., I]: one launch where its parts are
        one run of one GGUF form (TritonLayoutKernel.silu_mul: the Triton tiles' or the GEMV's epilogue),
        else the product, then kernels/fused.silu_mul."""
        op = self.runs[0][2]
        if len(self.runs) == 1 and isinstance(op, TritonLayoutKernel):
            x2 = x.reshape(-1, self.in_features)
            return op.silu_mul(x2, bias).view(*x.shape[:-1], self.out_features // 2)
        return silu_mul(self(x, bias))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        op = self.runs[0][2]
        if len(self.runs) != 1:
            raise ValueError("row lookups need a single-part weight (an embedding)")
        if isinstance(op, TritonLayoutKernel):
            return layout_rows(op.layout, ids, self.dtype).view(*ids.shape, self.in_features)
        return F.embedding(ids, op)


def triton_ggml_kernel(parts: list, device: torch.device, dtype: torch.dtype):
    """The Triton kernel for these parts on a CUDA device with fp16/bf16 activations, or None."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    if importlib.util.find_spec("triton") is None:
        return None
    if any(isinstance(p, GGMLWeight) and p.qtype not in TRITON_FORMS for p in parts):
        return None
    return TritonGGMLKernel(parts, device, dtype)
