"""The GEMV over the Triton layout (flotilla/kernels/cuda/gemv.py, csrc/gemv.cuh, gemv_mma.cuh).

On any machine (tests/gemv_emulation.py): a numpy emulation of exactly what every lane reads and computes —
its strip and lane to block, run, group (the magic multiply and the reload every TPG runs), the x
rows it multiplies; the fp16 pair decode (the LOP3 masks under 0x6400, HADD2 / HFMA2 by 1/16 to
q - z, the packed zero constants built from z as the kernel builds them, the scale picked by the
kernel's byte permutation, HMUL2 / HFMA2 rounded once in fp16) and the bf16 path's fp32 decode (a
nibble or byte under 2^23) — placed at those rows, reproduces the weight bit for bit: the reference
dequantization in fp16, the exact q - z in fp32; the tensor-core plan's mma.sync fragments, built
from what each lane holds by the PTX m16n8k16 layouts, give x @ W. The plan rules, the crossovers and
the layout checks too; the tensor-core plan's shared-memory ring (every lane reads back the bytes it
copied, no two share one) and the scale / zero words it copies.
With a GPU: the kernel against `kernels/reference` (random shapes, short last groups, act-order,
asymmetric zeros, fp16/bf16, every row tile, column tile, warp count and ring depth, GGUF forms with offsets,
bias, a column slice as `out`, NaN-poisoned outputs, CUDA-graph replays), and the odd-N fallback.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import needs_gpu
from gemv_emulation import (
    emulate,
    emulate_mma,
    emulate_wide,
    fp16,
    lane_walk,
    reference_rows,
    ring_offsets,
    wide_columns,
)
from ggml_helpers import random_weight
from test_cuda_kernels import weight

from flotilla.kernels.cuda import build, gemv
from flotilla.kernels.ggml import GGML_FORMATS
from flotilla.kernels.reference import dequantize
from flotilla.kernels.triton_ggml import repack_ggml
from flotilla.kernels.triton_layout import repack, unpack_words


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


def tensor_core_case(case, seed: int):
    """A CASES weight the tensor-core plans read: (layout, an fp16 x of M rows in layout order -> (x, x @ W))."""
    k, n, bits, group, sym, act = case
    w = weight(k, n, bits, group, sym, act, seed=seed)
    layout = repack(w)
    assert gemv.geometry(layout, torch.float16).mma  # every CASES weight of 16 | N
    rng = np.random.default_rng(seed)
    ref_w = reference_rows(w, layout, torch.float32)  # rows in layout order, x likewise

    def sample(m: int):
        x = np.zeros((m, layout.k_padded))
        x[:, :k] = rng.standard_normal((m, k)).astype(np.float16)
        return x, x[:, :k] @ ref_w

    return layout, sample


@pytest.mark.parametrize("case", [c for c in CASES if c[1] % 16 == 0])
def test_emulated_tensor_core_plan_is_the_matmul(case):
    layout, sample = tensor_core_case(case, seed=3)
    for m in (1, 3, 8):
        x, ref = sample(m)
        y = emulate_mma(layout, x)
        np.testing.assert_allclose(y, ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())


@pytest.mark.parametrize("case", [c for c in CASES if c[1] % 16 == 0])
def test_emulated_wide_plan_is_the_matmul(case):
    layout, sample = tensor_core_case(case, seed=5)
    n = layout.out_features
    for m, cols in ((16, 16), (9, 32), (13, 16), (1, 16)):
        if n % cols:
            continue
        x, ref = sample(m)
        for silu in (False, True) if n % (2 * cols) == 0 else (False,):
            y = emulate_wide(layout, x, cols, silu)
            np.testing.assert_allclose(y, ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())


@pytest.mark.parametrize("n,cols", [(64, 16), (64, 32), (128, 64), (96, 32)])
def test_wide_blocks_cover_every_column_once(n, cols):
    for silu in (False, True) if n % (2 * cols) == 0 else (False,):
        firsts = np.concatenate(wide_columns(n, cols, silu))
        seen = np.sort((firsts[:, None] + np.arange(8)).reshape(-1))
        np.testing.assert_array_equal(seen, np.arange(n))
        if silu:  # block j: gate columns j * cols / 2 .. and the same of up
            for j, f in enumerate(wide_columns(n, cols, True)):
                half = len(f) // 2
                np.testing.assert_array_equal(f[half:] - f[:half], n // 2)
                assert f[0] == j * cols // 2


@pytest.mark.parametrize("spb,ng,zp,bk", [(2, 2, False, 256), (2, 4, True, 256), (1, 1, True, 128),
                                          (1, 2, False, 128), (2, 1, False, 128)])
def test_tensor_core_ring_slots_are_disjoint_and_read_back_where_written(spb, ng, zp, bk):
    for stages, warps, m in ((2, 1, 1), (3, 3, 3), (6, 8, 8), (4, 2, 2)):
        own_w, own_r, x_w, x_r, size = ring_offsets(spb, ng, zp, stages, warps, m, bk)
        assert own_w == own_r  # weights and tables: each lane reads back what it copied
        assert all(off % width == 0 and 0 <= off and off + width <= size for off, width in own_w + x_w)
        cells = [byte for off, width in own_w + x_w for byte in range(off, off + width)]
        assert len(set(cells)) == len(cells)  # no byte copied twice
        assert {(off, w) for off, w in x_r} <= set(x_w)  # x read only where some lane copied it


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


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q5_1", "Q5_K", "Q4_0", "Q8_0"])
def test_emulated_tensor_core_plan_reads_the_gguf_forms(qtype):
    """The GGUF layouts of group 32 on the tensor-core plan: q - z on the MMA, times the scale once a group,
    and for the float-offset forms the offset times the group's sum of x (an MMA with A = 1.0) — x @ W of
    the layout's own weights, s (q - z) + m unrounded, where the Triton kernel rounds each weight to fp16."""
    gw = random_weight(qtype, 48, 512, seed=4, scale=0.01)
    layout = repack_ggml(gw, torch.float16, "cpu")
    geo = gemv.geometry(layout, torch.float16)
    assert geo.mma and geo.log2r == 4 and geo.mode == (gemv.OFF if layout.offsets is not None else gemv.SYM)
    q = unpack_words(layout.words, layout.bits, layout.block_k, layout.in_features).double().numpy()
    g = np.arange(layout.in_features) // layout.group_size
    w = (q - layout.zero_const) * layout.scales.double().numpy()[g]
    if layout.offsets is not None:
        w += layout.offsets.double().numpy()[g]
    rng = np.random.default_rng(4)
    for m in (1, 3, 8):
        x = rng.standard_normal((m, layout.k_padded)).astype(np.float16).astype(np.float64)
        ref = x[:, :layout.in_features] @ w
        np.testing.assert_allclose(emulate_mma(layout, x), ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())


