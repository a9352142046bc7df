"""Triton W4A16 / W8A16 dequant-matmul over the `triton_layout` packing.

`w_dot_kernel` computes y^T = W^T x^T on the tensor cores with the weight as the A operand, so
the dequantized weights never leave registers (on Hopper: wgmma with A from registers; the
batch rows are the instruction's N, 16 to 256). One program owns a [BLOCK_N out-features,
BLOCK_M rows] tile and a run of `block_k`-row blocks of the input axis (split-K when the grid's
second axis is > 1). Per block it loads a [BLOCK_N, R] tile of words once; for each pair
position t one AND/OR per word turns it into two adjacent input rows of packed 16-bit floats
(OR-ing a code into the mantissa of a power of two gives OFFSET + q exactly: fp16 0x6400 =
1024.0, bf16 0x4300 = 128.0), one packed add of -(OFFSET + zero) leaves q - z, and the
[BLOCK_N, 2R] result feeds one `tl.dot` with the matching [2R, BLOCK_M] activation slice.

Group scales, two ways (constexpr SCALE_W):
  * accumulator side: part = (q - z) · x on the tensor cores over the runs of one group,
    acc += s * part once per group (per block when a group spans several blocks);
  * weight side (several groups per block, or chosen for wide tiles): one packed multiply per
    pair, rounding exactly as the reference dequantization does.

Float offsets (constexpr HAS_OFFSET, the GGUF forms with a min: w = s * q + m, which an integer
zero cannot express): weight side only; the packed multiply becomes one packed fused multiply-add
with the group's scale and offset (z_ptr then points at the offsets, [groups, out] in the
activation dtype). Off, the kernels compile to exactly the code without it.

On the GPU the pair decode is inline PTX (`pair_asm`); under TRITON_INTERPRET=1, and for bf16 at
8 bits (whose codes do not fit bf16's mantissa), the same values are computed with plain Triton
arithmetic in fp32.

Split-K without a second launch: each split stores its fp32 partial tile in a workspace, bumps a
per-tile counter, and the split that arrives last sums the partials, writes the output and resets
the counter to zero (so the counters never need clearing between calls).

silu(gate) * up (constexpr SILU, a [gate | up] weight): a tile's first half holds gate columns j, its second
half up's I + j, and the tile's last store writes silu(gate) * up [M, I] (kernels/fused.silu_mul's roundings).
"""
from __future__ import annotations

import triton
import triton.language as tl

_ASM_TYPES = {False: ("0x64006400", "f16x2", "0x2C002C00"), True: ("0x43004300", "bf16x2", "0x3D803D80")}


def pair_asm(bits: int, is_bf16: bool, scale_w: bool, odd: bool = False, offset: bool = False) -> str:
    """Inline PTX decoding a word into a (row 2r, row 2r+1) pair of 16-bit floats; "" where none.

    Operands: $0, $1 the two halves; $2 the word (already shifted); $3 the packed zero constant:
    -(OFFSET + z) for an even pair position, -(OFFSET / 16 + z) for an odd one; $4 the packed
    scale (read only when scale_w); $5 the packed offset (offset: (q - z) * s + m in one fused
    multiply-add instead of the multiply). At 4 bits in fp16 an odd position reads the second nibble of
    each half in place (mask 0x00F000F0 gives 1024 + 16 q), so two of every four positions need
    no shift; a fused multiply-add by 1/16 takes it back to q - z exactly.
    """
    if is_bf16 and bits == 8:
        return ""
    magic, kind, sixteenth = _ASM_TYPES[is_bf16]
    if odd:
        if bits != 4 or is_bf16:  # bf16 has 7 mantissa bits: bits 4-7 would touch the exponent
            return ""
        body = (f"lop3.b32 p, $2, 0x00F000F0, {magic}, 0xEA; mov.b32 c, {sixteenth}; "
                f"fma.rn.{kind} p, p, c, $3; ")
    else:
        mask = "0x000F000F" if bits == 4 else "0x00FF00FF"
        body = f"lop3.b32 p, $2, {mask}, {magic}, 0xEA; add.rn.{kind} p, p, $3; "
    if offset:
        body += f"fma.rn.{kind} p, p, $4, $5; "
    elif scale_w:
        body += f"mul.rn.{kind} p, p, $4; "
    return "{ .reg .b32 p, c; " + body + "mov.b32 {$0, $1}, p; }"


