"""The Triton dequant-matmul kernel object: repack at load, pick a path per batch size, launch.

    kernel = TritonGPTQKernel(gptq_weight, torch.float16)   # repacks once (triton_layout)
    y = kernel(x, bias)                                      # x [..., in] -> y [..., out]
    a = kernel.silu_mul(x, bias)                             # silu(gate) * up of a [gate | up] weight
                                                             # (fused into the GEMV's epilogue where it serves)

`TritonLayoutKernel(layout, dtype)` is the same object over a layout built elsewhere (the GGUF
forms: kernels.triton_ggml).

Paths, chosen per call from the number of rows M (`config_for`):
  * "gemv"  — on CUDA where nvcc built it, up to the measured crossover (the GEMV's max_rows) and at
              the rows its wide plan measured faster (`wide_rows`; `GemvKernel.picks`):
              kernels/cuda/gemv.py, reading this object's own layout tensors;
  * "dot"   — tensor-core tiles (triton_gemm.w_dot_kernel) with split-K (`choose_config`): for
              decode batches this is the split-K GEMV (16-row tile, split until every SM streams
              weights), for medium batches a tiled GEMM;
  * "tile"  — on Hopper (sm_90) where nvcc built it, fp16, where it measured faster (`TileKernel.serves`):
              the CUDA tile GEMM (kernels/cuda/tile.py: the weight dequantized in registers into wgmma's A
              operand), reading this object's own layout tensors; block_m is its block height;
  * "dense" — dequantize to a dense weight, then cuBLAS (torch.nn.functional.linear), large M; where
              the weight is wide enough (`dense_chunk`), chunk by chunk of out-features, each chunk's
              dequantization on a side stream beside the previous chunk's GEMM (`dense_chunked`).

This module imports Triton lazily, so the registry can import it where Triton or CUDA is absent;
it registers the kernel for CUDA devices only. Under TRITON_INTERPRET=1 the same object runs on
CPU tensors (with the plain-arithmetic decode instead of inline PTX), which is how the tests
check it.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass

import torch

from .cuda.gemv import GemvPlan, gemv_for
from .cuda.tile import BLOCK_COLS as TILE_COLS
from .cuda.tile import BLOCK_ROWS as TILE_ROWS
from .cuda.tile import tile_for
from .fused import silu_mul
from .gptq import GPTQWeight
from .triton_layout import TritonLayout, UnsupportedLayout, repack


@dataclass(frozen=True)
class GemmConfig:
    kind: str  # "dot" | "dense" | "gemv" | "tile" (block_m: rows a block computes, block_n: columns, num_warps,
    # num_stages: the tensor-core plan's ring depth, 0 its register double buffer)
    block_m: int = 16
    block_n: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    scale_w: bool = False  # dot only: apply the group scale to the weights instead of the accumulator
    chunk: int = 0  # dense only: out-features per chunk, the dequantization of chunk i + 1 running on a
    # side stream beside the GEMM of chunk i (on CUDA); 0: the whole weight dequantized, then one GEMM


# From this many rows on, dequantize + cuBLAS: the crossovers measured on the H200 (bench/kernels_dense.py,
# bench/NOTES-kernels.md "Large batches"): faster than the Triton tiles at 512 rows and above on every
# llama-3-8b / 70b shape, at 256 on the weights of at most DENSE_SMALL_WEIGHT codes (4096x4096,
# 4096x6144, 14336x4096), whose dequantization is short next to the tile kernel's loss
DENSE_MIN_ROWS, DENSE_MIN_ROWS_SMALL, DENSE_SMALL_WEIGHT = 512, 256, 64 << 20
# The Triton tiles' silu epilogue up to this many rows: the 8B decode at 16 rows +1.9% with it, at 64 rows -2.3%
# (H100, bench/NOTES-kernels.md round 15: there the tile's [128, 64] accumulator goes through a layout change)
TILE_SILU_ENV, TILE_SILU_MAX_ROWS = "FLOTILLA_TILE_SILU", 16


def dense_min_rows(layout: TritonLayout) -> int:
    """From how many rows dequantize + cuBLAS beats the Triton tile kernel on this weight."""
    small = layout.in_features * layout.out_features <= DENSE_SMALL_WEIGHT
    return DENSE_MIN_ROWS_SMALL if small else DENSE_MIN_ROWS


def choose_config(m: int, layout: TritonLayout, num_sms: int) -> GemmConfig:
    """Dequantize + cuBLAS from `dense_min_rows` on, else the Triton kernel's `dot_config`."""
    if m >= dense_min_rows(layout):
        return GemmConfig("dense", chunk=dense_chunk(m, layout.out_features))
    return dot_config(m, layout, num_sms)