def test_crossovers_only_where_measured(monkeypatch):
    monkeypatch.delenv(gemv.OFFSETS_ENV, raising=False)
    monkeypatch.delenv(gemv.GROUP32_ENV, raising=False)
    g128 = gemv.geometry(repack(weight(1024, 96, 4, 128, False, False)), torch.float16)
    assert g128.mma and gemv.crossover(g128, 4, torch.float16) == gemv.MMA_MAX_ROWS == 8
    assert gemv.crossover(g128, 4, torch.float16, 4096 * 28672) == 8  # llama-3-8b's gate_up
    assert gemv.crossover(g128, 4, torch.float16, 8192 * 28672) == gemv.MMA_MAX_ROWS_LARGE == 4  # 70b's
    assert gemv.wide_rows(g128, 4, 4096 * 4096) == range(9, gemv.WIDE_MAX_ROWS + 1)  # the wide plan: small weights
    assert not gemv.wide_rows(g128, 4, 4096 * 6144) and not gemv.wide_rows(g128, 8, 4096 * 4096)
    monkeypatch.setenv("FLOTILLA_GEMV_WIDE", "0")
    assert not gemv.wide_rows(g128, 4, 4096 * 4096)  # turned off
    monkeypatch.delenv("FLOTILLA_GEMV_WIDE")
    g32 = gemv.geometry(repack(weight(768, 48, 4, 32, True, False)), torch.float16)
    assert g32.log2r == 4 and gemv.crossover(g32, 4, torch.float16) == gemv.GROUP_MMA_MAX_ROWS  # as Q4_0 (below)
    for qtype, rows, plan in (("Q4_0", gemv.GROUP_MMA_MAX_ROWS, gemv.GemvPlan(8, 16, 8, 2)),  # round 16's sweep
                              ("Q8_0", gemv.GROUP_MMA_MAX_ROWS, gemv.GemvPlan(8, 16, 8, 2)),
                              ("Q6_K", gemv.GROUP_CORES_MAX_ROWS, gemv.GemvPlan(1, 4, 2))):
        lay = repack_ggml(random_weight(qtype, 64, 256, seed=1, scale=0.01), torch.float16, "cpu")
        geo = gemv.geometry(lay, torch.float16)
        assert geo.mode == gemv.SYM and gemv.crossover(geo, lay.bits, torch.float16) == rows, qtype
        assert gemv.crossover(geo, lay.bits, torch.bfloat16) == 0  # not measured in bf16
        got = gemv.choose_plan(1, 64, lay.words.shape[1], 132, lay.bits, lay.rows_per_field if geo.mma else 0,
                               lay.rows_per_field)
        assert got == plan, (qtype, got)
    w8 = gemv.geometry(repack(weight(640, 72, 8, 128, True, False)), torch.float16)
    assert gemv.crossover(w8, 8, torch.float16) == gemv.CORES_MAX_ROWS[(8, torch.float16)]
    bf = gemv.geometry(repack(weight(1024, 96, 4, 128, True, False)), torch.bfloat16)
    assert not bf.mma and gemv.crossover(bf, 4, torch.bfloat16) == 0  # slower than Triton on 4096x14336
    lay = repack_ggml(random_weight("Q4_K", 64, 256, seed=1, scale=0.01), torch.float16, "cpu")
    gguf = gemv.geometry(lay, torch.float16)  # float offsets: the tensor-core plan (round 21)
    on = gemv.OFFSET_MMA_MAX_ROWS if gemv.OFFSETS_ON else gemv.GROUP32_CORES_ROWS  # (then Triton)
    assert gguf.mode == gemv.OFF and gguf.mma and gemv.crossover(gguf, 4, torch.float16) == on
    assert gemv.choose_plan(1, 64, lay.words.shape[1], 132, 4, lay.rows_per_field, lay.rows_per_field) \
        == gemv.GemvPlan(8, 16, 8, 2)
    monkeypatch.setenv(gemv.OFFSETS_ENV, "on")
    assert gemv.crossover(gguf, 4, torch.float16) == gemv.OFFSET_MMA_MAX_ROWS  # turned on
    monkeypatch.setenv(gemv.OFFSETS_ENV, "0")
    assert gemv.crossover(gguf, 4, torch.float16) == gemv.GROUP32_CORES_ROWS  # turned off: the Triton kernel past 1
    # the CUDA-core plans at 1 row (round 23, on by default): tables a strip ahead but on 8-bit integer-zero layouts
    assert gemv.GROUP32_CORES_ON and gemv.GROUP32_CORES_ROWS == 1
    assert gemv.tables_ahead(gguf, 4, torch.float16) and gemv.crossover(gguf, 4, torch.float16) == 1
    q40 = gemv.geometry(repack_ggml(random_weight("Q4_0", 64, 256, seed=1, scale=0.01), torch.float16, "cpu"),
                        torch.float16)
    assert gemv.tables_ahead(q40, 4, torch.float16) and gemv.crossover(q40, 4, torch.float16) == 8  # the ring past 1
    q80 = gemv.geometry(repack_ggml(random_weight("Q8_0", 64, 256, seed=1, scale=0.01), torch.float16, "cpu"),
                        torch.float16)
    assert gemv.group32_cores(q80, torch.float16) and not gemv.tables_ahead(q80, 8, torch.float16)
    q5k = gemv.geometry(repack_ggml(random_weight("Q5_K", 64, 256, seed=1, scale=0.01), torch.float16, "cpu"),
                        torch.float16)
    assert gemv.tables_ahead(q5k, 8, torch.float16)  # float offsets: ahead at 8 bits too
    zp = gemv.geometry(repack(weight(768, 48, 4, 32, False, False)), torch.float16)  # GPTQ g32 asym: not measured
    assert zp.mode == gemv.ZP and not gemv.group32_cores(zp, torch.float16)
    monkeypatch.setenv(gemv.GROUP32_ENV, "core")
    with pytest.raises(ValueError, match="FLOTILLA_GEMV_GROUP32='core': expected one of"):
        gemv.tables_ahead(gguf, 4, torch.float16)
    monkeypatch.setenv(gemv.GROUP32_ENV, "cores")
    assert not gemv.group32_cores(g128, torch.float16) and gemv.crossover(g128, 4, torch.float16) == 8  # group 128
    assert not gemv.group32_cores(gguf, torch.bfloat16)
    monkeypatch.setenv(gemv.GROUP32_ENV, "0")  # off: round 22's picks
    assert not gemv.tables_ahead(gguf, 4, torch.float16) and gemv.crossover(gguf, 4, torch.float16) == 0
    assert gemv.crossover(q40, 4, torch.float16) == 8
    bf = gemv.geometry(repack_ggml(random_weight("Q4_K", 64, 256, seed=1, scale=0.01), torch.bfloat16, "cpu"),
                       torch.bfloat16)
    assert bf.mode == gemv.OFF and not bf.mma and gemv.crossover(bf, 4, torch.bfloat16) == 0  # CUDA cores: slower


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
    # the tensor-core plan on llama-3-8b's shapes (in x out: KW = in / 8 words, blocks of 32)
    def mma(m, k, n):
        plan = gemv.choose_plan(m, n, k // 8, 132, 4, mma_r=32)
        return plan.warps, plan.stages

    assert mma(1, 4096, 4096) == (8, 0)  # 256 column tiles x 8 warps: 16 a SM
    assert mma(1, 4096, 6144) == (4, 0)  # 384 tiles: 8 warps would be 23 a SM
    assert mma(1, 4096, 28672) == mma(2, 4096, 28672) == (1, 0)  # 1792 tiles
    assert mma(4, 4096, 28672) == (4, 0)  # from M = 3: a warp per 4 of the column's 16 blocks
    assert mma(1, 14336, 4096) == mma(1, 8192, 28672) == (8, gemv.RING_STAGES)  # >= 32 blocks: the ring at M = 1
    assert mma(2, 14336, 4096) == (8, 0) and mma(2, 8192, 28672) == (1, 0) and mma(4, 8192, 28672) == (8, 0)
    assert mma(1, 256, 64) == (1, 0)  # never more warps than the column's blocks
    from flotilla.kernels.triton_linear import _gemv_plan, gemv_config

    ring = gemv.choose_plan(1, 28672, 1024, 132, 4, mma_r=32)
    assert gemv_config(ring).num_stages == ring.stages  # the registry's config keeps the ring depth
    # every field of a plan survives the registry's config (a field it dropped would never reach the kernel):
    # each set to a value of its own, none its default
    odd = gemv.GemvPlan(**{f.name: 2 + i for i, f in enumerate(dataclasses.fields(gemv.GemvPlan))})
    for plan in (ring, gemv.choose_plan(12, 4096, 512, 132, 4, mma_r=32), odd):
        assert _gemv_plan(gemv_config(plan)) == plan
    assert gemv.choose_plan(1, 4096, 512, 132, 8, mma_r=32).cols == 2  # 8 bits: the CUDA-core plan
    for m in range(1, 9):
        for n, kw in ((4096, 512), (14336, 512), (4096, 1792), (28672, 1024), (64, 64)):
            for mma_r in (0, 16, 32):
                plan = gemv.choose_plan(m, n, kw, 132, 4, mma_r)
                assert (plan.rows, plan.cols) in gemv.SHAPES and plan.rows >= m and n % plan.cols == 0
                assert 1 <= plan.warps <= gemv.MAX_WARPS
                assert plan.rows <= gemv.ROW_TILES[-1]  # up to 8 rows never the wide plan
    for m in range(9, 17):  # the wide plan: 16 columns a block, 8 warps or one a layout block
        for n, kw, warps in ((28672, 512, 8), (4096, 1792, 8), (64, 64, 2), (48, 96, 2)):
            plan = gemv.choose_plan(m, n, kw, 132, 4, mma_r=32)
            assert plan == gemv.GemvPlan(gemv.WIDE_ROWS, 16, warps) and (plan.rows, plan.cols) in gemv.SHAPES
    with pytest.raises(ValueError):
        gemv.choose_plan(17, 4096, 512, 132, 4, mma_r=32)


@pytest.mark.skipif(build.find_nvcc() is None, reason="needs nvcc")
def test_library_builds_for_sm90a_and_the_picked_wide_instances_do_not_spill(tmp_path):
    """Compile the GEMV as its first use on an H100 / H200 would (no GPU needed): the fp16 W4 unit with
    ptxas's report, where the wide plan's instances for blocks of 32 words (the ones it is picked for) spill
    nothing; then the whole library, linked and loaded, its parameter block the size ctypes has."""
    nvcc = build.find_nvcc()
    flags = [*build.FLAGS, *build.arch_flags((9, 0))]
    proc = subprocess.run([nvcc, *flags, "-Xptxas", "-v", "-c", str(build.CSRC / "gemv_f16_w4.cu"), "-o",
                           str(tmp_path / "w4.o")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # per entry: its name, then ptxas's lines up to its spill line
    entries = re.findall(r"Compiling entry function '(\w+)'[^\n]*\n(?:[^\n]*\n)*?[^\n]*?(\d+) bytes spill stores",
                         proc.stderr)
    wide = {name: int(spill) for name, spill in entries if "gemv_wide_kernel" in name and "ELi5ELi2EE" in name}
    assert len(wide) == 6 and not any(wide.values()), wide  # SYM / ZP x 1, 2, 4 runs a group
    path = tmp_path / "flotilla_gemv.so"
    build.compile_library(nvcc, (9, 0), path, build.GEMV)
    cdll = ctypes.CDLL(str(path))
    assert cdll.flotilla_gemv_param_size() == ctypes.sizeof(gemv._Params)
    assert gemv._Library(cdll).cdll is cdll  # the argument types and the size check


# ----------------------------------------------------------------------------------------------
# On the GPU

def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def poison(m: int, n: int, dtype: torch.dtype) -> None:
    """Leave a NaN-filled block of the output's size in the caching allocator, so that a kernel
    that fails to write its output shows NaN instead of a previous call's (correct) result."""
    torch.full((m, n), float("nan"), dtype=dtype, device="cuda")


def tiny_decoder(monkeypatch, layers: int, seed: int):
    """A random INT4 Llama of `layers` layers (hidden 512) on the GPU, its kernels prepared."""
    from flotilla.models.config import ModelConfig
    from flotilla.runtime import random_model

    monkeypatch.setitem(random_model.SHAPES, "gemv-test", ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=1024, hidden_size=512, intermediate_size=1024,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=1024, tie_word_embeddings=False, eos_token_ids=()))
    return random_model.build_random_model("gemv-test", 4, "cuda", torch.float16, seed=seed)


class OwnValue:
    """An attention backend where each token attends to itself alone: what differs between two runs
    of a model is then what the test changed."""

    def attend(self, layer, q, k, v, window=0, softcap=0.0):
        return v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)


def logits_both_ways(model, rows: int, gen, first, second):
    """The logits of `rows` random tokens through `model` after first(), then after second()."""
    ids = torch.randint(0, 1024, (rows,), generator=gen, device="cuda")
    pos = torch.arange(rows, device="cuda")
    out = []
    for setup in (first, second):
        setup()
        out.append(model.compute_logits(model(ids, pos, OwnValue())))
    return out


def captured(fn):
    """fn run once (kernels compiled, tiles chosen), then captured in a CUDA graph: (graph, fn's outputs)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def plans(kern, m: int):
    for shape in kern.plans():
        if shape.rows >= m:
            for warps in (1, 3, 8):
                yield dataclasses.replace(shape, warps=warps)


@needs_gpu
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
    for m in range(1, kern.gemv.most_rows + 1):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        bias = torch.randn(n, device="cuda", dtype=dtype)
        ref = x.float() @ w32 + bias.float()
        for plan in [None, *plans(kern.gemv, m)] if m in (1, 3, 8, 11, 16) else [None]:
            poison(m, n, dtype)
            y = kern.gemv(x, bias, plan=plan)
            assert y.shape == (m, n) and bool(torch.isfinite(y).all()), (m, plan)
            assert rel_err(y, ref) < tol, (m, plan or kern.gemv.plan_for(m), rel_err(y, ref))
    assert rel_err(kern.gemv(x), x.float() @ w32) < tol  # no bias


@needs_gpu
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q4_1", "Q8_0", "Q5_1", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gguf_forms_through_the_gemv(qtype, dtype):
    """Every plan the GGUF layouts can run (the tensor-core plan's ring depths and register buffer on the
    group-32 forms in fp16, float offsets included; the CUDA-core plans), against the exact weights."""
    from flotilla.kernels.triton_linear import TritonLayoutKernel

    gw = random_weight(qtype, 96, 1024, seed=5, scale=0.01)
    layout = repack_ggml(gw, dtype, "cuda")
    kern = TritonLayoutKernel(layout, dtype)
    assert kern.gemv is not None
    assert kern.gemv.geo.mma == (dtype == torch.float16 and qtype != "Q6_K")
    ref_w = gw.dequantize(torch.float32).to("cuda")  # [out, in]
    for m in (1, 2, 5, 8):
        x = torch.randn(m, 1024, device="cuda", dtype=dtype)
        for plan in [None, *plans(kern.gemv, m)] if m in (1, 5) else [None]:
            poison(m, 96, dtype)
            y = kern.gemv(x, plan=plan)
            assert bool(torch.isfinite(y).all()), (qtype, m, plan)
            assert rel_err(y, x.float() @ ref_w.t()) < (2e-3 if dtype == torch.float16 else 1.2e-2), (qtype, m, plan)


@needs_gpu
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q6_K", "Q4_K"])
def test_gguf_forms_run_the_gemv_where_it_measured_faster(qtype, monkeypatch):
    """The registry picks the GEMV for the GGUF forms up to their crossover (Q4_K's float offsets on the
    tensor-core plan where gemv.OFFSETS_ON); the product and the [gate | up] silu epilogue match the exact
    weights there."""
    from flotilla.kernels.fused import silu_mul
    from flotilla.kernels.triton_linear import TritonLayoutKernel

    monkeypatch.delenv(gemv.OFFSETS_ENV, raising=False)

    gw = random_weight(qtype, 256, 1024, seed=7, scale=0.01)
    kern = TritonLayoutKernel(repack_ggml(gw, torch.float16, "cuda"), torch.float16)
    rows = {"Q4_0": gemv.GROUP_MMA_MAX_ROWS, "Q8_0": gemv.GROUP_MMA_MAX_ROWS, "Q6_K": gemv.GROUP_CORES_MAX_ROWS,
            "Q4_K": gemv.OFFSET_MMA_MAX_ROWS if gemv.OFFSETS_ON else gemv.GROUP32_CORES_ROWS}[qtype]
    assert kern.gemv.max_rows == rows
    ref_w = gw.dequantize(torch.float32).to("cuda")
    for m in (1, 3, 4, 8, 9):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.float16)
        assert (kern.config_for(m).kind == "gemv") == (m <= rows), (qtype, m)
        ref = x.float() @ ref_w.t()
        assert rel_err(kern(x), ref) < 2e-3, (qtype, m)
        want = silu_mul(kern(x))
        torch.testing.assert_close(kern.silu_mul(x), want, rtol=2e-3, atol=1e-3)


@needs_gpu
def test_registry_kernel_picks_the_gemv_for_small_batches_and_writes_a_column_slice():
    from flotilla.kernels.triton_linear import TritonGPTQKernel, gemv_config

    w = weight(2048, 384, 4, 128, False, True, seed=6).to("cuda")
    kern = TritonGPTQKernel(w, torch.float16)
    assert kern.gemv.geo.mma and kern.gemv.max_rows == gemv.MMA_MAX_ROWS
    assert kern.config_for(1).kind == "gemv" and kern.config_for(1).block_n == gemv.MMA_COLS
    for m in range(gemv.MMA_MAX_ROWS + 1, gemv.WIDE_MAX_ROWS + 1):  # the wide plan
        assert kern.config_for(m).kind == "gemv" and kern.config_for(m).block_m == gemv.WIDE_ROWS, m
    assert kern.config_for(max(gemv.MMA_MAX_ROWS, gemv.WIDE_MAX_ROWS) + 1).kind == "dot"
    x8 = torch.randn(8, 2048, device="cuda", dtype=torch.float16)  # past the crossover, still correct when asked
    y8 = kern(x8, config=gemv_config(kern.gemv.plan_for(8)))
    assert rel_err(y8, x8.float() @ dequantize(w, torch.float32)) < 2e-3
    x = torch.randn(2, 2048, device="cuda", dtype=torch.float16)
    big = torch.full((2, 1000), float("nan"), device="cuda", dtype=torch.float16)
    kern(x, out=big[:, 100:484])
    ref = x.float() @ dequantize(w, torch.float32)
    assert rel_err(big[:, 100:484], ref) < 2e-3
    assert torch.isnan(big[:, :100]).all() and torch.isnan(big[:, 484:]).all()
    assert torch.equal(kern(x), kern(x))  # a fixed summation order


@needs_gpu
def test_strided_and_transposed_inputs_when_k_needs_no_padding():
    """x with a row stride that is not its width, and a transposed x (column stride 2): the GEMV
    copies either to a contiguous x rather than passing the wrong row stride to the kernel."""
    from flotilla.kernels.triton_linear import TritonGPTQKernel

    w = weight(1024, 256, 4, 128, True, False, seed=8).to("cuda")
    kern = TritonGPTQKernel(w, torch.float16).gemv
    assert kern is not None and kern.layout.k_padded == 1024
    w32 = dequantize(w, torch.float32)
    transposed = torch.randn(1024, 2, device="cuda", dtype=torch.float16).t()  # strides (1, 2)
    wide = torch.randn(2, 1032, device="cuda", dtype=torch.float16)[:, 4:1028]  # row stride 1032, offset 8 bytes
    for x in (transposed, wide):
        assert rel_err(kern(x), x.float() @ w32) < 2e-3, x.stride()


@needs_gpu
def test_graph_replays():
    from flotilla.kernels.triton_linear import TritonGPTQKernel

    w = weight(4096, 512, 4, 128, True, False, seed=7).to("cuda")
    kern = TritonGPTQKernel(w, torch.float16)
    w32 = dequantize(w, torch.float32)
    for m in (1, 4):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.float16)
        graph, y = captured(lambda: kern(x))
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            graph.replay()
            assert rel_err(y, x.float() @ w32) < 2e-3


@needs_gpu
def test_registry_crosses_to_dense_at_the_measured_batch():
    """triton_linear.dense_min_rows on the GPU: below it the Triton tiles, from it dequantize + cuBLAS,
    both the reference's product."""
    from flotilla.kernels.triton_linear import TritonGPTQKernel, dense_min_rows

    w = weight(1024, 512, 4, 128, False, True, seed=10).to("cuda")
    kern = TritonGPTQKernel(w, torch.float16)
    kern.tile = None  # the crossover between the Triton paths (Hopper's tile GEMM: tests/test_tile.py)
    first = dense_min_rows(kern.layout)
    w32 = dequantize(w, torch.float32)
    for m, kind in ((first - 1, "dot"), (first, "dense")):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.float16)
        assert kern.config_for(m).kind == kind
        assert rel_err(kern(x), x.float() @ w32) < 2e-3, m