@triton.jit
def load_group(s_ptr, z_ptr, g, offs_n, N, n_ok, ZERO_CONST: tl.constexpr, HAS_ZEROS: tl.constexpr,
               BITS: tl.constexpr, IS_BF16: tl.constexpr):
    """Group g for out-features offs_n: s (fp32), s rounded to act (fp32), z (fp32), and the
    packed operands of pair_asm: -(OFFSET + z), -(OFFSET / 16 + z), s."""
    act: tl.constexpr = tl.bfloat16 if IS_BF16 else tl.float16
    s16 = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0)
    if HAS_ZEROS:
        zi = tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0).to(tl.int32)
    else:
        zi = tl.full(offs_n.shape, ZERO_CONST, tl.int32)
    s_act = s16.to(act)
    s_bits = s_act.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    if IS_BF16:
        # -(128 + z) = 0xC300 | z; -(8 + z) is 0xC100 + 16 z below 16 and 0xC180 + 8 (z - 8) above
        zz_e = 0xC300 | zi
        zz_o = tl.where(zi < 8, 0xC100 + (zi << 4), 0xC180 + ((zi - 8) << 3))
    else:
        # -(1024 + z) = 0xE400 | z; -(64 + z) = 0xD400 + 16 z (z < 64)
        zz_e = 0xE400 | zi
        zz_o = 0xD400 + (zi << 4)
    return (s16.to(tl.float32), s_act.to(tl.float32), zi.to(tl.float32),
            zz_e | (zz_e << 16), zz_o | (zz_o << 16), s_bits | (s_bits << 16))


