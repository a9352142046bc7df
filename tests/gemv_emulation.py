"""A numpy emulation of the GEMV's lanes (flotilla/kernels/cuda/csrc/gemv.cuh, gemv_mma.cuh) for
tests/test_gemv.py: what every lane reads, decodes and hands the tensor cores, from the kernels' own
index arithmetic and bit tricks."""
from __future__ import annotations

import numpy as np
import torch

from flotilla.kernels.cuda import gemv
from flotilla.kernels.gptq import GPTQWeight
from flotilla.kernels.reference import dequantize


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
    A = q - z by the pair decode of the CUDA-core plan (its zero constants from the zero the lane
    holds for the column), the per-group, per-parity accumulators times the scale and zero words
    its ring copies (ring_scale, ring_zero); float offsets (GGUF forms): each group's sum of x from the
    mma with A = 1.0, times the offset word the ring copies (ring_scale of the offsets); in float64.
    x: [M, k_padded]."""
    geo = gemv.geometry(layout, torch.float16)
    assert geo.mma
    off = geo.mode == gemv.OFF
    bits, pairs = layout.bits, 16 // layout.bits
    r = 1 << geo.log2r
    spb, tpg, par, bk = r // 16, geo.tpg, (2 if bits == 4 else 1), 2 * r * pairs
    words = layout.words.numpy().view(np.uint32).astype(np.uint64)
    n, kw = words.shape
    m_rows = x.shape[0]
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    xrow = np.minimum(g, m_rows - 1)
    y = np.zeros((n, 8))
    for n0 in range(0, n, 16):
        for b in range(kw // r):
            grp = [gemv.group_of(b * pairs + q * tpg, geo.group_magic) for q in range(pairs // tpg)]
            acc = np.zeros((len(grp), par, 16, 8))
            accx = np.zeros((len(grp), 16, 8))  # OFF: the sum of x over each group's rows
            for sq in range(spb):
                base = b * r + 16 * sq + 4 * t  # [32] this lane's first word
                wa = words[n0 + g[:, None], base[:, None] + np.arange(4)]  # [32, 4]
                wb = words[n0 + g[:, None] + 8, base[:, None] + np.arange(4)]
                for s in range(pairs):
                    q, v = s // tpg, s % par
                    rows = b * bk + s * 2 * r + 32 * sq + 8 * t  # [32]
                    xs = x[xrow[:, None], rows[:, None] + np.arange(8)]  # [32, 8]
                    z = (np.concatenate([ring_zero(layout, grp[q], n0, g, c) for c in (0, 1)])
                         if layout.zeros is not None else np.full(64, layout.zero_const, dtype=np.uint64))
                    for h in range(2):
                        a_mat, b_mat = np.zeros((16, 16)), np.zeros((16, 8))
                        for reg, (col, word, kk) in enumerate(((g, wa[:, 2 * h], 2 * t), (g + 8, wb[:, 2 * h], 2 * t),
                                                               (g, wa[:, 2 * h + 1], 2 * t + 8),
                                                               (g + 8, wb[:, 2 * h + 1], 2 * t + 8))):
                            zlane = z[np.where(reg % 2, 32 + lane, lane)]  # the zero of the lane's column
                            lo, hi = _pair_f16(word, s, bits, zlane * 0x00010001)
                            a_mat[col, kk], a_mat[col, kk + 1] = lo, hi
                        b_mat[2 * t, g], b_mat[2 * t + 1, g] = xs[:, 4 * h], xs[:, 4 * h + 1]
                        b_mat[2 * t + 8, g], b_mat[2 * t + 9, g] = xs[:, 4 * h + 2], xs[:, 4 * h + 3]
                        acc[q, v] += a_mat @ b_mat
                        if off:
                            accx[q] += np.ones((16, 16)) @ b_mat
            for q, gi in enumerate(grp):
                for v in range(par):
                    if tpg == 1 and v != q % par:
                        continue
                    f = np.zeros(16)  # fragment rows g, g + 8: the scales lane (g, t) reads
                    f[g], f[g + 8] = ring_scale(layout, gi, n0, g, 0), ring_scale(layout, gi, n0, g, 1)
                    y[n0:n0 + 16] += f[:, None] * acc[q, v]
                if off:
                    f = np.zeros(16)
                    f[g] = ring_scale(layout, gi, n0, g, 0, layout.offsets)
                    f[g + 8] = ring_scale(layout, gi, n0, g, 1, layout.offsets)
                    y[n0:n0 + 16] += f[:, None] * accx[q]
    return y[:, :m_rows].T


def wide_columns(n: int, cols: int, silu: bool) -> list[np.ndarray]:
    """The wide plan's columns of each block (gemv_wide.cuh col_of): octet c of a block of `cols` is
    columns col_of(c) .. + 8; under silu the first half of the octets is gate, the second up."""
    nc, out = cols // 8, []
    for blk in range(n // cols):
        if silu:
            n0 = blk * cols // 2
            firsts = [n0 + 8 * c if c < nc // 2 else n // 2 + n0 + 8 * (c - nc // 2) for c in range(nc)]
        else:
            firsts = [blk * cols + 8 * c for c in range(nc)]
        out.append(np.array(firsts))
    return out


def emulate_wide(layout, x: np.ndarray, cols: int, silu: bool = False) -> np.ndarray:
    """x @ W [M, N] (M <= 16) as the wide tensor-core plan (gemv_wide.cuh) computes it, before the
    epilogue (silu only changes which columns a block holds): from what each lane (g, t) loads (words
    4t..4t+3 of its column g of every octet, x of batch rows g and g + 8 clamped to M - 1), the
    fragments it hands mma.sync by the PTX m16n8k16 layouts (A = x: rows g / g + 8 at k 2t, 2t+1 and
    2t+8, 2t+9; B = q - z of column g at those k; C rows g / g + 8, columns 2t, 2t+1), one accumulator a
    group and strip, times the scales of columns 2t, 2t+1 of the octet from the block's table (which
    copies each group's row of the block's columns); in float64. x: [M, k_padded]."""
    geo = gemv.geometry(layout, torch.float16)
    assert geo.mma
    bits, pairs = layout.bits, 16 // layout.bits
    r = 1 << geo.log2r
    spb, tpg, bk = r // 16, geo.tpg, 2 * r * pairs
    words = layout.words.numpy().view(np.uint32).astype(np.uint64)
    scales = layout.scales.float().double().numpy()
    zeros = layout.zeros.numpy().astype(np.uint64) if layout.zeros is not None else None
    n, kw = words.shape
    m_rows = x.shape[0]
    assert m_rows <= 16
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    x0, x1 = np.minimum(g, m_rows - 1), np.minimum(g + 8, m_rows - 1)
    y = np.zeros((16, n))
    for firsts in wide_columns(n, cols, silu):
        for b in range(kw // r):
            grp = [gemv.group_of(b * pairs + q * tpg, geo.group_magic) for q in range(pairs // tpg)]
            for sq in range(spb):
                base = b * r + 16 * sq + 4 * t  # [32] this lane's first word
                for c, first in enumerate(firsts):
                    wl = words[first + g[:, None], base[:, None] + np.arange(4)]  # [32, 4]
                    for q, gi in enumerate(grp):
                        z = zeros[gi, first + g] if zeros is not None else np.full(32, layout.zero_const, np.uint64)
                        acc = np.zeros((16, 8))
                        for s in range(q * tpg, (q + 1) * tpg):
                            rows = b * bk + s * 2 * r + 32 * sq + 8 * t  # [32]
                            xa = x[x0[:, None], rows[:, None] + np.arange(8)]  # [32, 8]
                            xb = x[x1[:, None], rows[:, None] + np.arange(8)]
                            for h in range(2):
                                a_mat, b_mat = np.zeros((16, 16)), np.zeros((16, 8))
                                a_mat[g, 2 * t], a_mat[g, 2 * t + 1] = xa[:, 4 * h], xa[:, 4 * h + 1]
                                a_mat[g + 8, 2 * t], a_mat[g + 8, 2 * t + 1] = xb[:, 4 * h], xb[:, 4 * h + 1]
                                a_mat[g, 2 * t + 8], a_mat[g, 2 * t + 9] = xa[:, 4 * h + 2], xa[:, 4 * h + 3]
                                a_mat[g + 8, 2 * t + 8], a_mat[g + 8, 2 * t + 9] = xb[:, 4 * h + 2], xb[:, 4 * h + 3]
                                for word, kk in ((wl[:, 2 * h], 2 * t), (wl[:, 2 * h + 1], 2 * t + 8)):
                                    lo, hi = _pair_f16(word, s, bits, z * 0x00010001)
                                    b_mat[kk, g], b_mat[kk + 1, g] = lo, hi
                                acc += a_mat @ b_mat
                        f = np.zeros(8)  # the scales of fragment columns 2t, 2t+1 lane (g, t) reads
                        f[2 * t], f[2 * t + 1] = scales[gi, first + 2 * t], scales[gi, first + 2 * t + 1]
                        y[:, first:first + 8] += acc * f[None, :]
    return y[:m_rows]


def ring_scale(layout, group: int, n0: int, g: np.ndarray, c: int, table: torch.Tensor | None = None) -> np.ndarray:
    """The scale (or the entry of `table`, e.g. the offsets) of column n0 + g + 8c as the ring copies it: the
    4-byte word of the [G, N] fp16 table at column (n0 + g) & ~1 (+ 8c) of row `group`, its half g % 2."""
    n = layout.out_features
    entries = (layout.scales if table is None else table).contiguous().view(torch.int16).numpy()
    words = entries.view(np.uint16).reshape(-1).view(np.uint32)
    word = words[(group * n + ((n0 + g) & ~1) + 8 * c) // 2]
    return halves(word >> (16 * (g & 1)))[0]


def ring_zero(layout, group: int, n0: int, g: np.ndarray, c: int) -> np.ndarray:
    """The uint8 zero of column n0 + g + 8c as the ring copies it: the 4-byte word at column
    (n0 + g) & ~3 (+ 8c), its byte g % 4."""
    n = layout.out_features
    words = layout.zeros.contiguous().numpy().reshape(-1).view(np.uint32)
    word = words[(group * n + ((n0 + g) & ~3) + 8 * c) // 4]
    return ((word >> (8 * (g & 3))) & 0xFF).astype(np.uint64)


def ring_offsets(spb: int, ng: int, zp: bool, stages: int, warps: int, m: int, bk: int):
    """Shared-memory byte ranges (offset, width) of the tensor-core plan's ring (gemv_mma.cuh) for M =
    m batch rows and blocks of bk input rows: what issue() copies to and what the blocks read back,
    for every (warp, slot, lane), and the bytes a launch takes. Per lane, in slot order: its 2 spb
    16-byte weight pieces and its table words (2 ng scales, 2 ng zeros), which it reads back itself;
    then the x pieces it copies for the warp (piece j of the block's rows, batch row j // (bk / 8))
    and the x it reads (batch row min(g, m - 1), the 8 runs and strips at 8t)."""
    fixed = 32 * (spb * 2 * 16 + ng * 2 * (2 if zp else 1) * 4)
    x_row = 2 * bk + 64
    slot_bytes = fixed + m * x_row
    own_w, own_r, x_w, x_r = [], [], [], []
    for warp in range(warps):
        ring = warp * stages * slot_bytes
        for slot in range(stages):
            base, mine = slot * slot_bytes, ring + slot * slot_bytes
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                slots_s, tab_s = ring + 16 * lane, ring + spb * 2 * 32 * 16 + 4 * lane
                for e in range(2 * spb):
                    own_w.append((slots_s + base + e * 32 * 16, 16))
                    own_r.append((mine + 16 * lane + 16 * e * 32, 16))
                for e in range(ng * 2 * (2 if zp else 1)):
                    own_w.append((tab_s + base + e * 32 * 4, 4))
                    own_r.append((mine + spb * 2 * 32 * 16 + 4 * lane + 4 * e * 32, 4))
                for j in range(lane, m * (bk // 8), 32):
                    x_w.append((ring + base + fixed + (j // (bk // 8)) * x_row + 16 * (j % (bk // 8)), 16))
                xs = mine + fixed + min(g, m - 1) * x_row
                r = 16 * spb  # R words a block: runs P = bk / 2R; rows s 2R + 32 sq + 8 t
                for s_ in range(bk // (2 * r)):
                    for sq in range(spb):
                        x_r.append((xs + 2 * (s_ * 2 * r + 32 * sq + 8 * t), 16))
    return own_w, own_r, x_w, x_r, warps * stages * slot_bytes


def reference_rows(w: GPTQWeight, layout, dtype: torch.dtype) -> np.ndarray:
    """The reference weight [in, out] in the layout's row order."""
    dense = dequantize(w, dtype).double().numpy()
    return dense[layout.perm.long().numpy()] if layout.perm is not None else dense
