"""Triton kernels for GGUF forms (flotilla.kernels.ggml) on CUDA: y = x @ W^T, 16-bit activations.

GPU layout of one part (a run of output rows of one type), repacked once at load:

    4-bit (Q4_0, Q4_1, Q4_K)   words int32 [K / 8, N]: word w holds inputs 8w..8w+7 of column n,
                               LSB first, each field code - CODE_MIN (0..15)
    others (Q8_0, Q5_*, Q6_K)  codes int8 [K, N], the code itself
    scales, mins               [K / group, N]: fp16 where the type's are fp16 (Q4_0 … Q8_0), else
                               fp32 (the K types' d * sc); mins only for types with a min

    W[k, n] = scale[k // group, n] * code[k, n] (+ min[k // group, n])

One program owns a [BLOCK_M rows, BLOCK_N columns] tile and a run of groups of the input axis
(split-K over the grid's third axis; the splits' fp32 partials are summed afterwards). Per group:
the codes — small integers, exact in fp16 and bf16 — go through the tensor cores against the
activations, part = x[:, g] @ code[g, :] (fp32), and then acc += part * scale[g] + xsum[g] * min[g]
with xsum the activations' sum over the group: the scales stay in fp32, as in the file.

`TritonGGMLKernel(parts, device, dtype)` takes a merged linear's parts (GGMLWeight or dense
tensors; runs of one type share a launch, dense parts go through torch) and writes each into its
columns of one output. Runs under TRITON_INTERPRET=1 on CPU tensors (how the tests check it).
This module imports Triton lazily through `triton_ggml_kernel`, and nothing of flotilla's.
"""
from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from .ggml import GGMLWeight, same_type_runs