@triton.jit
def load_offset(m_ptr, g, offs_n, N, n_ok, IS_BF16: tl.constexpr):
    """Group g's float offsets for out-features offs_n: m rounded to act (fp32), and packed."""
    act: tl.constexpr = tl.bfloat16 if IS_BF16 else tl.float16
    m_act = tl.load(m_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(act)
    m_bits = m_act.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return m_act.to(tl.float32), m_bits | (m_bits << 16)


@triton.jit
def decode_pair(words, t: tl.constexpr, z, s_act, zz_even, zz_odd, s2, m_act, m2, BITS: tl.constexpr,
                IS_BF16: tl.constexpr, SCALE_W: tl.constexpr, ASM: tl.constexpr, ASM_ODD: tl.constexpr,
                HAS_OFFSET: tl.constexpr):
    """Pair position t of each word -> ((q - z)[* s][+ m] of rows 2r, 2r + 1) as two act tensors."""
    if ASM != "":
        if ASM_ODD != "":  # 4 bits: positions 0, 1 read the word in place, 2, 3 the word >> 8
            src = words if t < 2 else words >> 8
            if t % 2 == 0:
                lo, hi = _asm_pair(src, zz_even, s2, m2, ASM, IS_BF16, HAS_OFFSET)
            else:
                lo, hi = _asm_pair(src, zz_odd, s2, m2, ASM_ODD, IS_BF16, HAS_OFFSET)
        else:
            lo, hi = _asm_pair(words >> (t * BITS), zz_even, s2, m2, ASM, IS_BF16, HAS_OFFSET)
    else:
        act: tl.constexpr = tl.bfloat16 if IS_BF16 else tl.float16
        mask: tl.constexpr = (1 << BITS) - 1
        shifted = words >> (t * BITS)
        lo = (shifted & mask).to(tl.float32) - z[:, None]
        hi = ((shifted >> 16) & mask).to(tl.float32) - z[:, None]
        if HAS_OFFSET:
            lo = lo * s_act[:, None] + m_act[:, None]
            hi = hi * s_act[:, None] + m_act[:, None]
        elif SCALE_W:
            lo = lo * s_act[:, None]
            hi = hi * s_act[:, None]
        lo = lo.to(act)
        hi = hi.to(act)
    return lo, hi


@triton.jit
def _asm_pair(src, zz2, s2, m2, ASM: tl.constexpr, IS_BF16: tl.constexpr, HAS_OFFSET: tl.constexpr):
    if HAS_OFFSET:
        args = [src, zz2[:, None], s2[:, None], m2[:, None]]
        operands: tl.constexpr = "=h,=h,r,r,r,r"
    else:
        args = [src, zz2[:, None], s2[:, None]]
        operands: tl.constexpr = "=h,=h,r,r,r"
    if IS_BF16:
        return tl.inline_asm_elementwise(ASM, operands, args, dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(ASM, operands, args, dtype=(tl.float16, tl.float16), is_pure=True, pack=1)


@triton.jit
def _load_xt(x_ptr, perm_ptr, offs_m, kk, M, K, stride_xm, HAS_PERM: tl.constexpr):
    """x^T slice [len(kk), BLOCK_M]; rows past K read as zero."""
    k_ok = kk < K
    if HAS_PERM:
        cols = tl.load(perm_ptr + kk, mask=k_ok, other=0)
    else:
        cols = kk
    mask = k_ok[:, None] & (offs_m < M)[None, :]
    return tl.load(x_ptr + offs_m[None, :] * stride_xm + cols[:, None], mask=mask, other=0.0)


@triton.jit
def w_dot_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, perm_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, kw, stride_xm, stride_om, blocks_per_split,
    BITS: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_SIZE: tl.constexpr,
    ZERO_CONST: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
    SCALE_W: tl.constexpr, SPLIT: tl.constexpr, IS_BF16: tl.constexpr, ASM: tl.constexpr,
    ASM_ODD: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_OFFSET: tl.constexpr = False, SILU: tl.constexpr = False,
):
    PAIRS: tl.constexpr = 16 // BITS
    R: tl.constexpr = BLOCK_K * BITS // 32  # words per out-feature per block
    # Runs of 2R rows per group (at most the PAIRS runs of one block)
    RUNS_PER_GROUP: tl.constexpr = PAIRS if GROUP_SIZE >= BLOCK_K else GROUP_SIZE // (2 * R)

    # Programs that share a weight tile are adjacent, so at large M the tile is read from L2.
    pid_mn = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    offs_m = (pid_mn % num_pid_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    if SILU:
        # a [gate | up] weight (N = 2 I): the tile's first half are gate columns j, its second half the
        # same j of up (I + j), so that the tile's last store can write silu(gate) * up [M, I]
        HALF: tl.constexpr = BLOCK_N // 2
        col = tl.arange(0, BLOCK_N)
        offs_j = (pid_mn // num_pid_m) * HALF + col % HALF
        offs_n = offs_j + (col // HALF) * (N // 2)
        n_ok = offs_j < N // 2
    else:
        offs_n = (pid_mn // num_pid_m) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
    offs_r = tl.arange(0, R)
    offs_2r = tl.arange(0, 2 * R)

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for i in range(blocks_per_split):
        b = pid_k * blocks_per_split + i
        w_ptrs = w_ptr + offs_n[:, None] * kw + (b * R + offs_r)[None, :]
        if EVEN_N:
            words = tl.load(w_ptrs)  # [BLOCK_N, R]
        else:
            words = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
        k0 = b * BLOCK_K
        part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for t in tl.static_range(PAIRS):
            if SCALE_W or t % RUNS_PER_GROUP == 0:  # a new group starts at this run of 2R rows
                g = (k0 + t * 2 * R) // GROUP_SIZE
                s, s_act, z, zz_e, zz_o, s2 = load_group(s_ptr, z_ptr, g, offs_n, N, n_ok, ZERO_CONST, HAS_ZEROS,
                                                         BITS, IS_BF16)
                m_act, m2 = _group_offset(z_ptr, g, offs_n, N, n_ok, s_act, s2, IS_BF16, HAS_OFFSET)
            lo, hi = decode_pair(words, t, z, s_act, zz_e, zz_o, s2, m_act, m2, BITS, IS_BF16, SCALE_W, ASM,
                                 ASM_ODD, HAS_OFFSET)
            w = tl.reshape(tl.join(lo, hi), (BLOCK_N, 2 * R))  # columns 2r + j
            xt = _load_xt(x_ptr, perm_ptr, offs_m, k0 + t * 2 * R + offs_2r, M, K, stride_xm, HAS_PERM)
            if SCALE_W:
                acc = tl.dot(w, xt, acc)
            else:
                part = tl.dot(w, xt, part)
                if t % RUNS_PER_GROUP == RUNS_PER_GROUP - 1:  # the group ends: scale its sum once
                    acc += part * s[:, None]
                    part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    finish_tile(acc, out_ptr, bias_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, n_ok, M, N, stride_om, HAS_BIAS, SPLIT,
                SILU)


@triton.jit
def _group_offset(m_ptr, g, offs_n, N, n_ok, s_act, s2, IS_BF16: tl.constexpr, HAS_OFFSET: tl.constexpr):
    """load_offset under HAS_OFFSET; otherwise placeholders that nothing reads."""
    if HAS_OFFSET:
        m_act, m2 = load_offset(m_ptr, g, offs_n, N, n_ok, IS_BF16)
    else:
        m_act, m2 = s_act, s2
    return m_act, m2


@triton.jit
def finish_tile(acc, out_ptr, bias_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, n_ok, M, N, stride_om,
                HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, SILU: tl.constexpr = False):
    """Write one acc [BLOCK_N, BLOCK_M] tile to out [M, N] (SILU: silu(gate) * up to out [M, N / 2]);
    under split-K the last split reduces."""
    out_mask = n_ok[:, None] & (offs_m < M)[None, :]
    if SPLIT:
        tile_id = tl.program_id(0)
        splits = tl.num_programs(1)
        tile = offs_m[None, :] * N + offs_n[:, None]
        tl.store(ws_ptr + tl.program_id(1) * M * N + tile, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is stored before the counter says so
        arrived = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel")
        if arrived == splits - 1:
            acc = tl.zeros_like(acc)
            for p in range(splits):
                acc += tl.load(ws_ptr + p * M * N + tile, mask=out_mask, other=0.0, cache_modifier=".cg")
            _store_final(out_ptr, bias_ptr, acc, offs_m, offs_n, out_mask, stride_om, M, N, HAS_BIAS, SILU)
            tl.atomic_xchg(cnt_ptr + tile_id, 0)
    else:
        _store_final(out_ptr, bias_ptr, acc, offs_m, offs_n, out_mask, stride_om, M, N, HAS_BIAS, SILU)


@triton.jit
def _store_final(out_ptr, bias_ptr, acc, offs_m, offs_n, out_mask, stride_om, M, N, HAS_BIAS: tl.constexpr,
                 SILU: tl.constexpr):
    if SILU:
        _store_silu(out_ptr, acc, offs_m, stride_om, M, N)
    else:
        _store_out(out_ptr, bias_ptr, acc, offs_m, offs_n, out_mask, stride_om, N, HAS_BIAS)


@triton.jit
def _store_silu(out_ptr, acc, offs_m, stride_om, M, N):
    """silu(gate) * up of a SILU tile (rows: HALF gate columns j, then up's I + j) into out [M, I], rounded
    where kernels/fused.silu_mul rounds (the product's entries, silu's output, the result)."""
    BLOCK_N: tl.constexpr = acc.shape[0]
    BLOCK_M: tl.constexpr = acc.shape[1]
    HALF: tl.constexpr = BLOCK_N // 2
    dt = out_ptr.dtype.element_ty
    gate, up = tl.split(tl.permute(tl.reshape(acc, (2, HALF, BLOCK_M)), (1, 2, 0)))
    a = gate.to(dt).to(tl.float32)
    silu = (a / (1.0 + tl.exp(-a))).to(dt).to(tl.float32)
    y = silu * up.to(dt).to(tl.float32)
    offs_j = (tl.program_id(0) // tl.cdiv(M, BLOCK_M)) * HALF + tl.arange(0, HALF)  # the tile's gate columns
    mask = (offs_j < N // 2)[:, None] & (offs_m < M)[None, :]
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_j[:, None], y.to(dt), mask=mask)


@triton.jit
def _store_out(out_ptr, bias_ptr, acc, offs_m, offs_n, out_mask, stride_om, N, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None],
             acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def dequantize_kernel(
    w_ptr, s_ptr, z_ptr, out_ptr, N, K, kw, n0, n1,
    BITS: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_SIZE: tl.constexpr, ZERO_CONST: tl.constexpr,
    HAS_ZEROS: tl.constexpr, IS_BF16: tl.constexpr, ASM: tl.constexpr, ASM_ODD: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_OFFSET: tl.constexpr = False,
):
    """W^T [N, K] = s * (q - z) (+ m) in the layout's (sorted) row order, one block of rows a program;
    out-features n0 .. n1 - 1 only, written from out_ptr's first row (a column chunk of the weight)."""
    PAIRS: tl.constexpr = 16 // BITS
    R: tl.constexpr = BLOCK_K * BITS // 32
    b = tl.program_id(0)
    offs_n = n0 + tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, R)
    offs_2r = tl.arange(0, 2 * R)
    n_ok = offs_n < n1
    words = tl.load(w_ptr + offs_n[:, None] * kw + (b * R + offs_r)[None, :], mask=n_ok[:, None], other=0)
    for t in tl.static_range(PAIRS):
        k0 = b * BLOCK_K + t * 2 * R
        s, s_act, z, zz_e, zz_o, s2 = load_group(s_ptr, z_ptr, k0 // GROUP_SIZE, offs_n, N, n_ok,
                                                 ZERO_CONST, HAS_ZEROS, BITS, IS_BF16)
        m_act, m2 = _group_offset(z_ptr, k0 // GROUP_SIZE, offs_n, N, n_ok, s_act, s2, IS_BF16, HAS_OFFSET)
        lo, hi = decode_pair(words, t, z, s_act, zz_e, zz_o, s2, m_act, m2, BITS, IS_BF16, True, ASM, ASM_ODD,
                             HAS_OFFSET)
        w = tl.reshape(tl.join(lo, hi), (BLOCK_N, 2 * R))
        kk = k0 + offs_2r
        tl.store(out_ptr + (offs_n - n0)[:, None] * K + kk[None, :], w, mask=n_ok[:, None] & (kk < K)[None, :])