# The overlapped dense path (`dense_chunked`), where it measured faster than one dequantization and one
# GEMM (bench/kernels_dense.py on an H100, bench/NOTES-kernels.md "Overlapped dense path"): chunks of
# 4096 out-features, from 512 rows, on weights at least three chunks wide. Narrower chunks left each GEMM
# too few tiles; on narrower weights the first chunk's dequantization, which nothing hides, cost the gain.
DENSE_CHUNK, DENSE_CHUNK_MIN_ROWS, DENSE_CHUNK_MIN_CHUNKS = 4096, 512, 3


def dense_chunk(m: int, n: int) -> int:
    """Out-features per chunk of the overlapped dense path for M rows of an N-wide weight; 0: one chunk."""
    return DENSE_CHUNK if m >= DENSE_CHUNK_MIN_ROWS and n >= DENSE_CHUNK_MIN_CHUNKS * DENSE_CHUNK else 0


def dot_config(m: int, layout: TritonLayout, num_sms: int) -> GemmConfig:
    """Tile shape and split count for M rows: the winners of `tune` on an H200 (bench/NOTES-kernels.md),
    as rules. Decode tiles are narrow (64 out-features) and split until ~4 programs per SM, except
    over layouts with short blocks (group 32), whose decode tiles are 256 wide."""
    n, blocks = layout.out_features, layout.k_padded // layout.block_k
    if m <= 64 and layout.rows_per_field < 32:
        # Fewer than 32 words per column per block (group-32 layouts: the GGUF forms, GPTQ g32): a 64-wide
        # tile leaves each step too little work (one short wgmma chain), so the tiles are 256 wide (1.3-1.9x
        # faster at 16 rows on the H200), split until the programs first fill ~0.8 of the SMs, at least 2
        # ways; up to 32 rows twice that over blocks of 32 rows (group 16: Q6_K), whose programs each hold
        # half the work a block (5-14% faster there; at 64 rows the doubled split cost Q6_K's decode 12%).
        # The group scale goes on the weights from 17 rows. The GGUF forms' tunes on an H100
        # (bench/NOTES-kernels.md rounds 19-20) at 16-64 rows: within 2% of the tuned winner in 31 of 36
        # cells, 5.0% at worst; the 16-row rule before (~2 programs per SM) was 6-16% slower on 14336x4096.
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        tiles = -(-m // block_m) * -(-n // 256)
        reach = (4 * num_sms) // 5 * (2 if layout.block_k <= 32 and m <= 32 else 1)
        return GemmConfig("dot", block_m, 256, split_reaching(tiles, blocks, reach),
                          num_warps=4, num_stages=3, scale_w=m > 16)
    if m <= 16:
        tiles = -(-n // 64)
        return GemmConfig("dot", 16, 64, split_for(tiles, blocks, 4 * num_sms), num_warps=4, num_stages=3)
    if m <= 64:
        block_m = 32 if m <= 32 else 64
        wide = -(-m // block_m) * -(-n // 128) >= num_sms
        block_n = 128 if wide else 64
        tiles = -(-m // block_m) * -(-n // block_n)
        return GemmConfig("dot", block_m, block_n, split_for(tiles, blocks, 2 * num_sms),
                          num_warps=8 if wide else 4, num_stages=3)
    block_m = 128 if -(-m // 128) * -(-n // 128) >= num_sms // 2 else 64
    tiles = -(-m // block_m) * -(-n // 128)
    return GemmConfig("dot", block_m, 128, split_for(tiles, blocks, num_sms), num_warps=8, num_stages=3,
                      scale_w=True)


def _gemv_plan(cfg: GemmConfig) -> GemvPlan:
    """A "gemv" config as the GEMV's plan (gemv_config's inverse)."""
    return GemvPlan(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages)


def gemv_config(plan) -> GemmConfig:
    """A GEMV plan (kernels/cuda/gemv.py GemvPlan) as this module's config."""
    return GemmConfig("gemv", block_m=plan.rows, block_n=plan.cols, num_warps=plan.warps, num_stages=plan.stages)


def tile_config(rows: int, splits: int = 1) -> GemmConfig:
    """The CUDA tile GEMM (kernels/cuda/tile.py) with blocks of `rows` batch rows and the input axis cut into
    `splits` ranges, as this module's config."""
    return GemmConfig("tile", block_m=rows, block_n=TILE_COLS, split_k=splits)


def weight_side(cfg: GemmConfig, layout: TritonLayout) -> GemmConfig:
    """The config a layout can run: float offsets need the group scale on the weight side."""
    if cfg.kind == "dot" and layout.offsets is not None and not cfg.scale_w:
        return dataclasses.replace(cfg, scale_w=True)
    return cfg


def split_for(tiles: int, blocks: int, target_programs: int) -> int:
    """The divisor of `blocks` that brings tiles * split closest to the target (from below)."""
    best = 1
    for d in range(1, blocks + 1):
        if blocks % d == 0 and tiles * d <= target_programs:
            best = d
    return best


def split_reaching(tiles: int, blocks: int, target_programs: int) -> int:
    """The smallest power-of-two divisor of `blocks` (the splits tuned), at least 2 where `blocks` allows,
    that brings tiles * split to the target (from above); the largest such divisor if none does."""
    divisors = [d for d in (1 << i for i in range(1, blocks.bit_length())) if blocks % d == 0] or [1]
    return next((d for d in divisors if tiles * d >= target_programs), divisors[-1])


def candidate_configs(m: int, layout: TritonLayout, num_sms: int) -> list[GemmConfig]:
    """The tile configs `TritonGPTQKernel.tune` times for M rows."""
    n, blocks = layout.out_features, layout.k_padded // layout.block_k
    if m >= DENSE_MIN_ROWS:
        grid = [(128, 128, 8, 3, True)]
    elif m <= 16:
        grid = [(16, bn, w, st, False) for bn in (64, 128) for w, st in ((4, 3), (4, 4))] + [(16, 256, 4, 3, False)]
    elif m <= 64:
        bm = 32 if m <= 32 else 64
        grid = [(bm, 64, 4, 3, False), (bm, 128, 4, 3, False), (bm, 128, 4, 4, False), (bm, 128, 8, 3, False)]
        if layout.rows_per_field < 32:  # group-32 layouts: the 256-wide tiles that won at 16 rows (dot_config)
            grid += [(bm, 256, 4, 3, False), (bm, 256, 8, 3, False)]
    else:
        grid = [(64, 128, 4, 3, False), (64, 128, 8, 3, True), (128, 128, 8, 3, True), (128, 64, 4, 3, True)]
    out = [GemmConfig("dense")] if m >= 128 else []
    if m < DENSE_MIN_ROWS:  # the rule's own pick, which the grid below may not hold (group-32 layouts at 16-64 rows)
        out.append(weight_side(dot_config(m, layout, num_sms), layout))
    if dense_chunk(m, n):
        out.append(GemmConfig("dense", chunk=dense_chunk(m, n)))
    for bm, bn, warps, stages, sw in grid:
        tiles = -(-m // bm) * -(-n // bn)
        for s in sorted({split_for(tiles, blocks, f * num_sms) for f in (1, 2, 4)}):
            out.append(weight_side(GemmConfig("dot", bm, bn, s, warps, stages, sw), layout))
    return list(dict.fromkeys(out))


class TritonLayoutKernel:
    """y = x @ W for one weight in the Triton layout, in fp16 or bf16, on the GPU (or the Triton
    interpreter)."""

    name = "triton"

    def __init__(self, layout: TritonLayout, dtype: torch.dtype):
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the Triton kernel computes in float16 or bfloat16, not {dtype}")
        self.layout = layout
        self.dtype = dtype
        device = self.layout.words.device
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 4)
        self._counters = torch.zeros(4096, dtype=torch.int32, device=device)
        self._configs: dict[int, GemmConfig] = {}
        # the tiles' silu epilogue (`silu_mul` on a "dot" config); FLOTILLA_TILE_SILU=0: the product, then
        # kernels/fused.silu_mul, as before it (read once, here)
        self.tile_silu = os.environ.get(TILE_SILU_ENV) != "0"
        self.gemv = self.tile = None
        if device.type == "cuda":
            self.gemv = gemv_for(layout, dtype)  # None: no nvcc, or a layout it does not read
            self.tile = tile_for(layout, dtype)  # None: not Hopper, no nvcc, or a layout it does not read

    def config_for(self, m: int) -> GemmConfig:
        cfg = self._configs.get(m)
        if cfg is None:
            if self.gemv is not None and self.gemv.picks(m):
                cfg = gemv_config(self.gemv.plan_for(m))
            elif self.tile is not None and self.tile.serves(m):
                rows = self.tile.rows_for(m)
                cfg = tile_config(rows, self.tile.splits_for(m, rows))
            else:
                cfg = weight_side(choose_config(m, self.layout, self.num_sms), self.layout)
            self._configs[m] = cfg
        return cfg

    def tune(self, batch_sizes, candidates=None) -> dict[int, tuple[float, GemmConfig]]:
        """Time the candidate configs for each batch size on this weight and keep the fastest
        (a warm-up step: call before capturing CUDA graphs). Returns {m: (µs, config)}."""
        import triton.runtime.errors
        import triton.testing

        chosen = {}
        for m in batch_sizes:
            x = torch.randn(m, self.layout.in_features, device=self.layout.words.device, dtype=self.dtype)
            timed = []
            configs = candidates(m) if candidates else candidate_configs(m, self.layout, self.num_sms)
            # timed here: any M it takes
            if self.gemv is not None and m <= self.gemv.most_rows and not candidates:
                configs = [gemv_config(self.gemv.plan_for(m)), *configs]
            if self.tile is not None and m >= 64 and not candidates:  # the tile GEMM at each block height
                configs = [*configs, *(tile_config(r, self.tile.splits_for(m, r)) for r in TILE_ROWS)]
            for cfg in configs:
                fn = lambda: self(x, config=cfg)  # noqa: E731
                try:
                    timed.append((1000 * triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median"), cfg))
                except triton.runtime.errors.OutOfResources:
                    continue  # a tile too large for this block_k's shared memory
            best = min(timed, key=lambda p: p[0])
            self._configs[m] = best[1]
            chosen[m] = best
        return chosen

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                 config: GemmConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """y [..., out]; with `out` (a [M, out] view, e.g. a column slice of a merged output)
        the result is written there and `out` returned."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        cfg = config or self.config_for(x2.shape[0])
        perm = self.layout.perm
        if cfg.kind == "gemv":
            if self.gemv is None:
                raise ValueError("the CUDA GEMV is not available for this weight (see the log)")
            y = self.gemv(x2, bias, out, _gemv_plan(cfg))
            if out is not None:
                return y
        elif cfg.kind == "tile":
            if self.tile is None:
                raise ValueError("the CUDA tile GEMM is not available for this weight (see the log)")
            y = self.tile(x2, bias, out, rows=cfg.block_m, splits=cfg.split_k)
            if out is not None:
                return y
        elif cfg.kind == "dense":
            if perm is not None:
                x2 = x2.index_select(1, perm)  # the dense weight keeps the sorted row order
            bias = None if bias is None else bias.to(x2.dtype)
            if cfg.chunk and cfg.chunk < self.layout.out_features:
                y = dense_chunked(x2, self.layout, cfg.chunk, bias, out)
                if out is not None:
                    return y
            else:
                y = torch.nn.functional.linear(x2, dequantize_layout(self.layout, self.dtype), bias)
                if out is not None:
                    return out.copy_(y)
        else:
            y = matmul_layout(x2, self.layout, weight_side(cfg, self.layout), bias,
                              self._counter_buffer(x2.shape[0], cfg), out)
            if out is not None:
                return y
        return y.reshape(*lead, self.layout.out_features)

    def _epilogue_plan(self, m: int, norm: bool = False) -> GemvPlan | None:
        """The GEMV plan at M rows whose epilogue can compute silu(gate) * up (norm: add the residual and
        the norm; the tensor-core plans), or None."""
        cfg = self.config_for(m)
        if self.gemv is None or cfg.kind != "gemv":
            return None
        plan = _gemv_plan(cfg)
        fuses = self.gemv.fuses_norm if norm else self.gemv.fuses_silu
        return plan if fuses(m, plan) else None

    def fuses_silu(self, m: int) -> bool:
        """Whether `silu_mul` at M rows is one launch (the CUDA GEMV's epilogue, or the Triton tiles')."""
        return self._epilogue_plan(m) is not None or self._tile_silu(m)

    def _tile_silu(self, m: int) -> bool:
        cfg = self.config_for(m)
        return (self.tile_silu and m <= TILE_SILU_MAX_ROWS and cfg.kind == "dot" and self.layout.out_features % 2 == 0
                and cfg.block_n % 2 == 0)

    def silu_mul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """silu(gate) * up of this [gate | up] weight's product [..., 2 I] -> [..., I]: one launch where
        the CUDA GEMV or the Triton tiles serve these rows and there is no bias (their epilogues pair
        gate column j with up column I + j), else the product, then kernels/fused.silu_mul."""
        x2 = x.reshape(-1, x.shape[-1])
        m, half = x2.shape[0], self.layout.out_features // 2
        plan = self._epilogue_plan(m) if bias is None else None
        if plan is None:
            if bias is not None or not self._tile_silu(m):
                return silu_mul(self(x, bias))
            x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
            cfg = self.config_for(m)
            y = matmul_layout(x2, self.layout, weight_side(cfg, self.layout), None, self._counter_buffer(m, cfg),
                              silu=True)
            return y.reshape(*x.shape[:-1], half)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        return self.gemv(x2, None, None, plan, silu=True).reshape(*x.shape[:-1], half)

    def fuses_norm(self, m: int) -> bool:
        """Whether `add_norm` and `normed` serve M rows (the CUDA GEMV's tensor-core plan)."""
        return self._epilogue_plan(m, norm=True) is not None

    def add_norm(self, x: torch.Tensor, resid: torch.Tensor, norm, bias: torch.Tensor | None = None):
        """resid + x @ W and what the next GEMV needs for its RMSNorm (cuda/gemv.py NormedResidual);
        only where `fuses_norm`."""
        x2 = x if x.stride(-1) == 1 else x.contiguous()
        return self.gemv.add_norm(x2, resid, norm, bias, self._epilogue_plan(x2.shape[0], norm=True))

    def normed(self, nr, bias: torch.Tensor | None = None) -> torch.Tensor:
        """rms_norm(nr.resid) * gamma @ W (+ bias) from a producer's NormedResidual; only where `fuses_norm`."""
        return self.gemv(nr.scaled, bias, None, self._epilogue_plan(nr.scaled.shape[0], norm=True), norm=nr)

    def silu_mul_normed(self, nr) -> torch.Tensor:
        """silu(gate) * up of rms_norm(nr.resid) * gamma @ W (no bias); only where `fuses_norm`."""
        return self.gemv(nr.scaled, None, None, self._epilogue_plan(nr.scaled.shape[0], norm=True), silu=True, norm=nr)

    def _counter_buffer(self, m: int, cfg: GemmConfig) -> torch.Tensor:
        tiles = -(-m // cfg.block_m) * -(-self.layout.out_features // cfg.block_n)
        if cfg.split_k > 1 and tiles > self._counters.numel():
            # Every launch leaves its counters at zero, so a larger zeroed buffer can replace it.
            self._counters = torch.zeros(tiles, dtype=torch.int32, device=self._counters.device)
        return self._counters


class TritonGPTQKernel(TritonLayoutKernel):
    """y = x @ W for one GPTQ linear: repacked once into the Triton layout."""

    def __init__(self, w: GPTQWeight, dtype: torch.dtype, block_k: int | None = None):
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the Triton kernel computes in float16 or bfloat16, not {dtype}")
        super().__init__(repack(w, block_k), dtype)


def matmul_layout(x2: torch.Tensor, layout: TritonLayout, cfg: GemmConfig, bias: torch.Tensor | None,
                  counters: torch.Tensor, out: torch.Tensor | None = None, silu: bool = False) -> torch.Tensor:
    """Launch the tensor-core kernel for x2 [M, in]; returns [M, out] in x2's dtype (written into
    `out`, a [M, out] view with unit column stride, when given). `silu` (a [gate | up] weight, no bias):
    silu(gate) * up [M, out / 2] from the tiles' last store, in one launch."""
    from .triton_gemm import w_dot_kernel

    m, k = x2.shape
    if k != layout.in_features:
        raise ValueError(f"activation has {k} input features, the weight expects {layout.in_features}")
    if cfg.kind != "dot":
        raise ValueError(f"matmul_layout runs the 'dot' path, not {cfg.kind!r}")
    n = layout.out_features
    has_offset = layout.offsets is not None
    if has_offset and not cfg.scale_w:
        raise ValueError("a layout with float offsets runs with the scale on the weight side (scale_w)")
    if silu and (bias is not None or n % 2 or cfg.block_n % 2):
        raise ValueError("the silu epilogue needs a [gate | up] weight of even width, an even tile and no bias")
    blocks = layout.k_padded // layout.block_k
    split = cfg.split_k if blocks % cfg.split_k == 0 else 1
    out = _output(x2, n // 2 if silu else n, out)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x2.device) if split > 1 else out
    width, tile = (n // 2, cfg.block_n // 2) if silu else (n, cfg.block_n)
    grid = (-(-m // cfg.block_m) * -(-width // tile), split)
    is_bf16 = x2.dtype == torch.bfloat16
    scale_w = cfg.scale_w
    w_dot_kernel[grid](
        x2, layout.words, layout.scales, _group_table(layout), _or(layout.perm, layout.words),
        _or(bias, out), out, ws, counters, m, n, k, layout.words.shape[1], x2.stride(0), out.stride(0),
        blocks // split,
        BITS=layout.bits, BLOCK_K=layout.block_k, GROUP_SIZE=layout.group_size,
        ZERO_CONST=layout.zero_const, HAS_ZEROS=layout.zeros is not None,
        HAS_PERM=layout.perm is not None, HAS_BIAS=bias is not None, SCALE_W=scale_w, SPLIT=split > 1,
        IS_BF16=is_bf16, ASM=_asm(layout.bits, is_bf16, scale_w, offset=has_offset),
        ASM_ODD=_asm(layout.bits, is_bf16, scale_w, odd=True, offset=has_offset), EVEN_N=width % tile == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_OFFSET=has_offset, SILU=silu, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out


def dense_chunked(x2: torch.Tensor, layout: TritonLayout, chunk: int, bias: torch.Tensor | None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """x2 @ W (+ bias) as GEMMs over column chunks of the weight, each chunk dequantized into one of two
    scratch buffers just before its GEMM. On CUDA the dequantization (memory-bound) runs on a side
    stream while the previous chunk's GEMM (compute-bound at these batch sizes) runs on the caller's,
    so most of it hides behind the GEMMs; events order every reuse of a buffer, and the caller's stream
    waits for every chunk, so the side stream rejoins it (which CUDA-graph capture requires)."""
    k = x2.shape[1]
    n = layout.out_features
    out = _output(x2, n, out)
    bufs = [torch.empty((min(chunk, n), k), dtype=x2.dtype, device=x2.device) for _ in range(2)]
    starts = range(0, n, chunk)
    on_cuda = x2.device.type == "cuda"
    if on_cuda:
        main = torch.cuda.current_stream(x2.device)
        side = _side_stream(x2.device)
        side.wait_stream(main)  # x2, the buffers and `out` are ready
        # No record_stream for the buffers: the caller's stream waits for every side-stream write
        # (the last chunk's `ready` included), so freeing them to it is safe; marking them used by
        # the side stream would keep a graph capture from reusing them (a pair per call).
        gemm_done = []
    for i, n0 in enumerate(starts):
        n1 = min(n0 + chunk, n)
        buf = bufs[i % 2][: n1 - n0]
        if on_cuda:
            with torch.cuda.stream(side):
                if i >= 2:
                    side.wait_event(gemm_done[i - 2])  # the buffer's previous GEMM has read it
                dequantize_layout(layout, x2.dtype, n0=n0, n1=n1, out=buf)
                ready = torch.cuda.Event()
                ready.record(side)
            main.wait_event(ready)
        else:
            dequantize_layout(layout, x2.dtype, n0=n0, n1=n1, out=buf)
        dst = out[:, n0:n1]
        if bias is None:
            torch.mm(x2, buf.t(), out=dst)
        else:
            torch.addmm(bias[n0:n1], x2, buf.t(), out=dst)
        if on_cuda:
            done = torch.cuda.Event()
            done.record(main)
            gemm_done.append(done)
    return out


def _output(x2: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
    """The [M, n] result tensor of a product of x2: `out` checked, or a new one."""
    m = x2.shape[0]
    if out is None:
        return torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if out.shape != (m, n) or out.stride(1) != 1 or out.dtype != x2.dtype:
        raise ValueError(f"out must be a [{m}, {n}] {x2.dtype} view with unit column stride, "
                         f"not {tuple(out.shape)} {out.dtype} with strides {out.stride()}")
    return out


_SIDE_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device):
    """One side stream per GPU (a CUDA tensor's device always has its index) for the overlapped dense
    path's dequantization."""
    if device.index not in _SIDE_STREAMS:
        _SIDE_STREAMS[device.index] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device.index]


def dequantize_layout(layout: TritonLayout, dtype: torch.dtype, block_n: int = 64, n0: int = 0,
                      n1: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense weight transposed, W^T [out, in] in `dtype`, in the layout's (sorted) row order; with
    n0 / n1 only out-features n0 .. n1 - 1 ([n1 - n0, in]), written into `out` when given."""
    from .triton_gemm import dequantize_kernel

    k, n = layout.in_features, layout.out_features
    n1 = n if n1 is None else n1
    if not 0 <= n0 < n1 <= n:
        raise ValueError(f"out-feature range {n0}..{n1} outside 0..{n}")
    if out is None:
        out = torch.empty((n1 - n0, k), dtype=dtype, device=layout.words.device)
    elif out.shape != (n1 - n0, k) or not out.is_contiguous() or out.dtype != dtype:
        raise ValueError(f"out must be a contiguous [{n1 - n0}, {k}] {dtype} tensor, not {tuple(out.shape)}")
    grid = (layout.k_padded // layout.block_k, -(-(n1 - n0) // block_n))
    is_bf16 = dtype == torch.bfloat16
    has_offset = layout.offsets is not None
    dequantize_kernel[grid](
        layout.words, layout.scales, _group_table(layout), out, n, k, layout.words.shape[1], n0, n1,
        BITS=layout.bits, BLOCK_K=layout.block_k, GROUP_SIZE=layout.group_size,
        ZERO_CONST=layout.zero_const, HAS_ZEROS=layout.zeros is not None, IS_BF16=is_bf16,
        ASM=_asm(layout.bits, is_bf16, True, offset=has_offset),
        ASM_ODD=_asm(layout.bits, is_bf16, True, odd=True, offset=has_offset),
        BLOCK_N=block_n, HAS_OFFSET=has_offset, num_warps=4)
    return out


def _asm(bits: int, is_bf16: bool, scale_w: bool, odd: bool = False, offset: bool = False) -> str:
    from .triton_gemm import pair_asm

    return "" if os.environ.get("TRITON_INTERPRET") == "1" else pair_asm(bits, is_bf16, scale_w, odd, offset)


def _group_table(layout: TritonLayout) -> torch.Tensor:
    """The kernels' z_ptr: the integer zeros, or the float offsets (a layout has at most one)."""
    if layout.zeros is not None and layout.offsets is not None:
        raise ValueError("a Triton layout holds integer zeros or float offsets, not both")
    return _or(layout.zeros if layout.zeros is not None else layout.offsets, layout.scales)


def _or(t: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """Triton needs a pointer for every argument; constexpr flags keep placeholders unread."""
    return placeholder if t is None else t


def make_kernel(w: GPTQWeight, dtype: torch.dtype):
    """Registry factory: the Triton kernel, or the dense one where the layout cannot serve."""
    from .reference import DenseKernel

    if dtype not in (torch.float16, torch.bfloat16):
        return DenseKernel(w, dtype)
    try:
        return TritonGPTQKernel(w, dtype)
    except UnsupportedLayout:
        return DenseKernel(w, dtype)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def register_kernels(register) -> None:
    from .registry import KernelEntry

    def supports(device: torch.device, bits: int) -> bool:
        return torch.device(device).type == "cuda" and bits in (4, 8) and triton_available()

    register(KernelEntry("triton", make_kernel, supports, priority=20))


__all__ = ["GemmConfig", "TritonGPTQKernel", "TritonLayoutKernel", "choose_config", "matmul_layout", "dequantize_layout",
           "register_kernels"]
