"""The CUDA-core GEMV over the Triton layout (flotilla/kernels/cuda/gemv.py, csrc/gemv.cuh).

On any machine: a numpy emulation of exactly what every lane of the kernel reads and computes —
its strip and lane to block, run, group (the magic multiply and the reload every TPG runs), the x
rows it multiplies; the fp16 pair decode (the LOP3 masks under 0x6400, HADD2 / HFMA2 by 1/16 to
q - z, the packed zero constants built from z as the kernel builds them, the scale picked by the
kernel's byte permutation, HMUL2 / HFMA2 rounded once in fp16) and the bf16 path's fp32 decode (a
nibble or byte under 2^23) — placed at those rows, reproduces the weight bit for bit: the reference
dequantization in fp16, the exact q - z in fp32. The plan rules and the layout checks too.
With a GPU: the kernel against `kernels/reference` (random shapes, short last groups, act-order,
asymmetric zeros, fp16/bf16, every row tile, column tile and warp count, GGUF forms with offsets,
bias, a column slice as `out`, NaN-poisoned outputs, CUDA-graph replays), and the odd-N fallback.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from ggml_helpers import random_weight

from flotilla.kernels.cuda import gemv
from flotilla.kernels.ggml import GGML_FORMATS
from flotilla.kernels.gptq import GPTQWeight, default_g_idx, num_groups
from flotilla.kernels.reference import dequantize
from flotilla.kernels.triton_ggml import repack_ggml
from flotilla.kernels.triton_layout import repack, unpack_words

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def weight(k: int, n: int, bits: int, group: int, sym: bool, act_order: bool, seed: int = 0) -> GPTQWeight:
    gen = torch.Generator().manual_seed(seed)
    g = num_groups(k, group)
    q = torch.randint(0, 1 << bits, (k, n), generator=gen, dtype=torch.int32)
    zeros = (torch.full((g, n), 1 << (bits - 1), dtype=torch.int32) if sym
             else torch.randint(1, 1 << bits, (g, n), generator=gen, dtype=torch.int32))
    scales = (torch.rand(g, n, generator=gen) * 0.02 + 0.001).half()
    g_idx = default_g_idx(k, group)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return GPTQWeight.from_codes(q, zeros, scales, g_idx, bits, group)


CASES = [  # k, n, bits, group, sym, act_order
    (1024, 96, 4, 128, True, False),  # 4 blocks of 256 rows, 2 groups a block (TPG 2)
    (520, 64, 4, 128, False, False),  # short last group (520 = 4 * 128 + 8), asymmetric; padded input
    (768, 40, 4, 32, False, True),  # group 32: blocks of 128 rows (R = 16), act-order
    (512, 32, 4, -1, True, True),  # one group (TPG 4)
    (1536, 48, 4, 64, True, False),  # TPG 1 at R = 32; 1.5 strips a column
    (640, 72, 8, 128, False, False),  # 8 bits: one group a block
    (384, 24, 8, 32, True, True),  # 8 bits, group 32 (R = 16)
    (512, 16, 8, 64, False, False),  # 8 bits, TPG 1
]


# ----------------------------------------------------------------------------------------------
# Emulation of the kernel (gemv.cuh gemv_kernel / strip_f16 / strip_bf16)

def halves(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint32 -> its (low, high) 16-bit halves as fp16 values in float64."""
    u = u.astype(np.uint32)
    return ((u & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64),
            (u >> 16).astype(np.uint16).view(np.float16).astype(np.float64))


def byte_perm(x: np.ndarray, y: int, sel: int) -> np.ndarray:
    """CUDA __byte_perm(x, y, sel): byte i of the result is byte (sel >> 4i) & 7 of {y, x}."""
    x = x.astype(np.uint64)
    src = [(x >> (8 * b)) & 0xFF for b in range(4)] + [np.full_like(x, (y >> (8 * b)) & 0xFF) for b in range(4)]
    out = np.zeros_like(x)
    for i in range(4):
        out |= src[(sel >> (4 * i)) & 7] << (8 * i)
    return out.astype(np.uint32)


def f32(u: np.ndarray) -> np.ndarray:
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def fp16(v: np.ndarray) -> np.ndarray:
    """One rounding to fp16 of an exact value (float64 holds fp16 products and sums exactly)."""
    return v.astype(np.float16).astype(np.float64)