TRITON_FORMS = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def ggml_dot_kernel(x_ptr, w_ptr, s_ptr, m_ptr, part_ptr, M, N, K, stride_xm,
                        GROUP: tl.constexpr, BITS: tl.constexpr, CODE_MIN: tl.constexpr, HAS_MIN: tl.constexpr,
                        GROUPS_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, GROUP)
        m_ok, n_ok = offs_m < M, offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        groups = K // GROUP
        for i in range(GROUPS_PER_SPLIT):
            g = split * GROUPS_PER_SPLIT + i
            if g < groups:
                k = g * GROUP + offs_k
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None], other=0.0)
                if BITS == 4:
                    words = tl.load(w_ptr + (k // 8)[:, None] * N + offs_n[None, :], mask=n_ok[None, :], other=0)
                    codes = ((words >> ((k % 8) * 4)[:, None]) & 0xF) + CODE_MIN
                else:
                    codes = tl.load(w_ptr + k[:, None] * N + offs_n[None, :], mask=n_ok[None, :], other=0)
                part = tl.dot(x, codes.to(tl.float32).to(x.dtype))  # [BLOCK_M, BLOCK_N]: small ints, exact
                s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
                acc += part * s[None, :]
                if HAS_MIN:
                    mn = tl.load(m_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
                    xsum = tl.sum(x.to(tl.float32), axis=1)
                    acc += xsum[:, None] * mn[None, :]
        out = part_ptr + split * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])

    return triton, ggml_dot_kernel


class TritonGGMLPart:
    """One run of same-type parts in the GPU layout."""

    def __init__(self, w: GGMLWeight, device: torch.device):
        fmt = w.format
        self.qtype, self.group, self.has_min = w.qtype, fmt.group, w.mins is not None
        self.out_features, self.in_features = w.shape
        codes = w.codes.t()  # [K, N] int8
        if fmt.bits == 4:
            self.bits, self.code_min = 4, fmt.code_min
            fields = (codes.to(torch.int32) - fmt.code_min).view(self.in_features // 8, 8, self.out_features)
            words = torch.zeros(self.in_features // 8, self.out_features, dtype=torch.int32, device=codes.device)
            for j in range(8):
                words |= fields[:, j] << (4 * j)
            self.codes = words.to(device)
        else:
            self.bits, self.code_min = 8, 0
            self.codes = codes.contiguous().to(device)
        table = torch.float16 if fmt.fp16_scales else torch.float32
        self.scales = w.scales.t().to(table).contiguous().to(device)  # [G, N]
        self.mins = w.mins.t().to(table).contiguous().to(device) if self.has_min else self.scales

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scales)) + (self.mins.nbytes if self.has_min else 0)

    def launch(self, x2: torch.Tensor, out: torch.Tensor) -> None:
        """out [M, N] (a column slice of the linear's output) = x2 [M, K] @ this part^T."""
        triton, kernel = _kernels()
        M, N, K = x2.shape[0], self.out_features, self.in_features
        block_m = 16 if M <= 16 else 32 if M <= 32 else 64
        block_n = 64 if M <= 16 else 128
        groups = K // self.group
        tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
        split = max(1, min(groups, 512 // max(1, tiles))) if M <= 64 else 1  # decode: fill the GPU
        per_split = triton.cdiv(groups, split)
        split = triton.cdiv(groups, per_split)
        partial = torch.empty(split, M, N, dtype=torch.float32, device=x2.device)
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), split)
        kernel[grid](x2, self.codes, self.scales, self.mins, partial, M, N, K, x2.stride(0),
                     GROUP=self.group, BITS=self.bits, CODE_MIN=self.code_min, HAS_MIN=self.has_min,
                     GROUPS_PER_SPLIT=per_split, BLOCK_M=block_m, BLOCK_N=block_n)
        out.copy_(partial.sum(0) if split > 1 else partial[0])

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Weight rows `ids` (output columns), dequantized in fp32 then cast: [T, K]."""
        if self.bits == 4:
            words = self.codes[:, ids]  # [K / 8, T]
            shifts = torch.arange(8, device=words.device, dtype=torch.int32).view(1, 8, 1) * 4
            codes = ((words.unsqueeze(1) >> shifts) & 0xF).reshape(self.in_features, -1) + self.code_min
        else:
            codes = self.codes[:, ids].to(torch.int32)
        w = codes.float().view(-1, self.group, ids.numel()) * self.scales[:, ids].float().unsqueeze(1)
        if self.has_min:
            w = w + self.mins[:, ids].float().unsqueeze(1)
        return w.view(self.in_features, -1).t().to(dtype)


class TritonGGMLKernel:
    """A merged linear's parts on CUDA: Triton for the GGUF forms, torch for dense parts."""

    def __init__(self, parts: list, device: torch.device, dtype: torch.dtype):
        self.dtype = dtype
        self.runs: list[tuple[int, int, object]] = []  # (first column, columns, TritonGGMLPart or dense weight)
        self.part_forms: list[str] = []
        col = 0
        for run in same_type_runs(parts):
            n = sum(p.shape[0] for p in run)
            if isinstance(run[0], GGMLWeight):
                op = TritonGGMLPart(GGMLWeight.cat(run) if len(run) > 1 else run[0], device)
                table = "fp16" if run[0].format.fp16_scales else "fp32"
                codes = "4-bit" if op.bits == 4 else "int8"
                self.part_forms += [f"triton {codes} x {table} scale{' + min' if op.has_min else ''} per {op.group}"] * len(run)
            else:
                op = run[0].to(device=device, dtype=dtype)
                self.part_forms.append(f"{str(dtype)[6:]} (torch)")
            self.runs.append((col, n, op))
            col += n
        self.in_features, self.out_features = parts[0].shape[1], col
        self.name = "triton " + "+".join(dict.fromkeys(f.split(" x ")[0].split(" (")[0][7:] or f for f in self.part_forms))

    @property
    def nbytes(self) -> int:
        return sum(op.nbytes for _, _, op in self.runs)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        y = torch.empty(x2.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        for col, n, op in self.runs:
            if isinstance(op, TritonGGMLPart):
                op.launch(x2, y[:, col:col + n])
            else:
                y[:, col:col + n] = F.linear(x2, op)
        if bias is not None:
            y += bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        col, n, op = self.runs[0]
        if len(self.runs) != 1:
            raise ValueError("row lookups need a single-part weight (an embedding)")
        return op.rows(ids, self.dtype) if isinstance(op, TritonGGMLPart) else F.embedding(ids, op)


def triton_ggml_kernel(parts: list, device: torch.device, dtype: torch.dtype):
    """The Triton kernel for these parts on a CUDA device with fp16/bf16 activations, or None."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    if importlib.util.find_spec("triton") is None:
        return None
    if any(isinstance(p, GGMLWeight) and p.qtype not in TRITON_FORMS for p in parts):
        return None
    return TritonGGMLKernel(parts, device, dtype)