@needs_gpu
def test_odd_n_falls_back_to_triton():
    from flotilla.kernels.triton_linear import TritonLayoutKernel

    layout = odd_n_layout("cuda")
    kern = TritonLayoutKernel(layout, torch.float16)
    assert kern.gemv is None and kern.config_for(1).kind == "dot"
    gw = random_weight("Q4_0", 33, 256, seed=9, scale=0.01)
    x = torch.randn(1, 256, device="cuda", dtype=torch.float16)
    assert rel_err(kern(x), x.float() @ gw.dequantize(torch.float32).to("cuda").t()) < 2e-3


def test_pdl_only_on_hopper_gpus_and_never_interpreted(monkeypatch):
    from flotilla.kernels import pdl

    assert not pdl.enabled(torch.zeros(1))  # a CPU tensor
    if torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        t = torch.zeros(1, device="cuda")
        hopper = tuple(torch.cuda.get_device_capability()) >= pdl.MIN_CAPABILITY
        assert pdl.enabled(t) == hopper
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert not pdl.enabled(t)
        monkeypatch.delenv("TRITON_INTERPRET")
        monkeypatch.setattr(pdl, "ENABLED", False)
        assert not pdl.enabled(t)


@needs_gpu
def test_pdl_chain_in_a_graph_is_the_chain_without_pdl(monkeypatch):
    """A decode step's pattern captured in a CUDA graph: a Triton norm (or silu * up) writes x, the GEMV
    reads it (register plan and ring); on sm_90+ both as programmatic dependents (the GEMV's weight
    loads before its wait). Fresh inputs at each replay: the outputs are the reference's, and equal to
    the same graph captured without PDL bit for bit (a GEMV reading x before the norm wrote it would
    show the previous replay's x)."""
    from flotilla.kernels import fused, pdl
    from flotilla.kernels.triton_linear import TritonGPTQKernel

    wr = weight(4096, 512, 4, 128, True, False, seed=11).to("cuda")
    wg = weight(16384, 256, 4, 128, False, False, seed=12).to("cuda")
    regs, ring = TritonGPTQKernel(wr, torch.float16), TritonGPTQKernel(wg, torch.float16)
    assert regs.gemv.plan_for(1).stages == 0 and ring.gemv.plan_for(1).stages >= 2
    w_regs, w_ring = dequantize(wr, torch.float32), dequantize(wg, torch.float32)
    norm_w = torch.rand(4096, device="cuda", dtype=torch.float16) + 0.5
    x = torch.empty(1, 4096, device="cuda", dtype=torch.float16)
    gate_up = torch.empty(1, 2 * 16384, device="cuda", dtype=torch.float16)

    def step():
        h = fused.rms_norm(x, norm_w, 1e-5)
        return h, regs(h), ring(fused.silu_mul(gate_up))

    with_pdl = captured(step)
    monkeypatch.setattr(pdl, "ENABLED", False)
    without = captured(step)
    gen = torch.Generator(device="cuda").manual_seed(13)
    for _ in range(4):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda", dtype=torch.float16))
        gate_up.copy_(torch.randn(gate_up.shape, generator=gen, device="cuda", dtype=torch.float16))
        (graph, (h, y_regs, y_ring)), (graph0, outs0) = with_pdl, without
        graph.replay()
        graph0.replay()
        torch.cuda.synchronize()
        act = F.silu(gate_up[:, :16384].float()) * gate_up[:, 16384:].float()
        assert rel_err(y_regs, h.float() @ w_regs) < 2e-3
        assert rel_err(y_ring, act @ w_ring) < 2e-3
        assert all(torch.equal(a, b) for a, b in zip((h, y_regs, y_ring), outs0))


