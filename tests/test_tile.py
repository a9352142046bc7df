"""The tile GEMM over the Triton layout on Hopper (flotilla/kernels/cuda/tile.py, csrc/tile.cuh).

On any machine: a numpy emulation of what every lane of every warpgroup decodes into wgmma's A fragments
(its words, run, k16 step, group, the pair decode of the GEMV), what the descriptor reads of the swizzled
x stage as B, and where the epilogue puts each accumulator, against x @ W; which layouts it reads and
which it leaves to the other paths, the block-height rule and where it serves, and (where nvcc is
installed) that the library builds for sm_90a with no register spills and no serialized wgmma, exports
its C functions, and agrees with the ctypes view of its parameters.
With a Hopper GPU: the kernel against `kernels/reference` (short last groups and padded input,
asymmetric zeros, act-order, one group, 4 and 8 bits, every block height, batches that are not a
multiple of it, out-features that are not a multiple of 128, bias, a column slice as `out`,
NaN-poisoned outputs, CUDA-graph replays), and where the registry picks it.
"""
from __future__ import annotations

import ctypes
import re
import subprocess

import numpy as np
import pytest
import torch
from conftest import GPU
from gemv_emulation import _pair_f16, fp16, reference_rows
from test_cuda_kernels import weight

from flotilla.kernels.cuda import build, gemv, tile
from flotilla.kernels.reference import dequantize
from flotilla.kernels.triton_layout import repack

hopper = GPU and torch.cuda.get_device_capability(0) == (9, 0)  # conftest.GPU: compiled Triton kernels too
needs_hopper = pytest.mark.skipif(not hopper, reason="needs a Hopper (sm_90) GPU: wgmma")

CASES = [  # k, n, bits, group, sym, act_order
    (1024, 256, 4, 128, True, False),  # 4 blocks of 256 rows, 2 groups a block
    (520, 200, 4, 128, False, False),  # short last group, padded input (K = 520 of 768), N not a multiple of 128
    (768, 136, 4, 64, False, True),  # group 64 (a group a stage), act-order, asymmetric
    (512, 128, 4, -1, True, True),  # one group, act-order
    (640, 72, 8, 128, False, False),  # 8 bits: blocks of 128 rows, asymmetric, N < 128
    (1024, 384, 8, 64, True, False),  # 8 bits, group 64
]


