"""The tile GEMM for medium and large batches over the Triton layout on Hopper (csrc/tile.cuh): no second copy.

    tile = tile_for(layout, torch.float16)     # None where it does not serve (not sm_90, no nvcc, the layout)
    y = tile(x2, bias)                          # x2 [M, in] -> y [M, out]
    y = tile(x2, bias, rows=128)                # a given block height (64, 128, 256 batch rows)

It reads the very tensors a `TritonLayoutKernel` holds (words, scales, zeros or a zero constant, perm)
and is one of that kernel's paths (triton_linear.choose_config picks it over the Triton tiles and
dequantize + cuBLAS where it measured faster). The weight is dequantized in registers straight into
the A operand of Hopper's asynchronous warpgroup MMA (wgmma), the batch rows of x are its B operand
from a swizzled shared-memory ring, the weight's words come through a second one (both filled by tensor
copies, by a producer warpgroup of its own at 128 and 256 rows a block): y^T = W^T x^T, fp32
accumulators, the scales applied to the weights as the reference dequantization rounds them.

Served: sm_90 (H100, H200), fp16 activations, 4 and 8 bits, blocks of 32 words a column (the GPTQ
group-64-and-longer layouts), zeros constant or uint8 (below 64 at 4 bits), act-order (x gathered
once per call), in and out features multiples of 8. Not served (the other paths run): bf16, the GGUF
forms' float offsets, group 32 and shorter, other GPUs (wgmma is Hopper's).
"""
from __future__ import annotations

import ctypes
import logging
import os

import torch

from ..triton_layout import TritonLayout
from . import build, gemv

log = logging.getLogger(__name__)

BLOCK_ROWS = (64, 128, 256)  # batch rows a block (wgmma's N); the instances of csrc/tile_api.cu
TWO_A_SM = 64  # blocks of up to this many rows run two an SM (csrc/tile.cuh's launch bounds and shared memory)
BLOCK_COLS = 128  # out-features a block: two warpgroups of 64
CAPABILITY = (9, 0)
# Where the kernel object picks it (`serves`): from MIN_ROWS to MAX_ROWS[bits] rows, in blocks of 128 rows up to 128,
# else 256 (`block_rows`; `plan_rows` keeps 128 where 256 would split the input axis into short runs), the input axis
# split where the output tiles alone leave SMs idle (`split_k`). Measured
# on an H100 (bench/NOTES-kernels.md, round 8, run 2): faster than the Triton tiles or dequantize + cuBLAS in every
# case it covers but one tie (4096x14336 W4 at 1024 rows: 224.5 against 222.6 µs), e.g. W4 at 256 rows 0.86-1.10x
# fp16 on all four llama shapes against 0.51-0.68x; slower below 128 rows (the Triton tiles). Since round 11 (the
# weight ring, a stage's group by a multiply-high) up to 2048 rows at both widths (H100, `--tile-sweep --tile-rows
# 64,128,256,1024,2048`): at 2048 rows W4 101.1 / 380.0 / 354.1 / 1439.6 µs against dequantize + cuBLAS's 112.1 /
# 392.8 / 391.5 / 1498.2 on the four llama shapes, W8 103.7 / 396.0 / 369.5 / 1459.2 against 115.3 / 394.5 / 399.1 /
# 1554.3 (one tie); above 2048, not measured, dequantize + cuBLAS. Shorter blocks that fill more SMs lost to split
# tall ones: a block's per-stage cost is latency-bound below 256 rows. From 65 rows since round 12 (H100, run 2): at
# 96 rows the 128-row blocks took 20.8 / 41.0 / 41.6 / 130.3 µs W4 against the Triton tiles' 28.0 / 49.9 / 72.6 /
# 164.6 (two 64-row tiles there), 23.2 / 44.2 / 46.1 / 140.4 W8 against 33.3 / 58.8 / 90.8 / 196.4; at 32-64 rows
# the Triton tiles keep the batch (ahead by up to 37% at 32, within 11% either way at 48-64).
MIN_ROWS, MAX_ROWS = 65, {4: 2048, 8: 2048}
# ... and from WIDE_MIN_ROWS on the weights of at least WIDE_WEIGHTS (in x out): at 40-64 rows the tile GEMM in
# 64-row blocks beat the Triton tiles on every such weight measured (H100, bench/NOTES-kernels.md round 19, W4 /
# W8 µs at 40-64 rows): 4096x28672 (the 8B's gate_up) 49.5-50.5 / 60.7-61.4 against 53.8-57.0 / 62.5-62.9,
# 8192x28672 84.5-88.4 / 103.5-105.3 against 91.1-95.6 / 109.4-110.3, 28672x8192 (split 4) 84.0-86.2 /
# 104.3-105.6 against 84.0-96.2 / 121.8-123.4, 8192x57344 167.4-172.2 / 197.0-202.2 against 168.6-175.4 /
# 201.5-204.2; on the narrower llama shapes at 64 rows it lost or tied (4096x4096 20.0 against 18.2 µs W4)
WIDE_MIN_ROWS, WIDE_WEIGHTS = 40, 4096 * 28672
# split-K: the grid kept within one wave of the SMs (more splits measured slower where they only tied it: a second
# wave, a longer reduction), at most MAX_SPLITS ranges of at least MIN_SPLIT_BLOCKS layout blocks each; from FILL of
# the SMs, no split. Two waves only where the modelled time (waves x a split's share of the input axis) drops by more
# than SECOND_WAVE_GAIN against one wave (llama-3-70b's qkv, 80 column tiles at 200 rows: 3 splits in 2 waves, 96.0
# against 103.0 µs whole on an H100; measured on 132 SMs only)
FILL, MAX_SPLITS, MIN_SPLIT_BLOCKS, SECOND_WAVE_GAIN = 0.8, 8, 2, 0.25
SHORT_SPLIT = 32  # stages a split below which 256-row blocks give way to 128-row ones (`plan_rows`)
# FLOTILLA_TILE=0 turns the tile GEMM off (the Triton tiles and dequantize + cuBLAS serve every batch), =nosplit keeps
# it but never splits the input axis; read when a kernel object is built
ENV = "FLOTILLA_TILE"
_reported: set[str] = set()  # reasons and settings logged once