@needs_gpu
@pytest.mark.parametrize("k,n,sym", [(4096, 2048, True), (1024, 768, False), (16384, 512, False)])
def test_silu_epilogue_is_silu_mul_of_the_product(k, n, sym):
    """silu_mul of a [gate | up] weight through the tensor-core plan's epilogue (gate column j and up
    column n/2 + j in one block: the register plan, and the ring at M = 1 on 16384 rows; symmetric and
    uint8 zeros) against kernels/fused.silu_mul of the GEMV's product, and the fp32 reference. Past
    the GEMV's rows, and with a bias, the composed ops."""
    from flotilla.kernels import fused
    from flotilla.kernels.triton_linear import TritonGPTQKernel

    w = weight(k, n, 4, 128, sym, False, seed=22).to("cuda")
    kern = TritonGPTQKernel(w, torch.float16)
    w32 = dequantize(w, torch.float32)
    gen = torch.Generator(device="cuda").manual_seed(23)
    for m in range(1, max(gemv.MMA_MAX_ROWS, gemv.WIDE_MAX_ROWS) + 1):
        assert kern.fuses_silu(m), m
        x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.float16)
        want = fused.silu_mul(kern(x))
        prod = x.float() @ w32
        ref = F.silu(prod[:, : n // 2]) * prod[:, n // 2:]
        poison(m, n // 2, torch.float16)
        got = kern.silu_mul(x)
        assert got.shape == (m, n // 2)
        assert rel_err(got, want.float()) < 1e-3 and rel_err(got, ref) < 3e-3, m
        assert (got == want).float().mean().item() > 0.98, m  # the same roundings: ties of the exp aside
    past = max(gemv.MMA_MAX_ROWS, gemv.WIDE_MAX_ROWS) + 1
    x = torch.randn(past, k, generator=gen, device="cuda", dtype=torch.float16)
    assert not kern.fuses_silu(past) and torch.equal(kern.silu_mul(x), fused.silu_mul(kern(x)))
    plan = gemv.GemvPlan(gemv.WIDE_ROWS, gemv.WIDE_COLS, 2)  # the wide plan's epilogue at 16 rows, 2 warps
    if n % (2 * gemv.WIDE_COLS) == 0:
        x16 = torch.randn(16, k, generator=gen, device="cuda", dtype=torch.float16)
        prod = kern.gemv(x16, plan=plan)
        got = kern.gemv(x16, plan=plan, silu=True)
        assert torch.equal(got, fused.silu_mul(prod)) or (got == fused.silu_mul(prod)).float().mean() > 0.98
    bias = torch.randn(n, generator=gen, device="cuda", dtype=torch.float16)
    x1 = x[:1]
    assert torch.equal(kern.silu_mul(x1, bias), fused.silu_mul(kern(x1, bias)))  # a bias: composed


@needs_gpu
def test_silu_epilogue_in_a_graph_replays_with_fresh_inputs():
    """norm -> gate_up with the silu epilogue -> down, captured once with PDL on sm_90+ and replayed
    with fresh inputs: each replay equals the unfused chain within rounding (a down GEMV reading its
    input before the fused kernel wrote it would show the previous replay's)."""
    from flotilla.kernels import fused
    from flotilla.kernels.triton_linear import TritonGPTQKernel

    up = TritonGPTQKernel(weight(1024, 4096, 4, 128, True, False, seed=24).to("cuda"), torch.float16)
    down = TritonGPTQKernel(weight(2048, 1024, 4, 128, False, False, seed=25).to("cuda"), torch.float16)
    gen = torch.Generator(device="cuda").manual_seed(26)
    norm_w = torch.rand(1024, generator=gen, device="cuda", dtype=torch.float16) + 0.5
    x = torch.empty(1, 1024, device="cuda", dtype=torch.float16)

    def chain(fuse: bool):
        h = fused.rms_norm(x, norm_w, 1e-5)
        return down(up.silu_mul(h) if fuse else fused.silu_mul(up(h)))

    assert up.fuses_silu(1)
    graph, out = captured(lambda: chain(True))
    for _ in range(4):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda", dtype=torch.float16))
        graph.replay()
        want = chain(False)
        torch.cuda.synchronize()
        assert rel_err(out, want.float()) < 2e-3


@needs_gpu
@torch.inference_mode()
def test_decoder_with_the_silu_epilogue_matches_the_composed_ops(monkeypatch):
    """A random INT4 model through its frozen ops (gate_up's silu in the GEMV's epilogue) and through
    the same ops with silu_mul of the product: logits within rounding, the same greedy tokens, for 1
    to 4 rows (the GEMV's) and 8 (the Triton tiles: composed either way)."""
    from flotilla.kernels import fused

    model = tiny_decoder(monkeypatch, 2, seed=20)
    model.freeze()
    model._fusion = None  # the norms as kernels of their own: this test is about gate_up's epilogue
    fused_ops = list(model._frozen)
    assert all(ops.gate_up_act.func.__self__.fuses_silu(1) for ops in fused_ops)
    composed = [dataclasses.replace(ops, gate_up_act=lambda h, g=ops.gate_up: fused.silu_mul(g(h)))
                for ops in fused_ops]

    gen = torch.Generator(device="cuda").manual_seed(21)
    for rows in (1, 2, 3, 4, 8):
        got, want = logits_both_ways(model, rows, gen, lambda: setattr(model, "_frozen", fused_ops),
                                     lambda: setattr(model, "_frozen", composed))
        assert rel_err(got, want) < 3e-3, rows
        assert torch.equal(got.argmax(-1), want.argmax(-1)), rows


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dense_in_chunks_on_the_gpu_in_a_graph_on_a_side_stream(dtype):
    """The overlapped dense path (dequantization on a side stream) eagerly and replayed in a CUDA graph
    captured on a non-default stream, with act-order and a bias, against the reference."""
    from flotilla.kernels.reference import gptq_matmul
    from flotilla.kernels.triton_linear import GemmConfig, TritonGPTQKernel, dense_chunk

    k, n, m = 256, 3 * 4096 + 64, 512  # three full chunks and a short one
    w = weight(k, n, 4, 128, False, True, seed=5).to("cuda")
    kernel = TritonGPTQKernel(w, dtype)
    kernel.tile = None  # the dense path, which Hopper's tile GEMM takes over at these rows (tests/test_tile.py)
    assert kernel.config_for(m) == GemmConfig("dense", chunk=dense_chunk(m, n)) and dense_chunk(m, n) == 4096
    x = torch.randn(m, k, device="cuda").to(dtype)
    bias = torch.randn(n, device="cuda").to(dtype)
    tol = 2e-3 if dtype == torch.float16 else 1.5e-2

    def check(y, x):
        ref = gptq_matmul(x.float(), w) + bias.float()
        assert ((y.float() - ref).norm() / ref.norm()).item() < tol

    check(kernel(x, bias), x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernel(x, bias)  # warm-up on the capturing stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            ys = [kernel(x, bias) for _ in range(3)]
    torch.cuda.current_stream().wait_stream(stream)
    x.copy_(torch.randn(m, k, device="cuda").to(dtype))
    graph.replay()
    torch.cuda.synchronize()
    for y in ys:
        check(y, x)


def test_norm_weight_is_scaled_by_a_power_of_two_to_at_most_one():
    """The producer multiplies r by the norm's weight in fp16: scaled to |w| <= 1 exactly (a power of
    two), the consumer multiplying the power back."""
    w = torch.tensor([0.5, -3.0, 1.25, 0.0], dtype=torch.float16)
    nw = gemv.NormWeight.of(w, 1e-5)
    assert nw.post_scale == 4.0 and nw.eps == 1e-5
    assert torch.equal(nw.scaled.float() * nw.post_scale, w.float())
    small = gemv.NormWeight.of(torch.full((8,), 0.25, dtype=torch.float16), 1e-6)
    assert small.post_scale == 1.0 and torch.equal(small.scaled, torch.full((8,), 0.25, dtype=torch.float16))


@needs_gpu
@pytest.mark.parametrize("k,hidden,n,sym", [(1024, 512, 768, True), (16384, 2048, 1024, False),
                                            (1024, 8192, 256, True)])
def test_norm_fusion_producer_and_consumer(k, hidden, n, sym):
    """The residual add and the RMSNorm folded into two GEMVs: the producer's new residual is bit for
    bit resid + its product (torch's add), its scaled output half(r * w) and its partials sum to
    sum(r^2); the consumer (plain, with a bias, and the silu epilogue) matches the composed ops
    (kernels/fused.rms_norm, then the GEMV) within rounding, for a norm weight above 1 and a large
    residual, 1 to 8 rows (the register plan, and the ring at M = 1 on 16384 rows; on hidden 8192 the
    consumers' ring at M = 1 and, from 3 rows, their partials read from global memory)."""
    from flotilla.kernels import fused
    from flotilla.kernels.triton_linear import TritonGPTQKernel

    prod = TritonGPTQKernel(weight(k, hidden, 4, 128, sym, False, seed=40).to("cuda"), torch.float16)
    cons = TritonGPTQKernel(weight(hidden, n, 4, 128, not sym, False, seed=41).to("cuda"), torch.float16)
    gu = TritonGPTQKernel(weight(hidden, 2 * n, 4, 128, sym, False, seed=42).to("cuda"), torch.float16)
    gen = torch.Generator(device="cuda").manual_seed(43)
    norm_w = (torch.rand(hidden, generator=gen, device="cuda") * 3 + 0.1).to(torch.float16)
    bias = torch.randn(n, generator=gen, device="cuda", dtype=torch.float16)
    nw = gemv.NormWeight.of(norm_w, 1e-5)
    for m in range(1, gemv.MMA_MAX_ROWS + 1):
        assert prod.fuses_norm(m) and cons.fuses_norm(m) and gu.fuses_norm(m), m
        x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.float16) * 0.05
        resid = torch.randn(m, hidden, generator=gen, device="cuda", dtype=torch.float16) * 40
        poison(m, hidden, torch.float16)
        nr = prod.add_norm(x, resid, nw)
        r = resid + prod(x)
        assert torch.equal(nr.resid, r), m
        assert torch.equal(nr.scaled, (r.float() * nw.scaled.float()).half()), m
        assert nr.partials.shape == (m, hidden // 16)
        assert torch.allclose(nr.partials.sum(1), (r.float() ** 2).sum(1), rtol=1e-5), m
        h = fused.rms_norm(r, norm_w, 1e-5)
        poison(m, n, torch.float16)
        assert rel_err(cons.normed(nr), cons(h).float()) < 2e-3, m
        assert rel_err(cons.normed(nr, bias), cons(h, bias).float()) < 2e-3, m
        poison(m, n, torch.float16)
        assert rel_err(gu.silu_mul_normed(nr), fused.silu_mul(gu(h)).float()) < 3e-3, m
    assert not prod.fuses_norm(gemv.MMA_MAX_ROWS + 1)


@needs_gpu
def test_norm_fusion_in_a_graph_replays_with_fresh_inputs():
    """producer (add + norm) -> consumer with the silu epilogue -> producer -> consumer, captured with
    PDL on sm_90+ and replayed with fresh inputs: each replay equals the composed chain within rounding
    (a consumer reading partials or x before its producer wrote them would show the previous replay's)."""
    from flotilla.kernels import fused
    from flotilla.kernels.triton_linear import TritonGPTQKernel

    o = TritonGPTQKernel(weight(1024, 1024, 4, 128, True, False, seed=44).to("cuda"), torch.float16)
    gu = TritonGPTQKernel(weight(1024, 4096, 4, 128, False, False, seed=45).to("cuda"), torch.float16)
    down = TritonGPTQKernel(weight(2048, 1024, 4, 128, True, False, seed=46).to("cuda"), torch.float16)
    qkv = TritonGPTQKernel(weight(1024, 1536, 4, 128, False, False, seed=47).to("cuda"), torch.float16)
    gen = torch.Generator(device="cuda").manual_seed(48)
    w1, w2 = ((torch.rand(1024, generator=gen, device="cuda") + 0.5).half() for _ in range(2))
    n1, n2 = gemv.NormWeight.of(w1, 1e-5), gemv.NormWeight.of(w2, 1e-5)
    x = torch.empty(1, 1024, device="cuda", dtype=torch.float16)
    resid = torch.empty(1, 1024, device="cuda", dtype=torch.float16)

    def chain(fuse: bool):
        if fuse:
            mid = o.add_norm(x, resid, n1)
            nr = down.add_norm(gu.silu_mul_normed(mid), mid.resid, n2)
            return nr.resid, qkv.normed(nr)
        r1, h1 = fused.add_rms_norm(resid, o(x), w1, 1e-5)
        r2, h2 = fused.add_rms_norm(r1, down(fused.silu_mul(gu(h1))), w2, 1e-5)
        return r2, qkv(h2)

    graph, (r_out, y_out) = captured(lambda: chain(True))
    for _ in range(4):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda", dtype=torch.float16))
        resid.copy_(torch.randn(resid.shape, generator=gen, device="cuda", dtype=torch.float16) * 10)
        graph.replay()
        r_want, y_want = chain(False)
        torch.cuda.synchronize()
        assert rel_err(r_out, r_want.float()) < 1e-3
        assert rel_err(y_out, y_want.float()) < 3e-3


@needs_gpu
@torch.inference_mode()
def test_decoder_with_the_norm_fusion_matches_the_norm_kernels(monkeypatch):
    """A random INT4 model's frozen forward with the residual adds and norms in the GEMVs
    (NormFusion) against the same model with norm kernels: logits within rounding and the same
    greedy tokens for 1 and 2 rows (NORM_FUSION_ROWS); from 3 rows on (slower there, and at 8 the
    Triton tiles) the fusion does not serve; FLOTILLA_NORM_FUSION=1 / 0 turns it on / off."""
    from flotilla.models.llama import NORM_FUSION_ENV, NORM_FUSION_ROWS

    monkeypatch.setenv(NORM_FUSION_ENV, "1")
    model = tiny_decoder(monkeypatch, 3, seed=27)
    model.freeze()
    fusion = model._fusion
    assert fusion is not None and len(fusion) == 3 and fusion[-1].next_input is None
    assert model._fused_rows(1) and model._fused_rows(NORM_FUSION_ROWS)
    assert not model._fused_rows(NORM_FUSION_ROWS + 1) and not model._fused_rows(8)

    gen = torch.Generator(device="cuda").manual_seed(28)
    for rows in (1, 2, 3, 4, 8):
        got, want = logits_both_ways(model, rows, gen, lambda: setattr(model, "_fusion", fusion),
                                     lambda: setattr(model, "_fusion", None))
        assert rel_err(got, want) < 3e-3, rows
        assert torch.equal(got.argmax(-1), want.argmax(-1)), rows
        if rows > NORM_FUSION_ROWS:
            assert torch.equal(got, want)
    monkeypatch.setenv(NORM_FUSION_ENV, "0")
    model.freeze()
    assert model._fusion is None
