"""The GEMV for small batches over the Triton layout (csrc/gemv.cuh, gemv_mma.cuh): no second copy.

    gemv = gemv_for(layout, torch.float16)     # None where nvcc is missing or the layout unsupported
    y = gemv(x2, bias)                          # x2 [M <= 8, in] -> y [M, out] (16 on tensor-core layouts)

It reads the very tensors a `TritonLayoutKernel` holds (words, scales, zeros or a zero constant,
perm, GGUF offsets) and is one of that kernel's plans (triton_linear.choose_config picks it for M
up to the measured crossover). Activations are read from global memory through L1; act-order
gathers them once per call (x[:, perm]) and a layout whose input axis is padded (or an unaligned
x) gets a zero-padded copy, both on the torch side.

Two kinds of plan (`choose_plan`, from the H200 sweeps in bench/NOTES-kernels.md):
  * tensor cores (gemv_mma.cuh; fp16, GPTQ zeros constant or uint8, blocks of 16 or 32 words, and
    the GGUF forms' float offsets at blocks of 16 words, N a multiple of 16): 16 columns a block, any
    M <= 8 in one launch, the products on mma.sync of q - z decoded in fp16 (one LOP3 and one HADD2 /
    HFMA2 a pair of weights; with float offsets a second mma.sync sums x for them); each warp streams
    its blocks either through a register double buffer (stages 0) or through a cp.async ring of
    `stages` blocks in shared memory, the block's scales (zeros) and x riding along (chosen for
    M = 1 on long columns); on sm_90+ launched as a programmatic dependent of the kernel before it
    (kernels/pdl.py: its first weight loads overlap that kernel);
  * the wide tensor-core plan (gemv_wide.cuh; the same layouts but float offsets) for 9-16 rows: x the
    MMA's A operand (all 16 batch rows in one m16n8k16), the decoded q - z its B operand, 16 columns a block, the
    block's scales and zeros through a small cp.async ring, silu(gate) * up in its epilogue; picked
    where it beat the Triton tiles (`wide_rows`: weights of at most 2^24, e.g. llama-3-8b's o_proj);
  * CUDA cores (gemv.cuh; everything else the layout holds: bf16 (float offsets included), blocks of
    8 words): rows a block computes (1, 2, 4, 8: M rounded up), columns a block (2 or 4,
    dividing N), the products in half2 (fp16) or fp32 (bf16).
Both split the input axis over the warps of a block. Supported: 4 and 8 bits, fp16 and bf16
activations, symmetric, uint8 zeros or GGUF float offsets, every group size the layout allows,
act-order. Not supported (the Triton kernel serves, said once in the log): odd N, 4-bit zeros of
64 and more, a layout whose blocks are wider than 128 words. `max_rows`: up to how many rows the
kernel object picks this GEMV over the Triton kernel (the measured crossover, per plan kind;
0 for the layouts not measured yet or measured slower: bf16 on group 32 / 16, float offsets on the CUDA
cores, uint8 zeros at group 32 / 16).
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ... import envs
from .. import pdl
from ..triton_layout import TritonLayout
from . import build

log = logging.getLogger(__name__)

DTYPE_CODE = {torch.float16: 0, torch.bfloat16: 1}
SYM, ZP, OFF = 0, 1, 2  # gemv.cuh Mode
ROW_TILES = (1, 2, 4, 8)  # the M <= 8 plans' rows a block; the wide plan's: WIDE_ROWS
MMA_COLS = 16  # the tensor-core plan: GemvPlan(8, 16, warps, stages)
# The wide tensor-core plan (gemv_wide.cuh), 9..16 rows: GemvPlan(16, cols, warps), x the MMA's A operand and
# each warp computing `cols` columns (8 a column octet): 16 (32 and 64 columns a warp, and the weights two strips
# ahead, were measured no faster where it is picked: round 13, branch wide-deep)
WIDE_ROWS, WIDE_COLS = 16, 16
MMA_STAGES = (0, 2, 3, 4, 6)  # its weight streams: 0 the register double buffer, else a ring of that many blocks
MAX_STAGES = 8  # gemv_mma.cuh
# A CUDA-core plan's `stages` on layouts of one group a run (group 32: the GGUF forms, GPTQ g32): each strip's
# tables loaded with its weights, a strip ahead (gemv.cuh StripTables), not run by run inside it
TABLES_AHEAD = 1
# The ring (2 blocks a warp, 8 warps) where the GEMV's round-3 device runs (bench/NOTES-kernels.md) measured
# it fastest back to back: M = 1 on columns of at least 32 blocks (8192x28672, 14336x4096)
RING_MAX_ROWS, RING_STAGES, RING_MIN_BLOCKS = 1, 2, 32
# The register double buffer's warps a block: the power of two that brings the grid's warps nearest
# below WARPS_PER_SM a SM (those runs' fastest back to back: 4 on 4096x6144, 8 on 4096x4096 and
# 14336x4096, 1 on 4096x28672); from M = 3 on at least one warp per 4 of a column's blocks (8 on
# 8192x28672, 4 on 4096x28672 at M = 4)
WARPS_PER_SM = 16
SHAPES = frozenset({(1, 2), (1, 4), (2, 2), (2, 4), (4, 2), (4, 4), (8, 2), (8, MMA_COLS),
                    (WIDE_ROWS, WIDE_COLS)})  # gemv_instances.cuh
MAX_WARPS = 8
# Up to this many rows the kernel object runs the GEMV instead of the Triton kernel: the crossovers
# measured on the H200 (device run 2 of bench/NOTES-kernels.md, "The GEMV over the Triton layout"),
# on GPTQ g128 layouts (blocks of 32 words). The tensor-core plan at 4 bits; the CUDA-core plans per
# (bits, dtype) (8 bits: the tensor-core plan lost to Triton from M = 4 on the large shapes). The tensor-core
# plan up to 8 rows since round 12 (a llama-3-8b INT4 decode step at batch 8 on an H100: 2983.0 tok/s against
# 2722.9 with the Triton tiles at 5-8 rows; round 3's chain on an H200 at 8 rows: 4096x6144 7.6 against 9.4 µs, 4096x4096 5.7
# / 8.5, 14336x4096 14.0 / 14.9, 4096x28672 23.0 / 23.6), but up to 4 on weights of more than MMA_LARGE_WEIGHT
# weights (8192x28672 at 8 rows: 42.9 against the Triton tiles' 42.5 in the chain, 53.5 / 51.2 with the L2 cleared).
# Past 8 rows the Triton tiles, but for the wide plan below (round 12: a second tile of 8 batch rows in this plan,
# branch gemv16, lost a decode step at batch 16 by 10%: 4096x28672 at 16 rows 45.2 against 36.8 µs).
MMA_MAX_ROWS, MMA_MAX_ROWS_LARGE, MMA_LARGE_WEIGHT = 8, 4, 1 << 27
# The wide plan from 9 rows up to WIDE_MAX_ROWS, on the layouts the tensor-core plan reads at 4 bits, GPTQ blocks of
# 32 words, of at most WIDE_MAX_WEIGHT weights: where it beat the Triton tiles in round 13 (bench/NOTES-kernels.md;
# H100, 16 rows: 4096x4096 8.3 against 9.3 µs back to back, 13.5 / 14.1 with the L2 cleared; behind on 4096x6144,
# 14336x4096 and the 28672-wide shapes: 11.5 / 10.3, 20.5 / 17.0, 36.7 / 25.9 back to back)
WIDE_MAX_ROWS, WIDE_MAX_WEIGHT = 16, 1 << 24
CORES_MAX_ROWS = {(4, torch.float16): 1, (8, torch.float16): 2, (4, torch.bfloat16): 0, (8, torch.bfloat16): 2}
# Group-32 / 16 layouts with an integer zero (GGUF Q4_0, Q5_0, Q8_0: blocks of 16 words; Q6_K: 8; GPTQ g32 sym
# alike), fp16: round 16's sweep (bench/NOTES-kernels.md; H100, `kernels.py --gguf --gemv-sweep`, µs, GEMV plan
# against the Triton path they ran before). Blocks of 16 words: the tensor-core ring, 8 warps x 2 blocks, at 1-8
# rows at either width (Q8_0 4096x14336 m=1 33.5 against 46.4, 8192x28672 m=4 112.2 / 145.3, 14336x4096 m=8
# 34.7 / 49.5; Q4_0 24.8 / 28.5, 78.7 / 84.4, 26.7 / 32.4). Blocks of 8 words (Q6_K; no tensor-core plan): 4 columns
# a block to 4 rows (4096x14336 m=1 33.6 against 48.4, 8192x28672 m=4 147.2 / 148.5; 14336x4096 m=8 50.3 / 51.1:
# a tie, left to Triton). Float offsets (Q4_K, Q4_1, Q5_K, Q5_1) lost: 8192x28672 m=1 102.0 against 89.2.
GROUP_MMA_MAX_ROWS, GROUP_CORES_MAX_ROWS = 8, 4
# GGUF float offsets (Q4_1, Q4_K, Q5_1, Q5_K: group 32, blocks of 16 words) on the tensor-core plan, which adds a
# group's offset times its sum of x (gemv_mma.cuh): up to OFFSET_MMA_MAX_ROWS rows where OFFSETS_ON (round 21).
# Correct on an H100 (round 22), but slower than Triton: the 8B as Q4_K_M 233.9 against 277.9 tok/s at batch 1,
# 1491.9 / 1814.6 at 8. Off by default: FLOTILLA_GEMV_OFFSETS=1 turns it on, =0 off; the plan runs when asked
# either way
OFFSET_MMA_MAX_ROWS, OFFSETS_ENV, OFFSETS_ON = 8, "FLOTILLA_GEMV_OFFSETS", False
# The layouts of one group a run at fp16 (group 32 / 16: the GGUF forms, GPTQ g32 sym; float offsets included) on the
# CUDA-core plans at GROUP32_CORES_ROWS row(s), in place of the tensor-core ring or Triton, each strip's tables
# loaded a strip ahead (TABLES_AHEAD) except on 8-bit integer-zero layouts (Q8_0, Q6_K, Q5_0), whose plain plan
# measured faster. Round 23 (H100, `PARTS=group32`): at 1 row Q4_K 8192x28672 81.2 against Triton's 90.0 µs,
# 4096x14336 26.2 / 31.3; Q4_0 63.0 / 73.5 and 22.2 / 24.8 against the ring; Q5_K 112.5 / 150.7; Q8_0's plain
# 4c2w 96.5 / 108.1 against the ring; the 8B decode at batch 1 as Q4_K_M 291.1 against 280.7 tok/s, as Q4_0 366.8
# against 333.9. At 4 rows it lost (Q4_K_M 868.3 against 1016.6 at batch 4), so 2 rows on keep the usual plan.
# FLOTILLA_GEMV_GROUP32=0 turns it off (round 22's default).
GROUP32_ENV, GROUP32_CORES_ON, GROUP32_CORES_ROWS = "FLOTILLA_GEMV_GROUP32", True, 1

class GemvUnsupported(ValueError):
    """The layout (or dtype) is one the GEMV does not read; the Triton kernel serves it."""


class _Params(ctypes.Structure):  # gemv.cuh GemvParams
    _fields_ = [("x", ctypes.c_void_p), ("words", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("zeros", ctypes.c_void_p), ("offsets", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("y", ctypes.c_void_p), ("M", ctypes.c_int), ("N", ctypes.c_int), ("KW", ctypes.c_int),
                ("lda", ctypes.c_int), ("ldy", ctypes.c_int), ("log2r", ctypes.c_int), ("zero_const", ctypes.c_int),
                ("group_magic", ctypes.c_uint32), ("scale_bf16", ctypes.c_int), ("stages", ctypes.c_int),
                ("pdl", ctypes.c_int), ("silu_half", ctypes.c_int), ("resid", ctypes.c_void_p),
                ("y_gamma", ctypes.c_void_p), ("gamma", ctypes.c_void_p), ("partials", ctypes.c_void_p),
                ("ldr", ctypes.c_int), ("n_partials", ctypes.c_int), ("inv_k", ctypes.c_float),
                ("eps", ctypes.c_float), ("post_scale", ctypes.c_float)]


@dataclass(frozen=True)
class NormWeight:
    """An RMSNorm's weight as the producer GEMV multiplies it in: scaled by 2^-e so that no entry
    exceeds 1 (r * gamma then stays within fp16 wherever r does), the consumer multiplying 2^e back."""
    scaled: torch.Tensor  # [N] fp16, contiguous
    post_scale: float  # 2^e
    eps: float

    @staticmethod
    def of(weight: torch.Tensor, eps: float) -> "NormWeight":
        top = float(weight.detach().abs().max().float()) if weight.numel() else 0.0
        e = max(0, math.ceil(math.log2(top))) if top > 0 else 0
        scaled = (weight.detach().float() * 2.0 ** -e).to(torch.float16).contiguous()
        return NormWeight(scaled, float(2 ** e), float(eps))


@dataclass(frozen=True)
class NormedResidual:
    """What a producer GEMV (GemvKernel.add_norm) hands the next one: the new residual r = resid + x @ W
    [M, N], half(r * gamma) [M, N] (the consumer's x), each block's sum of r^2 [M, N / 16], and the
    norm. The consumer (`norm=`) computes rms_norm(r) * gamma @ W' without a norm kernel between."""
    resid: torch.Tensor
    scaled: torch.Tensor
    partials: torch.Tensor
    norm: NormWeight


@dataclass(frozen=True)
class GemvPlan:
    rows: int  # rows a block computes (M rounded up to a power of two)
    cols: int  # consecutive output columns a block computes
    warps: int  # warps a block, splitting the input axis
    stages: int = 0  # the tensor-core plan: blocks a warp in its shared-memory ring (0: a register double buffer);
    # the CUDA-core plans: TABLES_AHEAD (group-32 layouts) loads each strip's scales / zeros / offsets with its weights


@dataclass(frozen=True)
class Geometry:
    """How the kernel walks one layout: derived once, checked against the kernel's limits."""
    log2r: int  # log2 of R, words per column per block
    runs_per_group: int  # runs of 2R rows per group
    tpg: int  # runs of one block that share a group: 1, 2 or P
    group_magic: int  # ceil(2^31 / runs_per_group): group of run u = (2u * magic) >> 32
    mode: int  # SYM, ZP or OFF
    mma: bool  # the tensor-core plan reads it (it is chosen at 4 bits)

    @property
    def wide(self) -> bool:
        """The wide tensor-core plan reads it too (all the tensor-core layouts but float offsets)."""
        return self.mma and self.mode != OFF


def geometry(layout: TritonLayout, dtype: torch.dtype) -> Geometry:
    """The kernel's view of a layout, or GemvUnsupported saying why not."""
    if dtype not in DTYPE_CODE:
        raise GemvUnsupported(f"activations in {dtype}, not float16 or bfloat16")
    if layout.bits not in (4, 8):
        raise GemvUnsupported(f"{layout.bits}-bit codes")
    n, r = layout.out_features, layout.rows_per_field
    if n % 2:
        raise GemvUnsupported(f"odd out_features ({n}): the kernel reads its scales two columns at a time")
    if r & (r - 1) or not 8 <= r <= 128:
        raise GemvUnsupported(f"{r} words per column per block (the kernel takes 8..128, a power of two)")
    if layout.zeros is not None and layout.offsets is not None:
        raise GemvUnsupported("integer zeros and float offsets together")
    tables = (torch.float16,) if dtype == torch.float16 else (torch.float16, torch.bfloat16)
    if layout.scales.dtype not in tables:
        raise GemvUnsupported(f"scales in {layout.scales.dtype} under {dtype} activations")
    if layout.offsets is not None and layout.offsets.dtype != layout.scales.dtype:
        raise GemvUnsupported(f"offsets in {layout.offsets.dtype}, scales in {layout.scales.dtype}")
    pairs = 16 // layout.bits
    run_rows = 2 * r
    gs = layout.group_size
    if gs % run_rows:
        raise GemvUnsupported(f"group size {gs} is not a multiple of the {run_rows}-row run")
    rpg = gs // run_rows
    tpg = min(pairs, rpg)
    if tpg not in (1, 2, pairs):
        raise GemvUnsupported(f"{tpg} runs of a block per group")
    runs = layout.k_padded // run_rows
    magic = -(-(1 << 31) // rpg)
    if (runs - 1) * rpg >= 1 << 31 or magic >= 1 << 32:
        raise GemvUnsupported(f"{runs} runs of {rpg} per group overflow the group index")
    if layout.scales.shape[0] * run_rows * rpg < layout.k_padded:
        raise GemvUnsupported(f"{layout.scales.shape[0]} group rows do not cover {layout.k_padded} input rows")
    zmax = layout.zero_const if layout.zeros is None else int(layout.zeros.max().item())
    if layout.bits == 4 and not 0 <= zmax < 64:
        raise GemvUnsupported(f"zero point {zmax} (the 4-bit decode takes 0..63)")
    for name, t, align in (("words", layout.words, 16), ("scales", layout.scales, 8), ("zeros", layout.zeros, 4),
                           ("offsets", layout.offsets, 8)):
        if t is not None and (not t.is_contiguous() or t.data_ptr() % align):
            raise GemvUnsupported(f"{name} not contiguous and {align}-byte aligned")
    mode = OFF if layout.offsets is not None else ZP if layout.zeros is not None else SYM
    if mode == OFF and tpg != 1:
        raise GemvUnsupported("float offsets with groups longer than one run")
    mma = dtype == torch.float16 and (r in (16, 32) if mode != OFF else r == 16) and n % MMA_COLS == 0
    return Geometry(r.bit_length() - 1, rpg, tpg, magic, mode, mma)


def group32_cores(geo: Geometry, dtype: torch.dtype) -> bool:
    """Whether a group-32 / 16 layout runs the CUDA-core plans at 1 to GROUP32_CORES_ROWS rows
    (FLOTILLA_GEMV_GROUP32, default on): the GGUF forms' modes (an integer zero constant, float offsets), as
    measured; a GPTQ g32 asym checkpoint's own zeros (ZP) keep the usual plan."""
    return geo.tpg == 1 and geo.log2r < 5 and dtype == torch.float16 and geo.mode != ZP \
        and envs.switch(GROUP32_ENV, GROUP32_CORES_ON, also_on=("cores",))


def tables_ahead(geo: Geometry, bits: int, dtype: torch.dtype) -> bool:
    """Whether those CUDA-core plans load each strip's tables a strip ahead: not on 8-bit integer-zero layouts."""
    return group32_cores(geo, dtype) and not (bits == 8 and geo.mode == SYM)


def crossover(geo: Geometry, bits: int, dtype: torch.dtype, weights: int = 0) -> int:
    """Up to how many rows the GEMV beats the Triton kernel on a layout of `weights` weights (in x out),
    as measured: 0 (never picked, though it runs when asked) for layouts of kinds not measured yet:
    bf16 on blocks other than 32 words (group 32 or 16), float offsets past GROUP32_CORES_ROWS."""
    usual = _crossover(geo, bits, dtype, weights)
    return max(GROUP32_CORES_ROWS, usual) if group32_cores(geo, dtype) else usual  # then the usual plan


def _crossover(geo: Geometry, bits: int, dtype: torch.dtype, weights: int) -> int:
    if geo.mode == OFF:
        return OFFSET_MMA_MAX_ROWS if geo.mma and envs.switch(OFFSETS_ENV, OFFSETS_ON) else 0
    if geo.log2r != 5:  # group 32 / 16 with an integer zero (GGUF Q4_0, Q5_0, Q8_0, Q6_K; GPTQ g32 sym)
        if dtype != torch.float16 or geo.mode != SYM:
            return 0
        return GROUP_MMA_MAX_ROWS if geo.mma else GROUP_CORES_MAX_ROWS
    if bits == 4 and geo.mma:
        return MMA_MAX_ROWS_LARGE if weights > MMA_LARGE_WEIGHT else MMA_MAX_ROWS
    return CORES_MAX_ROWS[(bits, dtype)]


def wide_rows(geo: Geometry, bits: int, weights: int) -> range:
    """The rows past the other plans' at which the GEMV's wide plan beats the Triton kernel on a layout of
    `weights` weights (in x out), as measured; none with FLOTILLA_GEMV_WIDE=0 (it still runs when asked)."""
    if os.environ.get("FLOTILLA_GEMV_WIDE") == "0":
        return range(0)
    if geo.mma and bits == 4 and geo.log2r == 5 and weights <= WIDE_MAX_WEIGHT:
        return range(ROW_TILES[-1] + 1, WIDE_MAX_ROWS + 1)
    return range(0)


def group_of(run: int, magic: int) -> int:
    """The kernel's group index of a run (gemv.cuh group_of)."""
    return ((2 * run) * magic) >> 32


def choose_plan(m: int, n: int, kw: int, num_sms: int, bits: int, mma_r: int = 0, block_words: int = 32) -> GemvPlan:
    """The plan for M rows over N columns of KW words each (the H200 sweeps' rules,
    bench/NOTES-kernels.md). mma_r: the layout's words a block where the tensor-core plan reads it
    (0: it does not); at 4 bits it is the plan, its warps taking whole blocks of the input axis:
    the shared-memory ring of 2 blocks a warp, 8 warps, at M = 1 on columns of >= 32 blocks, else
    the register double buffer with WARPS_PER_SM's warps (the sweeps' fastest back to back, as a
    decode step runs them). CUDA cores: 4 columns a block at 4 bits and M <= 4 (x loads shared by
    more columns), else 2; two warps up to M = 2, else one. Blocks of fewer than 32 words (`block_words`,
    the GGUF forms' group 32 / 16): the tensor-core ring of 2 blocks a warp, 8 warps, at any width and
    M <= 8, and on the CUDA cores 4 columns a block up to M = 4 at either width (round 16's sweep)."""
    if mma_r and m > ROW_TILES[-1]:
        return wide_plan(m, kw // mma_r)
    if block_words < 32 and mma_r:
        return GemvPlan(ROW_TILES[-1], MMA_COLS, MAX_WARPS, RING_STAGES)
    if mma_r and bits == 4:
        tiles, layout_blocks = n // MMA_COLS, kw // mma_r
        if m <= RING_MAX_ROWS and layout_blocks >= RING_MIN_BLOCKS:
            return GemvPlan(ROW_TILES[-1], MMA_COLS, MAX_WARPS, RING_STAGES)
        warps = _pow2_floor(max(1, WARPS_PER_SM * num_sms // tiles))
        if m >= 3:
            warps = max(warps, _pow2_floor(max(1, layout_blocks // 4)))
        return GemvPlan(ROW_TILES[-1], MMA_COLS, max(1, min(warps, MAX_WARPS, _pow2_floor(layout_blocks))))
    rows = next(t for t in ROW_TILES if t >= m)
    cols = 4 if (bits == 4 or block_words < 32) and rows <= 4 and n % 4 == 0 else 2
    return GemvPlan(rows, cols, 2 if rows <= 2 else 1)


def wide_plan(m: int, layout_blocks: int) -> GemvPlan:
    """The wide tensor-core plan for 9..16 rows over columns of `layout_blocks` blocks each: 16 columns a
    block, 8 warps (or one a layout block), one strip ahead: round 13's fastest on every shape, with the L2
    cleared and back to back alike (wider blocks won only back to back on the 28672-wide shapes, where the
    Triton tiles serve)."""
    if not ROW_TILES[-1] < m <= WIDE_ROWS:
        raise ValueError(f"the wide GEMV takes {ROW_TILES[-1] + 1}..{WIDE_ROWS} rows, not {m}")
    return GemvPlan(WIDE_ROWS, WIDE_COLS, max(1, min(MAX_WARPS, _pow2_floor(layout_blocks))))


def _pow2_floor(v: int) -> int:
    return 1 << (v.bit_length() - 1)


class _Library:
    """The ctypes view of the compiled GEMV (csrc/gemv_api.cu)."""

    def __init__(self, cdll: ctypes.CDLL):
        self.cdll = cdll
        i, p = ctypes.c_int, ctypes.c_void_p
        cdll.flotilla_gemv.argtypes = [i, p, i, i, i, i, i, i, i, p]
        cdll.flotilla_gemv.restype = i
        cdll.flotilla_gemv_error_string.argtypes = [i]
        cdll.flotilla_gemv_error_string.restype = ctypes.c_char_p
        size = cdll.flotilla_gemv_param_size()
        if size != ctypes.sizeof(_Params):
            raise GemvUnsupported(f"the library's GemvParams is {size} bytes, ctypes has {ctypes.sizeof(_Params)}")

    def call(self, op: int, params, dtype: int, bits: int, plan: GemvPlan, geo: Geometry, stream=None) -> None:
        rc = self.cdll.flotilla_gemv(op, params, dtype, bits, plan.rows, plan.cols, geo.mode, geo.tpg, plan.warps,
                                     stream)
        if rc != 0:
            what = "launch" if op == 0 else "setup"
            raise RuntimeError(f"flotilla CUDA GEMV {what} failed ({plan}, {geo}): "
                               f"{self.cdll.flotilla_gemv_error_string(rc).decode()}")


_libraries: dict[tuple[int, int], _Library | None] = {}


def library(device: torch.device) -> _Library | None:
    """The compiled GEMV for this GPU, or None (no nvcc, a failed build, a GPU below sm_80)."""
    cap = tuple(torch.cuda.get_device_capability(device))
    if cap not in _libraries:
        cdll = build.load(cap, build.GEMV)
        _libraries[cap] = _Library(cdll) if cdll is not None else None
    return _libraries[cap]


class GemvKernel:
    """y = x @ W for M <= 8 rows of x (16 on the tensor-core layouts), over one Triton layout on an NVIDIA GPU."""

    name = "gemv"

    def __init__(self, layout: TritonLayout, dtype: torch.dtype, lib: _Library):
        self.layout, self.dtype, self.lib = layout, dtype, lib
        self.geo = geometry(layout, dtype)
        device = layout.words.device
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._dt = DTYPE_CODE[dtype]
        self._plans: dict[int, GemvPlan] = {}
        self.max_rows = crossover(self.geo, layout.bits, dtype, layout.in_features * layout.out_features)
        self.cores = group32_cores(self.geo, dtype)  # read once, with max_rows: FLOTILLA_GEMV_GROUP32
        self.ahead = tables_ahead(self.geo, layout.bits, dtype)
        self.wide_rows = wide_rows(self.geo, layout.bits, layout.in_features * layout.out_features)
        self.most_rows = WIDE_ROWS if self.geo.wide else ROW_TILES[-1]  # what it can run, picked or not
        probe = _Params(log2r=self.geo.log2r)
        for plan in self.plans():  # load every instance this layout may use now, not inside a graph capture
            probe.stages = plan.stages
            self.lib.call(1, ctypes.byref(probe), self._dt, layout.bits, plan, self.geo)

    def plans(self, warps: int = 1):
        """Every plan this layout can run (with `warps` warps; the tensor-core plan with each of its
        weight streams; on group-32 / 16 layouts the CUDA-core plans to 4 rows also with the tables a strip ahead)."""
        n = self.layout.out_features
        for rows, cols in sorted(SHAPES):
            if rows == WIDE_ROWS:
                if self.geo.wide and n % cols == 0:
                    yield GemvPlan(rows, cols, warps)
            elif n % cols == 0 and cols != MMA_COLS:
                yield GemvPlan(rows, cols, warps)
                if self.geo.tpg == 1 and rows <= GROUP_CORES_MAX_ROWS:  # (its 8-row instances spill)
                    yield GemvPlan(rows, cols, warps, TABLES_AHEAD)
            elif cols == MMA_COLS and self.geo.mma:
                yield from (GemvPlan(rows, cols, warps, stages) for stages in MMA_STAGES)

    def picks(self, m: int) -> bool:
        """Whether the kernel object runs this GEMV for M rows (the measured crossovers)."""
        return 1 <= m <= self.max_rows or m in self.wide_rows

    def plan_for(self, m: int) -> GemvPlan:
        plan = self._plans.get(m)
        if plan is None:
            lay = self.layout
            cores = self.cores and m <= GROUP32_CORES_ROWS
            ahead = cores and self.ahead
            plan = choose_plan(m, lay.out_features, lay.words.shape[1], self.num_sms, lay.bits,
                               lay.rows_per_field if self.geo.mma and not cores else 0, lay.rows_per_field)
            plan = self._plans[m] = dataclasses.replace(plan, stages=TABLES_AHEAD) if ahead else plan
        return plan

    def fuses_silu(self, m: int, plan: GemvPlan | None = None) -> bool:
        """Whether a call of M rows (by `plan`, or this layout's own) can end in silu(gate) * up (the
        tensor-core plans' epilogue; it pairs column j with out / 2 + j, so out is a multiple of 16, and
        of the wide plan's columns), on blocks of 32 words (GPTQ g128: the group-32 layouts' epilogue has not
        run on a GPU; they take the product, then silu_mul)."""
        if not (self.geo.mma and self.geo.log2r == 5 and 1 <= m <= self.most_rows):
            return False
        plan = plan or self.plan_for(m)
        if plan.rows == WIDE_ROWS:
            return self.layout.out_features % (2 * plan.cols) == 0
        return plan.cols == MMA_COLS

    def fuses_norm(self, m: int, plan: GemvPlan | None = None) -> bool:
        """Whether a call of M rows (by `plan`, or this layout's own) can add the residual and hand on
        the norm (`add_norm`) or take a NormedResidual (`norm=`): the M <= 8 tensor-core plan's epilogue, on
        blocks of 32 words (GPTQ g128; the group-32 layouts' epilogue is not measured)."""
        if not (self.geo.mma and self.geo.log2r == 5 and 1 <= m <= ROW_TILES[-1]):
            return False
        plan = plan or self.plan_for(m)
        return plan.cols == MMA_COLS and plan.rows == ROW_TILES[-1]

    def add_norm(self, x2: torch.Tensor, resid: torch.Tensor, norm: NormWeight, bias: torch.Tensor | None = None,
                 plan: GemvPlan | None = None) -> NormedResidual:
        """The producer: r = resid + x2 @ W (+ bias) [M, out], rounded as torch's add of the rounded
        product, with half(r * norm.scaled) and the partial sums of r^2 for the next GEMV's norm."""
        m, n = x2.shape[0], self.layout.out_features
        plan = plan or self.plan_for(m)
        if not self.fuses_norm(m, plan):
            raise ValueError(f"{plan} cannot add the residual and the norm ({m} rows)")
        if resid.shape != (m, n) or resid.dtype != self.dtype or resid.stride(1) != 1:
            raise ValueError(f"resid must be [{m}, {n}] {self.dtype} with unit column stride, not "
                             f"{tuple(resid.shape)} {resid.dtype} with strides {resid.stride()}")
        if norm.scaled.shape != (n,) or norm.scaled.dtype != self.dtype or norm.scaled.device != x2.device:
            raise ValueError(f"the norm weight must be [{n}] {self.dtype} on {x2.device}")
        r = torch.empty((m, n), dtype=self.dtype, device=x2.device)
        scaled = torch.empty_like(r)
        partials = torch.empty((m, n // MMA_COLS), dtype=torch.float32, device=x2.device)
        self(x2, bias, r, plan, _producer=(resid, scaled, norm.scaled, partials))
        return NormedResidual(r, scaled, partials, norm)

    def __call__(self, x2: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 plan: GemvPlan | None = None, silu: bool = False, norm: NormedResidual | None = None,
                 _producer: tuple | None = None) -> torch.Tensor:
        """x2 [M, in] (M <= most_rows) -> [M, out] in x2's dtype, written into `out` (a [M, out] view with unit
        column stride) when given. `silu`: the weight is [gate | up] (out = 2 I) and the result is
        silu(x @ gate) * (x @ up) [M, I], rounded as kernels/fused.silu_mul rounds it (the
        tensor-core plan only, no bias: `fuses_silu`). `norm`: x2 is norm.scaled and the result is
        rms_norm(norm.resid) * gamma @ W (the tensor-core plan only: `fuses_norm`)."""
        lay = self.layout
        m, k = x2.shape
        if not 1 <= m <= self.most_rows:
            raise ValueError(f"the GEMV takes 1..{self.most_rows} rows here, not {m}")
        if k != lay.in_features or x2.dtype != self.dtype:
            raise ValueError(f"activation [{m}, {k}] {x2.dtype}; the weight expects [M, {lay.in_features}] {self.dtype}")
        plan = plan or self.plan_for(m)
        wide = plan.rows == WIDE_ROWS
        if plan.rows < m or (plan.rows, plan.cols) not in SHAPES or lay.out_features % plan.cols \
                or not 1 <= plan.warps <= MAX_WARPS or (plan.cols == MMA_COLS and not self.geo.mma) \
                or (wide and not self.geo.wide) \
                or not (plan.stages == 0 or (plan.cols == MMA_COLS and not wide and 2 <= plan.stages <= MAX_STAGES)
                        or (plan.cols != MMA_COLS and not wide and plan.stages == TABLES_AHEAD and self.geo.tpg == 1)):
            raise ValueError(f"{plan} cannot compute {m} rows of {lay.out_features} columns")
        x2 = self._prepare(x2)
        n = lay.out_features
        if silu and (not self.fuses_silu(m, plan) or bias is not None):
            raise ValueError(f"silu(gate) * up needs a tensor-core plan, no bias and out a multiple of 16 and of twice "
                             f"the plan's columns ({plan}, out {n})")
        if (norm is not None or _producer is not None) and not self.fuses_norm(m, plan):
            raise ValueError(f"the residual and norm fusion needs the tensor-core plan, not {plan}")
        if norm is not None:
            parts = norm.partials
            if norm.resid.shape != (m, lay.in_features) or parts.shape != (m, lay.in_features // MMA_COLS) \
                    or parts.dtype != torch.float32 or parts.device != x2.device or not parts.is_contiguous() \
                    or parts.data_ptr() % 16:
                raise ValueError(f"a NormedResidual of {tuple(norm.resid.shape)} (partials {tuple(parts.shape)} "
                                 f"{parts.dtype}) for [{m}, {lay.in_features}]: not a producer's output for this input")
        width = n // 2 if silu else n
        if out is None:
            out = torch.empty((m, width), dtype=self.dtype, device=x2.device)
        elif out.shape != (m, width) or out.stride(1) != 1 or out.dtype != self.dtype:
            raise ValueError(f"out must be a [{m}, {width}] {self.dtype} view with unit column stride, "
                             f"not {tuple(out.shape)} {out.dtype} with strides {out.stride()}")
        if bias is not None and bias.dtype != self.dtype:
            bias = bias.to(self.dtype)
        # A consumer (`norm`) launches as a plain kernel, not as a programmatic dependent of its producer
        # GEMV: early-launched, its blocks measured 6% of an H100 batch-1 step slower (387.7 against 423.1
        # tok/s; bench/NOTES-kernels.md, round 6). Its own dependents still launch early.
        p = _Params(x=x2.data_ptr(), words=lay.words.data_ptr(), scales=lay.scales.data_ptr(),
                    zeros=_ptr(lay.zeros), offsets=_ptr(lay.offsets), bias=_ptr(bias), y=out.data_ptr(), M=m, N=n,
                    KW=lay.words.shape[1], lda=x2.stride(0), ldy=out.stride(0), log2r=self.geo.log2r,
                    zero_const=lay.zero_const, group_magic=self.geo.group_magic,
                    scale_bf16=int(lay.scales.dtype == torch.bfloat16), stages=plan.stages,
                    pdl=int(plan.cols == MMA_COLS and not wide and norm is None and pdl.enabled(x2, m)),
                    silu_half=n // 2 if silu else 0)
        if _producer is not None:
            resid, scaled, gamma, partials = _producer
            p.resid, p.y_gamma, p.gamma, p.partials = (resid.data_ptr(), scaled.data_ptr(), gamma.data_ptr(),
                                                       partials.data_ptr())
            p.ldr = resid.stride(0)
        if norm is not None:
            p.partials, p.n_partials = norm.partials.data_ptr(), norm.partials.shape[1]
            p.inv_k, p.eps, p.post_scale = 1.0 / lay.in_features, norm.norm.eps, norm.norm.post_scale
        stream = ctypes.c_void_p(torch.cuda.current_stream(x2.device).cuda_stream)
        self.lib.call(0, ctypes.byref(p), self._dt, lay.bits, plan, self.geo, stream)
        return out

    def _prepare(self, x2: torch.Tensor) -> torch.Tensor:
        """x in the layout's row order, zero past in_features up to k_padded where the kernel reads
        it, rows 16-byte aligned."""
        lay = self.layout
        if lay.perm is not None:
            x2 = x2.index_select(1, lay.perm)  # [M, in], contiguous
        pad = lay.k_padded - lay.in_features
        if pad or x2.stride(1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
            # a fresh contiguous [M, k_padded] (F.pad with no padding would keep a transposed x's strides)
            x2 = F.pad(x2, (0, pad)) if pad else x2.clone(memory_format=torch.contiguous_format)
        return x2


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


_reported: set[str] = set()


def gemv_for(layout: TritonLayout, dtype: torch.dtype) -> GemvKernel | None:
    """The GEMV over this layout, or None (the Triton kernel serves small batches then; the reason
    is logged once per distinct reason)."""
    if layout.words.device.type != "cuda":
        return None
    try:
        lib = library(layout.words.device)
        if lib is None:
            return None  # build.load printed the reason once
        return GemvKernel(layout, dtype, lib)
    except (GemvUnsupported, RuntimeError) as e:  # a layout it does not read, or a failed plan set-up
        if str(e) not in _reported:
            _reported.add(str(e))
            refused = isinstance(e, GemvUnsupported)
            log.log(logging.INFO if refused else logging.WARNING,
                    "CUDA GEMV %s for a %dx%d %d-bit layout (%s): the Triton kernel serves small batches",
                    "not used" if refused else "set-up failed", layout.in_features, layout.out_features,
                    layout.bits, e)
        return None