def lane_walk(layout, geo):
    """What every (strip, lane) of a column reads, as the kernel computes it: yields (word, [run t:
    (group or None when the kernel keeps the previous one, first x row)])."""
    pairs = 16 // layout.bits
    kw = layout.words.shape[1]
    r = 1 << geo.log2r
    for i in range(-(-kw // 128)):
        for lane in range(32):
            word = 128 * i + 4 * lane
            if word >= kw:
                continue
            lb, r0 = (4 * lane) >> geo.log2r, (4 * lane) & (r - 1)
            lane_row = (lb << (geo.log2r + 1)) * pairs + 2 * r0
            u0 = (i * (128 >> geo.log2r) + lb) * pairs
            runs = []
            for t in range(pairs):
                g = gemv.group_of(u0 + t, geo.group_magic) if t % geo.tpg == 0 else None
                runs.append((g, i * 256 * pairs + lane_row + (t << (geo.log2r + 1))))
            yield word, runs


def table_columns(table: np.ndarray, g: int, cols: int, bits16: bool) -> np.ndarray:
    """The kernel's view of row g of a [G, N] table for every column n: loaded `cols` at a time
    from the block's first column and taken apart as gemv.cuh does (dup16 / the zero byte_perm)."""
    n = table.shape[1]
    row = table[g].astype(np.uint32).reshape(n // cols, cols)  # [blocks, C]
    out = np.zeros((n // cols, cols), dtype=np.uint32)
    for c in range(cols):
        if bits16:  # the 32-bit word holding entries 2(c // 2), +1, duplicated half c % 2
            word = row[:, 2 * (c // 2)] | (row[:, 2 * (c // 2) + 1] << 16 if cols > 1 else 0)
            out[:, c] = byte_perm(word, 0, 0x3232 if c % 2 else 0x1010)
        else:  # C uint8 in one word, byte c to both halves
            word = sum(row[:, cc] << (8 * cc) for cc in range(cols))
            out[:, c] = byte_perm(word, 0, 0x4040 + 0x0101 * c)
    return out.reshape(n)


def emulate(layout, dtype: str, cols: int = 2) -> np.ndarray:
    """The dense [k_padded, N] weight the kernel multiplies x with (layout row order), from the
    kernel's own index arithmetic and decode: fp16 values for "fp16", (q - z) * s + m in float64
    for "bf16" (whose decode must give q - z exactly)."""
    geo = gemv.geometry(layout, torch.float16 if dtype == "fp16" else torch.bfloat16)
    bits = layout.bits
    words = layout.words.numpy().view(np.uint32)  # [N, KW]
    n = words.shape[0]
    scales16 = layout.scales.view(torch.int16).numpy().view(np.uint16)
    offsets16 = None if layout.offsets is None else layout.offsets.view(torch.int16).numpy().view(np.uint16)
    zeros = None if layout.zeros is None else layout.zeros.numpy()
    table_f = lambda t: (t.astype(np.uint32) << 16).view(np.float32).astype(np.float64) \
        if layout.scales.dtype == torch.bfloat16 else t.view(np.float16).astype(np.float64)
    out = np.full((layout.k_padded, n), np.nan)
    for word, runs in lane_walk(layout, geo):
        w4 = words[:, word:word + 4]  # [N, 4]: this lane's 16 bytes of every column
        for t, (g, row) in enumerate(runs):
            if g is not None:  # a new group: scales, zero constants, offsets of every column
                s2 = table_columns(scales16, g, cols, True)
                zz = (table_columns(zeros, g, cols, False) if zeros is not None
                      else np.full(n, layout.zero_const * 0x00010001, dtype=np.uint32))
                m2 = table_columns(offsets16, g, cols, True) if offsets16 is not None else None
                z = zz & 0xFFFF
            for j in range(4):
                w = w4[:, j].astype(np.uint64)
                if dtype == "fp16":
                    qz = _pair_f16(w, t, bits, zz)
                    s = halves(s2)[0]
                    val = [fp16(v * s + (halves(m2)[0] if m2 is not None else 0.0)) for v in qz]
                else:
                    qz = _pair_f32(w, t, bits, z.astype(np.float64))
                    s = table_f((s2 & 0xFFFF).astype(np.uint16))
                    m = table_f((m2 & 0xFFFF).astype(np.uint16)) if m2 is not None else 0.0
                    val = [v * s + m for v in qz]
                out[row + 2 * j] = val[0]
                out[row + 2 * j + 1] = val[1]
    return out


def _pair_f16(w: np.ndarray, t: int, bits: int, zz: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """gemv.cuh PairF16<bits>::get<t>: (q - z) of rows (2r, 2r+1), exact in fp16."""
    even = halves(zz.astype(np.uint64) + 0xE400E400)  # zz_even_of
    odd = halves(zz.astype(np.uint64) * 16 + 0xD400D400)  # zz_odd_of
    if bits == 8:
        p = halves(((w if t == 0 else w >> 8) & 0x00FF00FF) | 0x64006400)
        return p[0] + even[0], p[1] + even[1]
    src = w if t < 2 else w >> 8
    if t % 2 == 0:
        p = halves((src & 0x000F000F) | 0x64006400)
        return p[0] + even[0], p[1] + even[1]
    p = halves((src & 0x00F000F0) | 0x64006400)
    return p[0] * 0.0625 + odd[0], p[1] * 0.0625 + odd[1]


def _pair_f32(w: np.ndarray, t: int, bits: int, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """gemv.cuh ValsF32<bits>::get<t>: q - z of rows (2r, 2r+1) in fp32 (exact: checked here)."""
    if bits == 8:
        kz = -(8388608.0 + z)
        lo, hi = (f32(byte_perm(w, 0x4B000000, sel)) + kz for sel in (0x7440 + t, 0x7442 + t))
        return lo, hi
    kz = [-(float(1 << (23 - 4 * f)) + z) for f in range(5)]
    scale = [16.0 ** -f for f in range(5)]
    lo = f32((w & (0xF << (4 * t))) | 0x4B000000) * scale[t] + kz[t]
    if t == 0:
        hi = f32((w & 0xF0000) | 0x4B000000) * scale[4] + kz[4]
    else:
        hi = f32(((w >> 12) & (0xF << (4 * (t + 1)))) | 0x4B000000) * scale[t + 1] + kz[t + 1]
    return lo, hi


def emulate_mma(layout, x: np.ndarray) -> np.ndarray:
    """y [M, N] of the tensor-core plan (gemv_mma.cuh), from what each lane (g, t) loads, the
    fragments it hands mma.sync (the PTX m16n8k16 layouts: A row g / g + 8 at k 2t, 2t+1 (a0, a1)
    and 2t+8, 2t+9 (a2, a3); B k 2t.. / 2t+8.. of column g; C row g / g + 8, columns 2t, 2t+1),
    the zero MMA and the per-group, per-parity folds; in float64. x: [M, k_padded]."""
    geo = gemv.geometry(layout, torch.float16)
    assert geo.mma
    bits, pairs = layout.bits, 16 // layout.bits
    r = 1 << geo.log2r
    spb, tpg, par, bk = r // 16, geo.tpg, (2 if bits == 4 else 1), 2 * r * pairs
    words = layout.words.numpy().view(np.uint32).astype(np.uint64)
    n, kw = words.shape
    m_rows = x.shape[0]
    scales = layout.scales.double().numpy()
    zeros = layout.zeros.numpy().astype(np.uint64) if layout.zeros is not None else None
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    xrow = np.minimum(g, m_rows - 1)
    y = np.zeros((n, 8))
    for n0 in range(0, n, 16):
        for b in range(kw // r):
            grp = [gemv.group_of(b * pairs + q * tpg, geo.group_magic) for q in range(pairs // tpg)]
            acc = np.zeros((len(grp), par, 16, 8))
            for sq in range(spb):
                base = b * r + 16 * sq + 4 * t  # [32] this lane's first word
                wa = words[n0 + g[:, None], base[:, None] + np.arange(4)]  # [32, 4]
                wb = words[n0 + g[:, None] + 8, base[:, None] + np.arange(4)]
                for s in range(pairs):
                    q, v = s // tpg, s % par
                    rows = b * bk + s * 2 * r + 32 * sq + 8 * t  # [32]
                    xs = x[xrow[:, None], rows[:, None] + np.arange(8)]  # [32, 8]
                    z = (zeros[grp[q], n0 + np.concatenate([g, g + 8])] if zeros is not None
                         else np.full(64, layout.zero_const, dtype=np.uint64))
                    zconst = halves(z * (0x00100010 if bits == 4 and v else 0x00010001) + 0xE400E400)[0]  # [64]
                    for h in range(2):
                        a_mat, z_mat, b_mat = np.zeros((16, 16)), np.zeros((16, 16)), np.zeros((16, 8))
                        for reg, (col, word, kk) in enumerate(((g, wa[:, 2 * h], 2 * t), (g + 8, wb[:, 2 * h], 2 * t),
                                                               (g, wa[:, 2 * h + 1], 2 * t + 8),
                                                               (g + 8, wb[:, 2 * h + 1], 2 * t + 8))):
                            lo, hi = halves(_raw_pair(word, s, bits))
                            a_mat[col, kk], a_mat[col, kk + 1] = lo, hi
                            z_mat[col, kk] = z_mat[col, kk + 1] = zconst[np.where(reg % 2, 32 + lane, lane)]
                        b_mat[2 * t, g], b_mat[2 * t + 1, g] = xs[:, 4 * h], xs[:, 4 * h + 1]
                        b_mat[2 * t + 8, g], b_mat[2 * t + 9, g] = xs[:, 4 * h + 2], xs[:, 4 * h + 3]
                        acc[q, v] += a_mat @ b_mat + z_mat @ b_mat
            for q, gi in enumerate(grp):
                for v in range(par):
                    if tpg == 1 and v != q % par:
                        continue
                    f = scales[gi, n0:n0 + 16] * (0.0625 if v else 1.0)
                    y[n0:n0 + 16] += f[:, None] * acc[q, v]
    return y[:, :m_rows].T


def _raw_pair(w: np.ndarray, s: int, bits: int) -> np.ndarray:
    """gemv_mma.cuh raw_pair<bits, s>: 1024 + q (1024 + 16 q for odd runs at 4 bits), as bits."""
    if bits == 8:
        return ((w if s == 0 else w >> 8) & 0x00FF00FF) | 0x64006400
    src = w if s < 2 else w >> 8
    return (src & (0x00F000F0 if s % 2 else 0x000F000F)) | 0x64006400


def reference_rows(w: GPTQWeight, layout, dtype: torch.dtype) -> np.ndarray:
    """The reference weight [in, out] in the layout's row order."""
    dense = dequantize(w, dtype).double().numpy()
    return dense[layout.perm.long().numpy()] if layout.perm is not None else dense


@pytest.mark.parametrize("case", CASES)
def test_emulated_fp16_kernel_is_the_reference_dequantization(case):
    k, n, bits, group, sym, act = case
    w = weight(k, n, bits, group, sym, act, seed=1)
    layout = repack(w)
    for cols in (2, 4) if n % 4 == 0 else (2,):
        dense = emulate(layout, "fp16", cols)
        assert not np.isnan(dense).any()  # every row of every column read exactly once... or more:
        np.testing.assert_array_equal(dense[:k], reference_rows(w, layout, torch.float16))


@pytest.mark.parametrize("case", CASES)
def test_emulated_bf16_kernel_decodes_q_minus_z_exactly(case):
    k, n, bits, group, sym, act = case
    w = weight(k, n, bits, group, sym, act, seed=2)
    layout = repack(w)
    dense = emulate(layout, "bf16", 2)
    ref = reference_rows(w, layout, torch.float32)  # ((q - z) * s) in fp32: our fp32 product, rounded
    np.testing.assert_array_equal(dense[:k].astype(np.float32), ref.astype(np.float32))


@pytest.mark.parametrize("case", [c for c in CASES if c[1] % 16 == 0])
def test_emulated_tensor_core_plan_is_the_matmul(case):
    k, n, bits, group, sym, act = case
    w = weight(k, n, bits, group, sym, act, seed=3)
    layout = repack(w)
    if not gemv.geometry(layout, torch.float16).mma:
        pytest.skip("not a tensor-core layout")
    rng = np.random.default_rng(0)
    for m in (1, 3, 8):
        x = np.zeros((m, layout.k_padded))
        x[:, :k] = rng.standard_normal((m, k)).astype(np.float16)
        y = emulate_mma(layout, x)
        ref = x[:, :k] @ reference_rows(w, layout, torch.float32)[:, :]  # rows in layout order, x likewise
        np.testing.assert_allclose(y, ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())


def test_every_row_is_read_once_and_padding_rows_only_past_k():
    """The lanes' 8-row runs tile the padded input axis exactly once per column."""
    for k, n, bits, group, sym, act in CASES:
        layout = repack(weight(k, n, bits, group, sym, act))
        geo = gemv.geometry(layout, torch.float16)
        seen = np.zeros(layout.k_padded, dtype=np.int64)
        for _, runs in lane_walk(layout, geo):
            for _, row in runs:
                seen[row:row + 8] += 1
        assert (seen == 1).all(), (k, n, bits, group)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_1", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_emulated_kernel_reads_the_gguf_forms(qtype, dtype):
    """The GGUF layouts (group 32 or 16, zero constants, float offsets): q - z from the kernel's
    decode times the scale plus the offset, against the codes the layout unpacks to."""
    fmt = GGML_FORMATS[qtype]
    gw = random_weight(qtype, 64, 2 * fmt.block * 4, seed=3, scale=0.01)
    layout = repack_ggml(gw, dtype, "cpu")
    name = "fp16" if dtype == torch.float16 else "bf16"
    dense = emulate(layout, name, 4)[:layout.in_features]
    q = unpack_words(layout.words, layout.bits, layout.block_k, layout.in_features).double().numpy()
    g = np.arange(layout.in_features) // layout.group_size
    s = layout.scales.double().numpy()[g]
    m = layout.offsets.double().numpy()[g] if layout.offsets is not None else 0.0
    exact = (q - layout.zero_const) * s + m
    np.testing.assert_array_equal(dense, fp16(exact) if name == "fp16" else exact)


def test_geometry_of_the_layouts():
    lay = repack(weight(1024, 96, 4, 128, True, False))
    geo = gemv.geometry(lay, torch.float16)
    assert (geo.log2r, geo.runs_per_group, geo.tpg, geo.mode) == (5, 2, 2, gemv.SYM)
    assert [gemv.group_of(u, geo.group_magic) for u in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert gemv.geometry(repack(weight(512, 32, 4, -1, True, False)), torch.float16).tpg == 4
    assert gemv.geometry(repack(weight(512, 32, 8, 64, False, False)), torch.bfloat16).mode == gemv.ZP
    for rpg in (1, 2, 3, 5, 6, 7, 12, 64, 1000):  # the magic division over every run of a 1M-row input
        magic = -(-(1 << 31) // rpg)
        u = np.arange(0, 1 << 16, dtype=np.uint64)
        assert np.array_equal((2 * u * magic) >> 32, u // rpg)


def odd_n_layout(device="cpu"):
    """A GGUF form with 33 output features (GPTQ packs its zeros 8 or 4 columns a word: even N)."""
    return repack_ggml(random_weight("Q4_0", 33, 256, seed=9, scale=0.01), torch.float16, device)


def test_layouts_it_does_not_read_fall_back():
    with pytest.raises(gemv.GemvUnsupported, match="odd out_features"):
        gemv.geometry(odd_n_layout(), torch.float16)
    with pytest.raises(gemv.GemvUnsupported, match="float16 or bfloat16"):
        gemv.geometry(repack(weight(256, 32, 4, 128, True, False)), torch.float32)
    lay = repack(weight(256, 32, 4, 128, True, False))
    bf16_scales = dataclasses.replace(lay, scales=lay.scales.bfloat16())
    with pytest.raises(gemv.GemvUnsupported, match="scales in torch.bfloat16"):
        gemv.geometry(bf16_scales, torch.float16)
    assert gemv.gemv_for(lay, torch.float16) is None  # a CPU layout: never the GEMV


def test_plans():
    p = gemv.choose_plan(1, 28672, 1024, 132, 4)
    assert (p.rows, p.cols) == (1, 4) and p.warps >= 1
    assert gemv.choose_plan(3, 4096, 512, 132, 4).rows == 4
    assert gemv.choose_plan(8, 4096, 512, 132, 4).cols == 2
    assert gemv.choose_plan(1, 4098, 512, 132, 4).cols == 2  # 4 does not divide N
    assert gemv.choose_plan(1, 4096, 512, 132, 8).cols == 2
    mma = gemv.choose_plan(1, 4096, 512, 132, 4, mma_r=32)
    assert (mma.rows, mma.cols, mma.warps) == (8, 16, 8)  # 256 blocks: 8 warps each reach 16 a SM
    assert gemv.choose_plan(5, 28672, 1024, 132, 4, mma_r=32).warps == 2
    for m in range(1, 9):
        for n, kw in ((4096, 512), (14336, 512), (4096, 1792), (28672, 1024), (64, 64)):
            for mma_r in (0, 16, 32):
                plan = gemv.choose_plan(m, n, kw, 132, 4, mma_r)
                assert (plan.rows, plan.cols) in gemv.SHAPES and plan.rows >= m and n % plan.cols == 0
                assert 1 <= plan.warps <= gemv.MAX_WARPS


# ----------------------------------------------------------------------------------------------
# On the GPU

def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def poison(m: int, n: int, dtype: torch.dtype) -> None:
    """Leave a NaN-filled block of the output's size in the caching allocator, so that a kernel
    that fails to write its output shows NaN instead of a previous call's (correct) result."""
    torch.full((m, n), float("nan"), dtype=dtype, device="cuda")


def plans(kern, m: int):
    for shape in kern.plans():
        if shape.rows >= m:
            for warps in (1, 3, 8):
                yield dataclasses.replace(shape, warps=warps)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference_on_every_plan(case, dtype):
    from flotilla.kernels.triton_linear import TritonGPTQKernel

    k, n, bits, group, sym, act = case
    w = weight(k, n, bits, group, sym, act, seed=4).to("cuda")
    kern = TritonGPTQKernel(w, dtype)
    assert kern.gemv is not None
    w32 = dequantize(w, torch.float32)
    tol = 2e-3 if dtype == torch.float16 else 1.2e-2
    for m in range(1, gemv.MAX_ROWS + 1):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        bias = torch.randn(n, device="cuda", dtype=dtype)
        ref = x.float() @ w32 + bias.float()
        for plan in [None, *plans(kern.gemv, m)] if m in (1, 3, 8) else [None]:
            poison(m, n, dtype)
            y = kern.gemv(x, bias, plan=plan)
            assert y.shape == (m, n) and bool(torch.isfinite(y).all()), (m, plan)
            assert rel_err(y, ref) < tol, (m, plan or kern.gemv.plan_for(m), rel_err(y, ref))
    assert rel_err(kern.gemv(x), x.float() @ w32) < tol  # no bias


@needs_cuda
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q8_0", "Q5_1", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gguf_forms_through_the_gemv(qtype, dtype):
    from flotilla.kernels.triton_linear import TritonLayoutKernel

    gw = random_weight(qtype, 96, 1024, seed=5, scale=0.01)
    layout = repack_ggml(gw, dtype, "cuda")
    kern = TritonLayoutKernel(layout, dtype)
    assert kern.gemv is not None
    ref_w = gw.dequantize(torch.float32).to("cuda")  # [out, in]
    for m in (1, 2, 5, 8):
        x = torch.randn(m, 1024, device="cuda", dtype=dtype)
        poison(m, 96, dtype)
        y = kern.gemv(x)
        assert rel_err(y, x.float() @ ref_w.t()) < (2e-3 if dtype == torch.float16 else 1.2e-2), (qtype, m)


@needs_cuda
def test_registry_kernel_picks_the_gemv_for_small_batches_and_writes_a_column_slice():
    from flotilla.kernels.triton_linear import TritonGPTQKernel

    w = weight(2048, 384, 4, 128, False, True, seed=6).to("cuda")
    kern = TritonGPTQKernel(w, torch.float16)
    assert kern.gemv.geo.mma and kern.gemv.max_rows == gemv.MMA_MAX_ROWS
    assert kern.config_for(1).kind == "gemv" and kern.config_for(1).block_n == gemv.MMA_COLS
    assert kern.config_for(gemv.MMA_MAX_ROWS + 1).kind == "dot"
    x = torch.randn(2, 2048, device="cuda", dtype=torch.float16)
    big = torch.full((2, 1000), float("nan"), device="cuda", dtype=torch.float16)
    kern(x, out=big[:, 100:484])
    ref = x.float() @ dequantize(w, torch.float32)
    assert rel_err(big[:, 100:484], ref) < 2e-3
    assert torch.isnan(big[:, :100]).all() and torch.isnan(big[:, 484:]).all()
    assert torch.equal(kern(x), kern(x))  # a fixed summation order


@needs_cuda
def test_graph_replays():
    from flotilla.kernels.triton_linear import TritonGPTQKernel

    w = weight(4096, 512, 4, 128, True, False, seed=7).to("cuda")
    kern = TritonGPTQKernel(w, torch.float16)
    w32 = dequantize(w, torch.float32)
    for m in (1, 4):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.float16)
        kern(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = kern(x)
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            graph.replay()
            assert rel_err(y, x.float() @ w32) < 2e-3


@needs_cuda
def test_odd_n_falls_back_to_triton():
    from flotilla.kernels.triton_linear import TritonLayoutKernel

    layout = odd_n_layout("cuda")
    kern = TritonLayoutKernel(layout, torch.float16)
    assert kern.gemv is None and kern.config_for(1).kind == "dot"
    gw = random_weight("Q4_0", 33, 256, seed=9, scale=0.01)
    x = torch.randn(1, 256, device="cuda", dtype=torch.float16)
    assert rel_err(kern(x), x.float() @ gw.dequantize(torch.float32).to("cuda").t()) < 2e-3