def emulate_tile(layout, x: np.ndarray, nr: int, splits: int = 1) -> np.ndarray:
    """y [M, N] as csrc/tile.cuh computes it, in float64, from x [M, K] (fp16 values), the input axis cut into
    `splits` ranges of whole layout blocks whose partial accumulators are summed in split order."""
    bits, pairs = layout.bits, 16 // layout.bits
    words = layout.words.numpy().view(np.uint32).astype(np.uint64)
    n, kw = words.shape
    m, k = x.shape
    magic = gemv.geometry(layout, torch.float16).group_magic  # the kernel's stage -> group (a multiply-high)
    assert all(gemv.group_of(s, magic) == s // (layout.group_size // 64) for s in range(kw // 32 * pairs))
    scales = layout.scales.double().numpy()
    zeros = layout.zeros.numpy().astype(np.uint64) if layout.zeros is not None else None
    g, c = np.arange(32) >> 2, np.arange(32) & 3  # lane (g, c)
    y = np.zeros((m, n))
    for m0 in range(0, m, nr):
        for n0 in range(0, n, tile.BLOCK_COLS):
            for wg in range(2):
                acc = np.zeros((64, nr))  # D: rows the warpgroup's 64 out-features, columns the block's batch rows
                nb = kw // 32
                for s in (s for sp in range(splits) for s in range(sp * nb // splits * pairs,
                                                                    (sp + 1) * nb // splits * pairs)):
                    b, t = divmod(s, pairs)
                    # the weight slot as the tensor copy stores it: column r's 16-byte piece h (words 4 h .. 4 h + 3
                    # of its layout block b) at r * 128 + (h ^ r % 8) * 16, columns past N zero
                    wslot = np.zeros((tile.BLOCK_COLS, 32), np.uint64)
                    for r in range(min(tile.BLOCK_COLS, n - n0)):
                        for h in range(8):
                            wslot[r, 4 * (h ^ (r % 8)):4 * (h ^ (r % 8)) + 4] = words[n0 + r, b * 32 + 4 * h:b * 32 + 4 * h + 4]
                    # the stage as the tensor copy stores it: row r's 16-byte chunk h at r * 128 + (h ^ r % 8) * 16
                    stage = np.zeros((nr, 64))
                    for r in range(min(nr, m - m0)):
                        for h in range(8):
                            kk = 64 * s + 8 * h
                            if kk < k:
                                stage[r, 8 * (h ^ (r % 8)):8 * (h ^ (r % 8)) + 8] = x[m0 + r, kk:kk + 8]
                    for j in range(4):
                        # B[kk, r] as the descriptor reads it: start address + 32 j, chunk (2 j + kk / 8) ^ r % 8
                        b_mat = np.array([[stage[r, 8 * ((2 * j + kk // 8) ^ (r % 8)) + kk % 8] for r in range(nr)]
                                          for kk in range(16)])
                        a_mat = np.zeros((64, 16))
                        for wq in range(4):
                            cols = [np.minimum(n0 + 64 * wg + 16 * wq + g + 8 * hf, n - 1) for hf in (0, 1)]
                            grp = gemv.group_of(s, magic)
                            regs = ((0, 2 * j, 2 * c), (1, 2 * j, 2 * c), (0, 2 * j + 1, 2 * c + 8),
                                    (1, 2 * j + 1, 2 * c + 8))  # (column half, word i, fragment k) of a0-a3
                            for hf, i, kk in regs:
                                col = cols[hf]
                                nl = 64 * wg + 16 * wq + g + 8 * hf  # the thread's column in the slot: nl % 8 = g
                                word = wslot[nl, 4 * (i ^ g) + c]
                                z = zeros[grp, col] if zeros is not None else np.full(32, layout.zero_const, np.uint64)
                                lo, hi = _pair_f16(word, t, bits, z * 0x00010001)
                                sc = fp16(scales[grp, col])
                                row = 16 * wq + g + 8 * hf
                                a_mat[row, kk], a_mat[row, kk + 1] = fp16(lo * sc), fp16(hi * sc)
                        acc += a_mat @ b_mat
                for i in range(nr // 2):  # the epilogue: accumulator i of lane (g, c) of warp wq
                    for wq in range(4):
                        rows = 8 * (i // 4) + 2 * c + (i & 1)
                        outs = n0 + 64 * wg + 16 * wq + g + 8 * ((i >> 1) & 1)
                        ok = (m0 + rows < m) & (outs < n)
                        y[m0 + rows[ok], outs[ok]] = acc[(16 * wq + g + 8 * ((i >> 1) & 1))[ok], rows[ok]]
    return y


@pytest.mark.parametrize("case", [(512, 200, 4, 128, False, False), (384, 136, 4, 64, True, True),
                                  (256, 72, 8, 128, False, False)])
def test_emulated_kernel_is_the_matmul(case):
    """Every block, warpgroup, lane, stage and k16 step: the fragments and the swizzled x give x @ W exactly (in
    float64), across a partial row block, out-features clamped past N and padded input."""
    k, n, bits, group, sym, act = case
    w = weight(k, n, bits, group, sym, act, seed=9)
    layout = repack(w)
    tile.check_layout(layout, torch.float16)
    x = np.random.default_rng(1).standard_normal((70, k)).astype(np.float16).astype(np.float64)
    ref = x @ reference_rows(w, layout, torch.float16)  # x in the layout's row order (act-order sorted) below
    for nr, splits in ((64, 1), (128, 1), (64, 2), (64, layout.words.shape[1] // 32)):  # the last: a split a
        # layout block
        y = emulate_tile(layout, x, nr, splits)
        np.testing.assert_allclose(y, ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())


def test_layouts_it_reads_and_those_it_leaves():
    ok = repack(weight(512, 128, 4, 128, True, False))
    tile.check_layout(ok, torch.float16)
    tile.check_layout(repack(weight(512, 128, 8, 128, False, True)), torch.float16)
    with pytest.raises(tile.TileUnsupported, match="bfloat16"):
        tile.check_layout(ok, torch.bfloat16)
    with pytest.raises(tile.TileUnsupported, match="words a column a block"):
        tile.check_layout(repack(weight(512, 128, 4, 32, True, False)), torch.float16)  # group 32: R = 16
    with pytest.raises(tile.TileUnsupported, match="multiples of 8"):
        tile.check_layout(repack(weight(512, 100, 8, 128, True, False)), torch.float16)
    with pytest.raises(tile.TileUnsupported, match="multiples of 8"):
        tile.check_layout(repack(weight(516, 128, 8, -1, True, False)), torch.float16)


def test_block_rows_are_the_tallest_that_hold_the_batch_and_splits_fill_a_wave_or_two():
    assert [tile.block_rows(m) for m in (1, 64, 65, 128, 129, 256, 2048)] == [64, 64, 128, 128, 256, 256, 256]
    sms, kb = 132, 16  # an H100; 16 layout blocks: 4096 input rows at 4 bits
    # blocks of up to 64 rows run two an SM: a wave holds 264
    assert tile.split_k(64, 4096, 64, kb, sms) == 8  # 32 column tiles: 256 blocks
    assert tile.split_k(64, 14336, 64, kb, sms) == 2  # 112 tiles: 224 blocks (a third split: 2 waves, no gain)
    assert tile.split_k(64, 28672, 64, 32, sms) == 1  # 224 tiles: past FILL of 264
    assert tile.split_k(128, 4096, 128, kb, sms) == 4  # 32 column tiles: 4 x 32 = 128 blocks, one wave
    assert tile.split_k(512, 4096, 256, kb, sms) == 2  # 64 tiles
    assert tile.split_k(1024, 4096, 256, kb, sms) == 1  # 128 tiles fill it
    assert tile.split_k(128, 14336, 128, kb, sms) == 1  # 112 column tiles: past FILL
    assert tile.split_k(128, 6144, 128, kb, sms) == 2  # 48 tiles: a third split would make 144 blocks
    assert tile.split_k(200, 10240, 256, kb, sms) == 3  # 80 tiles: 3 splits in 2 waves (measured faster than 1)
    assert tile.split_k(200, 12288, 256, kb, sms) == 1  # 96 tiles: 3 splits would take 3 waves, 2 tie
    assert tile.split_k(128, 512, 128, kb, sms) == tile.MAX_SPLITS  # 4 tiles
    assert tile.split_k(128, 512, 128, 6, sms) == 3  # 6 layout blocks: at least 2 a split
    assert tile.split_k(128, 512, 128, 1, sms) == 1
    for m in (1, 100, 1000, 5000):
        for n in (128, 4096, 28672):
            assert 1 <= tile.split_k(m, n, tile.block_rows(m), kb, sms) <= tile.MAX_SPLITS
    # 256 rows of a 4096x4096 weight: 256-row blocks would need 4 splits of 16 stages; 128-row ones need 2
    assert tile.plan_rows(256, 4096, kb, sms, 4) == 128 and tile.split_k(256, 4096, 128, kb, sms) == 2
    assert tile.plan_rows(256, 4096, 2 * kb, sms, 8) == 128  # 8 bits: 32 layout blocks of 2 stages
    assert tile.plan_rows(256, 4096, 56, sms, 4) == 256  # 14336 input rows: 4 splits of 56 stages
    assert tile.plan_rows(256, 4096, 112, sms, 8) == 256
    assert tile.plan_rows(512, 4096, kb, sms, 4) == 256  # 2 splits of 32 stages
    assert tile.plan_rows(256, 28672, 32, sms, 4) == 256 and tile.plan_rows(64, 4096, kb, sms, 4) == 64


def test_served_exactly_where_it_measured_faster():
    """Run 2 of bench/NOTES-kernels.md round 8 (an H100): each (out-features, bits, rows) the rule gives the tile GEMM
    (with its block height and split) was faster there than the Triton tiles / dequantize + cuBLAS, but one tie
    (4096x14336 W4 at 1024 rows, 224.5 against 222.6 µs); each it leaves out was not. 1024 rows at 8 bits and 2048
    at both: round 11's sweep (the weight ring, the group by multiply-high; 4096x14336 W8 at 2048 a tie, 396.0 against
    394.5 µs). 64 rows: the Triton tiles won or tied on 4096x4096, 4096x14336 and 14336x4096 at 4 bits. 96 rows:
    round 12, the tile 1.2-2.0x faster than the Triton tiles on all four llama shapes at both widths."""
    won = [(n, bits, m) for n in (4096, 14336, 28672) for bits in (4, 8) for m in (96, 128, 256, 512, 1024, 2048)]
    lost = [(4096, 4, 64), (14336, 4, 64), (28672, 8, 64), (4096, 4, 4096), (28672, 8, 4096)]
    for n, bits, m in won:
        assert tile.serves(m, bits), (n, bits, m)
    for n, bits, m in lost:
        assert not tile.serves(m, bits), (n, bits, m)
    # round 19 (H100): from 40 rows on the widest weights (gate_up of the 8B, the 70B's), where the 64-row blocks beat
    # the Triton tiles at 40, 48 and 64 rows at both widths; not on 14336x4096 nor 4096x14336 (tied or lost at 64)
    for k, n in ((4096, 28672), (8192, 28672), (28672, 8192), (8192, 57344)):
        for bits in (4, 8):
            assert tile.serves(40, bits, k * n) and tile.serves(64, bits, k * n) and not tile.serves(39, bits, k * n)
    assert not tile.serves(64, 4, 14336 * 4096) and not tile.serves(64, 4, 4096 * 14336)


def test_the_environment_switch(monkeypatch):
    for value, want in (("1", "on"), ("0", "off"), ("nosplit", "nosplit"), (" OFF ", "off")):
        monkeypatch.setenv(tile.ENV, value)
        assert tile.env_setting() == want
    monkeypatch.setenv(tile.ENV, "no")
    assert tile.env_setting() == "on"  # logged once: not understood
    monkeypatch.delenv(tile.ENV)
    assert tile.env_setting() == "on"


def test_no_tile_off_hopper_or_on_cpu():
    lay = repack(weight(512, 128, 4, 128, True, False))
    assert tile.tile_for(lay, torch.float16) is None  # a CPU layout
    if torch.cuda.is_available() and not hopper:
        assert tile.tile_for(repack(weight(512, 128, 4, 128, True, False).to("cuda")), torch.float16) is None


nvcc = build.find_nvcc()


def nvcc_version() -> tuple[int, int]:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release (\d+)\.(\d+)", out)
    return (int(found[1]), int(found[2])) if found else (0, 0)


@pytest.mark.skipif(nvcc is None or nvcc_version() < (12, 0), reason="needs nvcc 12.0 or newer (sm_90a, tensor maps)")
def test_library_builds_for_sm90a_without_spills_or_serialized_wgmma(tmp_path):
    """Compile each source as the first use on an H100 / H200 would, with ptxas's report: no spills, no
    wgmma serialization warning, the warp-specialized kernels at 168 registers; then link and load it (no GPU
    needed) and check the parameter block."""
    flags = [*build.FLAGS, *build.arch_flags((9, 0))]
    ws_regs = {}
    for src in build.TILE.sources:
        proc = subprocess.run([nvcc, *flags, "-Xptxas", "-v", "-c", str(build.CSRC / src), "-o",
                               str(tmp_path / (src + ".o"))], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        report = proc.stderr
        assert "wgmma" not in report.lower() or "serialized" not in report.lower(), report[-2000:]
        spills = [int(v) for v in re.findall(r"(\d+) bytes spill stores", report)]
        assert not any(spills), report[-2000:]
        # the warp-specialized instances (template flag "b1") must launch with the full 168 registers a thread:
        # their MMA warps' setmaxnreg.inc takes 240 from the block's pool and would wait for ever on less
        ws = re.findall(r"Compiling entry function '(\w+)'[^\n]*\n(?:[^\n]*\n)*?[^\n]*Used (\d+) registers", report)
        ws_regs.update({name: int(regs) for name, regs in ws if "ELb1E" in name})
    assert len(ws_regs) == 4 and set(ws_regs.values()) == {168}, ws_regs  # 128 and 256 rows, 4 and 8 bits
    path = tmp_path / "flotilla_tile.so"
    build.compile_library(nvcc, (9, 0), path, build.TILE)
    cdll = ctypes.CDLL(str(path))
    assert cdll.flotilla_tile_param_size() == ctypes.sizeof(tile._Params)
    lib = tile._Library(cdll)  # the argument types and the size check
    assert lib.cdll is cdll


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def poison(m: int, n: int) -> None:
    """A NaN-filled block of the output's size in the caching allocator: an unwritten output shows NaN."""
    torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")


@needs_hopper
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference_at_every_block_height(case):
    from flotilla.kernels.triton_linear import TritonGPTQKernel

    k, n, bits, group, sym, act = case
    w = weight(k, n, bits, group, sym, act, seed=5).to("cuda")
    kern = TritonGPTQKernel(w, torch.float16)
    assert kern.tile is not None
    w32 = dequantize(w, torch.float32)
    for m in (1, 37, 64, 130, 300):
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        bias = torch.randn(n, device="cuda", dtype=torch.float16)
        ref = x.float() @ w32 + bias.float()
        for rows in tile.BLOCK_ROWS:
            poison(m, n)
            y = kern.tile(x, bias, rows=rows)
            assert y.shape == (m, n) and bool(torch.isfinite(y).all()), (m, rows)
            assert rel_err(y, ref) < 2e-3, (m, rows, rel_err(y, ref))
        assert rel_err(kern.tile(x), x.float() @ w32) < 2e-3  # no bias, the default height


@needs_hopper
@pytest.mark.parametrize("case", CASES[:2] + CASES[4:5])
def test_split_k_matches_reference_and_is_deterministic(case):
    """Split-K at every block height and every split count up to a split a layout block: the reference's
    result, bit for bit the same on a second call (the counters reset; the splits summed in split order)."""
    from flotilla.kernels.triton_linear import TritonGPTQKernel

    k, n, bits, group, sym, act = case
    w = weight(k, n, bits, group, sym, act, seed=15).to("cuda")
    kern = TritonGPTQKernel(w, torch.float16)
    w32 = dequantize(w, torch.float32)
    nb = kern.tile.k_blocks
    for m in (37, 300):
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        bias = torch.randn(n, device="cuda", dtype=torch.float16)
        ref = x.float() @ w32 + bias.float()
        for rows in tile.BLOCK_ROWS:
            for splits in sorted({2, 3, nb} & set(range(2, nb + 1))):
                poison(m, n)
                tiles = -(-m // rows) * -(-n // tile.BLOCK_COLS)  # and the workspace: a partial read unwritten shows NaN
                torch.full((splits * tiles * tile.BLOCK_COLS * rows,), float("nan"), device="cuda")
                y = kern.tile(x, bias, rows=rows, splits=splits)
                assert bool(torch.isfinite(y).all()) and rel_err(y, ref) < 2e-3, (m, rows, splits, rel_err(y, ref))
                assert torch.equal(kern.tile(x, bias, rows=rows, splits=splits), y), (m, rows, splits)
    with pytest.raises(ValueError, match="splits of the input axis"):
        kern.tile(x, rows=64, splits=nb + 1)


@needs_hopper
@pytest.mark.parametrize("bits", [4, 8])
def test_weight_ring_wraps_and_repeated_calls_agree_bit_for_bit(bits):
    """4096 input rows: 16 (4 bits) or 32 (8 bits) layout blocks, so every slot of the weight ring is refilled
    several times; 600 rows: three blocks of 256 rows read each weight tile, the case where the first weight-ring
    build raced (a slot overwritten before its reads were ordered: bench/NOTES-kernels.md round 11). Every call the
    same bits, at every block height, whole and split."""
    from flotilla.kernels.triton_linear import TritonGPTQKernel

    k, n, m = 4096, 384, 600
    w = weight(k, n, bits, 128, True, False, seed=21).to("cuda")
    kern = TritonGPTQKernel(w, torch.float16)
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    ref = x.float() @ dequantize(w, torch.float32)
    for rows in tile.BLOCK_ROWS:
        for splits in (1, 3):
            first = kern.tile(x, rows=rows, splits=splits).clone()
            assert rel_err(first, ref) < 2e-3, (rows, splits)
            for _ in range(10):
                assert torch.equal(kern.tile(x, rows=rows, splits=splits), first), (rows, splits)


@needs_hopper
def test_column_slice_out_strided_x_and_graph_replays():
    from flotilla.kernels.triton_linear import TritonGPTQKernel

    k, n, m = 1024, 256, 200
    w = weight(k, n, 4, 128, False, False, seed=6).to("cuda")
    kern = TritonGPTQKernel(w, torch.float16)
    w32 = dequantize(w, torch.float32)
    merged = torch.full((m, n + 72), float("nan"), device="cuda", dtype=torch.float16)
    xs = torch.randn(m, k + 8, device="cuda", dtype=torch.float16)[:, 8:]  # rows 16-byte aligned, offset start
    out = kern.tile(xs, None, merged[:, 40:40 + n], rows=128)
    assert out.data_ptr() == merged[:, 40:].data_ptr()
    assert rel_err(merged[:, 40:40 + n], xs.float() @ w32) < 2e-3
    assert torch.isnan(merged[:, :40]).all() and torch.isnan(merged[:, 40 + n:]).all()
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    kern.tile(x)  # load and configure outside the capture
    torch.cuda.synchronize()
    kern.tile(x, rows=64, splits=4)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kern.tile(x)
        y_split = kern.tile(x, rows=64, splits=4)  # split-K: its counters reset by every replay's last blocks
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(y, x.float() @ w32) < 2e-3
        assert rel_err(y_split, x.float() @ w32) < 2e-3


@needs_hopper
def test_registry_picks_the_tile_where_it_serves():
    from flotilla.kernels.triton_linear import TritonGPTQKernel

    w = weight(512, 14336, 4, 128, True, False, seed=7).to("cuda")  # 112 column tiles: blocks of 128 rows fill an H100
    kern = TritonGPTQKernel(w, torch.float16)
    w32 = dequantize(w, torch.float32)
    top = tile.MAX_ROWS[4]
    assert kern.config_for(tile.MIN_ROWS).kind == "tile" and kern.config_for(tile.MIN_ROWS).block_m == 128
    assert kern.config_for(256).block_m == 256
    assert kern.config_for(tile.MIN_ROWS - 1).kind != "tile"
    assert kern.config_for(top).kind == "tile" and kern.config_for(top + 1).kind != "tile"
    for m in (tile.MIN_ROWS - 1, tile.MIN_ROWS, top, top + 1):
        x = torch.randn(m, 512, device="cuda", dtype=torch.float16)
        assert rel_err(kern(x), x.float() @ w32) < 2e-3
    narrow_w = weight(2048, 1024, 4, 128, True, False, seed=8).to("cuda")
    narrow = TritonGPTQKernel(narrow_w, torch.float16)
    cfg = narrow.config_for(256)  # 8 column tiles of 256 rows: the input axis (8 layout blocks) split in four
    assert (cfg.kind, cfg.block_m, cfg.split_k) == ("tile", 256, 4)
    x = torch.randn(256, 2048, device="cuda", dtype=torch.float16)
    assert rel_err(narrow(x), x.float() @ dequantize(narrow_w, torch.float32)) < 2e-3