def env_setting() -> str:
    """FLOTILLA_TILE as "on", "off" or "nosplit"; an unknown value is logged once and read as the default."""
    value = os.environ.get(ENV, "1").strip().lower()
    settings = {"1": "on", "": "on", "on": "on", "0": "off", "off": "off", "nosplit": "nosplit"}
    if value not in settings:
        if value not in _reported:
            _reported.add(value)
            log.warning("%s=%r not understood (use 1, 0 or nosplit): the tile GEMM stays on", ENV, os.environ[ENV])
        return "on"
    return settings[value]


class TileUnsupported(ValueError):
    """The layout, dtype or GPU is one the tile GEMM does not serve; the other paths do."""


PARAM_VERSION = 2  # tile_api.cu flotilla_tile_param_version


class _Params(ctypes.Structure):  # tile.cuh TileParams
    _fields_ = [("x", ctypes.c_void_p), ("words", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("zeros", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("M", ctypes.c_int), ("N", ctypes.c_int), ("K", ctypes.c_int), ("KW", ctypes.c_int),
                ("lda", ctypes.c_int), ("ldy", ctypes.c_int), ("group_magic", ctypes.c_uint32),
                ("zero_const", ctypes.c_int), ("m_tiles", ctypes.c_int), ("splits", ctypes.c_int),
                ("partial", ctypes.c_void_p), ("counters", ctypes.c_void_p)]


def check_layout(layout: TritonLayout, dtype: torch.dtype) -> None:
    """Raise TileUnsupported saying why the kernel cannot read this layout (device aside): its own limits
    first, then those it shares with the GEMV's decode (gemv.geometry: group runs, scale rows, the 4-bit zero
    range, contiguous aligned tables)."""
    if dtype != torch.float16:
        raise TileUnsupported(f"activations in {dtype} (the tile GEMM computes in float16)")
    if layout.bits not in (4, 8):
        raise TileUnsupported(f"{layout.bits}-bit codes")
    if layout.rows_per_field != 32:
        raise TileUnsupported(f"{layout.rows_per_field} words a column a block (it reads blocks of 32)")
    if layout.offsets is not None:
        raise TileUnsupported("float offsets (the GGUF forms)")
    if layout.out_features % 8 or layout.in_features % 8:
        raise TileUnsupported(f"{layout.in_features}x{layout.out_features}: both must be multiples of 8")
    words = layout.words
    if not words.is_contiguous() or words.data_ptr() % 16:
        raise TileUnsupported("the words are not one contiguous 16-byte-aligned [out, words] tensor (its tensor copies "
                              "read them as such)")
    try:
        gemv.geometry(layout, dtype)  # with 32-word blocks, a group of whole 64-row runs: a stage lies in one group
    except gemv.GemvUnsupported as e:
        raise TileUnsupported(str(e)) from None


def block_rows(m: int) -> int:
    """The block height for M rows: the shortest of BLOCK_ROWS that holds them, 256 from there on (a taller block
    reads each weight tile fewer times and issues larger MMAs; a grid too small for the SMs is split along the
    input axis, `split_k`, rather than cut into shorter blocks)."""
    return next((rows for rows in BLOCK_ROWS if rows >= m), BLOCK_ROWS[-1])


def plan_rows(m: int, n: int, k_blocks: int, num_sms: int, bits: int) -> int:
    """The block height for M rows of an N-wide `bits`-bit weight of `k_blocks` layout blocks: `block_rows`, except
    that blocks of 256 rows whose split-K would leave each split fewer than SHORT_SPLIT stages (64 input rows each;
    16 / bits a layout block) become blocks of 128 rows where those need fewer splits (round 11, H100, 4096x4096 at
    256 rows: 128-row blocks in 2 splits 26.8 µs W4 / 28.7 W8 against 256-row blocks in 4 splits 29.6 / 30.6; on
    14336x4096, 56 stages a split, the 256-row blocks stayed ahead, 58.0 against 60.6)."""
    rows = block_rows(m)
    if rows == 256:
        splits = split_k(m, n, 256, k_blocks, num_sms)
        short = k_blocks * (16 // bits) // splits < SHORT_SPLIT
        if splits > 1 and short and split_k(m, n, 128, k_blocks, num_sms) < splits:
            return 128
    return rows


def split_k(m: int, n: int, rows: int, k_blocks: int, num_sms: int) -> int:
    """Into how many ranges of whole layout blocks to cut the input axis (split-K) for M rows of an N-wide
    weight in blocks of `rows`: 1 where the output tiles fill FILL of the SMs, else as many as keep the grid
    within one wave (MAX_SPLITS at most, MIN_SPLIT_BLOCKS layout blocks a split at least), or more in two
    waves where that cuts the time so modelled (waves / splits) by SECOND_WAVE_GAIN."""
    tiles = -(-m // rows) * -(-n // BLOCK_COLS)
    slots = num_sms * (2 if rows <= TWO_A_SM else 1)  # blocks one wave holds
    if tiles >= FILL * slots:
        return 1
    most = max(1, min(MAX_SPLITS, k_blocks // MIN_SPLIT_BLOCKS))
    best = max(1, min(slots // tiles, most))  # one wave
    cost = 1.0 / best  # waves times a split's share of the input axis
    for s in range(best + 1, most + 1):
        waves = -(-tiles * s // slots)
        if waves <= 2 and waves / s < cost * (1 - SECOND_WAVE_GAIN):
            best, cost = s, waves / s
    return best


def serves(m: int, bits: int, weights: int = 0) -> bool:
    """Whether M rows of a weight at `bits` of `weights` (in x out) go to the tile GEMM (MIN_ROWS to
    MAX_ROWS[bits]; from WIDE_MIN_ROWS on weights of at least WIDE_WEIGHTS)."""
    low = WIDE_MIN_ROWS if weights >= WIDE_WEIGHTS else MIN_ROWS
    return low <= m <= MAX_ROWS[bits]


class _Library:
    """The ctypes view of the compiled tile GEMM (csrc/tile_api.cu)."""

    def __init__(self, cdll: ctypes.CDLL):
        self.cdll = cdll
        cdll.flotilla_tile.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        cdll.flotilla_tile.restype = ctypes.c_int
        cdll.flotilla_tile_error_string.argtypes = [ctypes.c_int]
        cdll.flotilla_tile_error_string.restype = ctypes.c_char_p
        size = cdll.flotilla_tile_param_size()
        if size != ctypes.sizeof(_Params):
            raise TileUnsupported(f"the library's TileParams is {size} bytes, ctypes has {ctypes.sizeof(_Params)}")
        try:
            version = cdll.flotilla_tile_param_version()
        except AttributeError:  # built before round 11: the same size, stages_per_group where group_magic is now
            version = 1
        if version != PARAM_VERSION:
            raise TileUnsupported(f"the library's TileParams is version {version}, this code writes version "
                                  f"{PARAM_VERSION} (a build from another tree?)")

    def available(self) -> bool:
        """Whether the driver can encode the tensor maps the kernel's copies read (needs a GPU driver)."""
        return bool(self.cdll.flotilla_tile_available())

    def call(self, params: _Params, bits: int, rows: int, stream) -> None:
        rc = self.cdll.flotilla_tile(ctypes.byref(params), bits, rows, stream)
        if rc != 0:
            raise RuntimeError(f"flotilla tile GEMM launch failed ({bits} bits, {rows} rows a block): "
                               f"{self.cdll.flotilla_tile_error_string(rc).decode()}")


_libraries: dict[tuple[int, int], _Library | None] = {}


def library(device: torch.device) -> _Library | None:
    """The compiled tile GEMM for this GPU, or None (not sm_90, no nvcc, a failed build)."""
    cap = tuple(torch.cuda.get_device_capability(device))
    if cap != CAPABILITY:
        return None
    if cap not in _libraries:
        cdll = build.load(cap, build.TILE)
        lib = _Library(cdll) if cdll is not None else None
        if lib is not None and not lib.available():
            log.warning("CUDA tile GEMM unavailable: the driver cannot encode tensor maps (cuTensorMapEncodeTiled); "
                        "medium and large batches use the Triton tiles and dequantize + cuBLAS")
            lib = None
        _libraries[cap] = lib
    return _libraries[cap]


class TileKernel:
    """y = x @ W for M rows of x over one Triton layout, on a Hopper GPU."""

    name = "tile"

    def __init__(self, layout: TritonLayout, dtype: torch.dtype, lib: _Library):
        """Over a layout that `check_layout` accepted (`tile_for` checks it before it builds the library)."""
        self.layout, self.dtype, self.lib = layout, dtype, lib
        self.num_sms = torch.cuda.get_device_properties(layout.words.device).multi_processor_count
        self.k_blocks = layout.words.shape[1] // 32  # layout blocks along the input axis
        # a stage is one 64-row run of the GEMV's geometry: the same magic finds its group
        self.group_magic = gemv.geometry(layout, dtype).group_magic
        self.split = env_setting() != "nosplit"
        self._counters = torch.zeros(1024, dtype=torch.int32, device=layout.words.device)

    def rows_for(self, m: int) -> int:
        if not self.split:
            return block_rows(m)
        return plan_rows(m, self.layout.out_features, self.k_blocks, self.num_sms, self.layout.bits)

    def splits_for(self, m: int, rows: int) -> int:
        return split_k(m, self.layout.out_features, rows, self.k_blocks, self.num_sms) if self.split else 1

    def serves(self, m: int) -> bool:
        """Whether the kernel object should run M rows here (where it measured faster than its other paths)."""
        return serves(m, self.layout.bits, self.layout.in_features * self.layout.out_features)

    def __call__(self, x2: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 rows: int | None = None, splits: int | None = None) -> torch.Tensor:
        """x2 [M, in] -> [M, out] in float16, written into `out` (a [M, out] view with unit column stride)
        when given; `rows`: the block height (default `rows_for(M)`); `splits`: ranges of the input axis
        (split-K, default `splits_for(M, rows)`)."""
        lay = self.layout
        m, k = x2.shape
        if k != lay.in_features or x2.dtype != self.dtype:
            raise ValueError(f"activation [{m}, {k}] {x2.dtype}; the weight expects [M, {lay.in_features}] {self.dtype}")
        rows = rows or self.rows_for(m)
        if rows not in BLOCK_ROWS:
            raise ValueError(f"block height {rows}: one of {BLOCK_ROWS}")
        splits = splits or self.splits_for(m, rows)
        if not 1 <= splits <= self.k_blocks:
            raise ValueError(f"{splits} splits of the input axis: 1 to {self.k_blocks} (its layout blocks)")
        n = lay.out_features
        if out is None:
            out = torch.empty((m, n), dtype=self.dtype, device=x2.device)
        elif out.shape != (m, n) or out.stride(1) != 1 or out.dtype != self.dtype:
            raise ValueError(f"out must be a [{m}, {n}] {self.dtype} view with unit column stride, "
                             f"not {tuple(out.shape)} {out.dtype} with strides {out.stride()}")
        if m == 0:
            return out
        target = out
        if out.stride(0) % 8 or out.data_ptr() % 16:  # the kernel stores 16-byte rows
            target = torch.empty((m, n), dtype=self.dtype, device=x2.device)
        if lay.perm is not None:
            x2 = x2.index_select(1, lay.perm)
        if x2.stride(1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:  # the tensor map's rows: 16-byte aligned
            x2 = torch.empty((m, k), dtype=x2.dtype, device=x2.device).copy_(x2)
        if bias is not None:
            bias = bias.to(self.dtype).contiguous()
        partial = counters = None
        if splits > 1:
            tiles = -(-m // rows) * -(-n // BLOCK_COLS)
            partial = torch.empty(splits * tiles * BLOCK_COLS * rows, dtype=torch.float32, device=x2.device)
            if tiles > self._counters.numel():  # every launch leaves its counters at zero: a larger zeroed one replaces it
                self._counters = torch.zeros(tiles, dtype=torch.int32, device=x2.device)
            counters = self._counters
        p = _Params(x=x2.data_ptr(), words=lay.words.data_ptr(), scales=lay.scales.data_ptr(),
                    zeros=None if lay.zeros is None else lay.zeros.data_ptr(),
                    bias=None if bias is None else bias.data_ptr(), y=target.data_ptr(), M=m, N=n, K=k,
                    KW=lay.words.shape[1], lda=x2.stride(0), ldy=target.stride(0),
                    group_magic=self.group_magic, zero_const=lay.zero_const, m_tiles=-(-m // rows),
                    splits=splits, partial=None if partial is None else partial.data_ptr(),
                    counters=None if counters is None else counters.data_ptr())
        with torch.cuda.device(x2.device):  # the launch (and the shared-memory opt-in) on x's GPU
            stream = ctypes.c_void_p(torch.cuda.current_stream(x2.device).cuda_stream)
            self.lib.call(p, lay.bits, rows, stream)
        if target is not out:
            out.copy_(target)
        return out


def tile_for(layout: TritonLayout, dtype: torch.dtype) -> TileKernel | None:
    """The tile GEMM over this layout, or None (the other paths serve; the reason logged once)."""
    device = layout.words.device
    if device.type != "cuda" or tuple(torch.cuda.get_device_capability(device)) != CAPABILITY:
        return None
    if env_setting() == "off":
        return None
    try:
        check_layout(layout, dtype)
        lib = library(layout.words.device)
        if lib is None:
            return None  # not Hopper, or build.load printed the reason once
        return TileKernel(layout, dtype, lib)
    except TileUnsupported as e:
        if str(e) not in _reported:
            _reported.add(str(e))
            log.info("CUDA tile GEMM not used for a %dx%d %d-bit layout (%s)", layout.in_features,
                     layout.out_features, layout.bits, e)
        return None
