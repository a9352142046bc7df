"""Dequant-matmul on the GPU: flotilla's W4A16 / W8A16 kernels against fp16 and other libraries.

    python bench/kernels.py                 # the table: 4 weight shapes x batches 1..2048
    python bench/kernels.py --json          # one JSON object per (shape, batch) row
    python bench/kernels.py --sweep         # also time a grid of tile configs per case (tuning)
    python bench/kernels.py --gguf --batches 1,16   # the GGUF forms' kernels (bench/kernels_gguf.py)
    python bench/kernels.py --batches 1,2,4,8,16 --skip-cuda --gemv-sweep   # + the GEMV's plans (kernels_gemv.py)
    python bench/kernels.py --graph --only-sweeps --gemv-sweep --gemv-chain --gemv-rows 1,2,4   # + back to back
    python bench/kernels.py --graph --only-sweeps --dense-sweep     # Triton tiles vs dequantize + cuBLAS
    python bench/kernels.py --graph --only-sweeps --tile-sweep      # the CUDA tile GEMM (Hopper) vs both

Weight shapes are in_features x out_features. Per case: microseconds per call (median of
triton.testing.do_bench, which clears the L2 cache before every call; `--flush read` also reads another
256 MB after the clearing, so that no dirty line is written back during the call) for
  ours W4A16 (GPTQ int4, group 128) and W8A16 (GPTQ int8, group 128), fp16 activations: the CUDA
  GEMV over the Triton layout (kernels/cuda/gemv.py, batches up to 8, and 9-16 where the registry picks its
  wide plan; columns "GEMV", with TB/s
  and x fp16), the Triton "dot" path (kernels/triton_linear), the CUDA tile GEMM on Hopper (kernels/cuda/
  tile.py, batches of 64 and more; columns "Tile"), and the Marlin-style CUDA kernels
  (kernels/cuda, columns "CUDA"; --skip-cuda leaves them out); "pick" is what the registry's
  kernel object runs at that batch;
  fp16 torch.nn.functional.linear (cuBLAS);
  tinygemm int4 weight-only (torch.ops.aten._weight_int4pack_mm, what torchao calls; bf16);
  bitsandbytes nf4 (Linear4bit) and int8 (Linear8bitLt), when bitsandbytes imports;
plus our effective weight bandwidth (bytes of codes + scales + zeros / time) and the physical
floor (those bytes / measured device-to-device copy bandwidth). Before timing, every path of
ours is checked against flotilla.kernels.reference on the same real shapes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flotilla.kernels.gptq import GPTQWeight, default_g_idx, num_groups  # noqa: E402
from flotilla.kernels.reference import dequantize  # noqa: E402
from flotilla.kernels.cuda.kernel import CudaGPTQKernel  # noqa: E402
from flotilla.kernels.triton_linear import GemmConfig, TritonGPTQKernel, gemv_config, split_for  # noqa: E402

from bench.kernels_gemv import run_gemv_sweep, triton_config  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]
BATCHES = [1, 16, 64, 256, 2048]


def random_gptq(k: int, n: int, bits: int, group: int, sym: bool, act_order: bool, device) -> GPTQWeight:
    """Random codes packed straight into the GPTQ tensors (uniform random words = uniform codes)."""
    g = num_groups(k, group)
    qweight = torch.randint(-2**31, 2**31 - 1, (k * bits // 32, n), dtype=torch.int32, device=device)
    if sym:
        word = sum(((1 << (bits - 1)) - 1) << (i * bits) for i in range(32 // bits))  # zero - 1 each
        word = word - 2**32 if word >= 2**31 else word
        qzeros = torch.full((g, n * bits // 32), word, dtype=torch.int32, device=device)
    else:  # fields in [0, 2**bits - 2] so that zero = field + 1 stays a valid code
        fields = torch.randint(0, (1 << bits) - 1, (g, n), dtype=torch.int64, device=device)
        per = 32 // bits
        words = (fields.view(g, n // per, per) << (torch.arange(per, device=device) * bits)).sum(-1)
        qzeros = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    scales = (torch.rand(g, n, device=device) * 0.02 + 0.001).half()
    g_idx = default_g_idx(k, group, device)
    if act_order:
        g_idx = g_idx[torch.randperm(k, device=device)]
    return GPTQWeight(qweight, qzeros, scales, g_idx.to(torch.int32), bits, group)


GRAPHS = False  # --graph: time CUDA-graph replays of each call (no Python launch cost)
FLUSH = "write"  # --flush: how the L2 is emptied before each timed call ("write": do_bench's; "read": clean)
FLUSH_BYTES = 256 << 20


def time_us(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median µs of fn (L2 cleared before every call). With --graph the call is captured once in
    a CUDA graph and its replay is timed, as a decode step runs; a call that cannot be captured
    is timed eagerly. FLUSH "write" (the tables of record): triton.testing.do_bench, which zeroes
    256 MB before each call, so the call starts with the L2 full of dirty lines that it writes back
    while it runs; "read": `time_cold_us`."""
    import triton.testing

    if GRAPHS:
        fn()  # compile, allocate workspaces
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
            fn = graph.replay
        except Exception:  # noqa: BLE001 - e.g. a library that synchronises inside the call
            torch.cuda.synchronize()
    if FLUSH == "read":
        return time_cold_us(fn, warmup, rep)
    return 1000.0 * triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


_flush_bufs: list[torch.Tensor] = []


def time_cold_us(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median µs of fn with its data cold but no dirty line to write back: before each call 256 MB are
    zeroed (as do_bench does), then 256 MB of another buffer are read, which writes the dirty lines back
    and leaves the L2 holding clean lines of neither fn's inputs nor outputs (a decode step's GEMV meets
    its weights so: cold, behind kernels that wrote little). `warmup` and `rep` count calls here (do_bench
    reads the same arguments as milliseconds)."""
    if not _flush_bufs:
        _flush_bufs.extend(torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") for _ in range(2))
        _flush_bufs[1].fill_(1)
    dirty, clean = _flush_bufs
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    sink = torch.empty((), dtype=torch.int32, device="cuda")
    for start, end in zip(starts, ends):
        dirty.zero_()
        torch.amax(clean, dim=0, out=sink)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(1000.0 * s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2]


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), the floor's denominator."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    import triton.testing

    t = 1000.0 * triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")  # eager, even with --graph
    return 2 * src.numel() / (t * 1e-6)


class Peers:
    """The other libraries' kernels for one weight shape, built once."""

    def __init__(self, k: int, n: int):
        self.k, self.n = k, n
        self.w16 = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
        self.tiny = None
        try:
            packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
            self.tiny_w = torch.ops.aten._convert_weight_to_int4pack(packed, 8)
            self.tiny_sz = torch.rand(k // 128, n, 2, device="cuda", dtype=torch.bfloat16)
            self.tiny = True
        except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
            self.tiny_error = f"{type(e).__name__}: {e}"
        self.bnb4 = self.bnb8 = None
        self.bnb_error = ""
        try:
            import bitsandbytes as bnb

            lin = torch.nn.Linear(k, n, bias=False, dtype=torch.float16)
            lin.weight.data.copy_(self.w16.cpu())
            self.bnb4 = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=torch.float16, quant_type="nf4")
            self.bnb4.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False, quant_type="nf4")
            self.bnb4 = self.bnb4.cuda()
            self.bnb8 = bnb.nn.Linear8bitLt(k, n, bias=False, has_fp16_weights=False, threshold=0.0)
            self.bnb8.weight = bnb.nn.Int8Params(lin.weight.data.clone(), requires_grad=False, has_fp16_weights=False)
            self.bnb8 = self.bnb8.cuda()
        except Exception as e:  # noqa: BLE001
            self.bnb4 = self.bnb8 = None
            self.bnb_error = f"{type(e).__name__}: {e}"[:200]

    def time(self, m: int) -> dict:
        x16 = torch.randn(m, self.k, device="cuda", dtype=torch.float16)
        out = {"fp16_us": time_us(lambda: torch.nn.functional.linear(x16, self.w16))}
        if self.tiny:
            xb = x16.bfloat16()
            out["tinygemm_us"] = time_us(lambda: torch.ops.aten._weight_int4pack_mm(xb, self.tiny_w, 128, self.tiny_sz))
        with torch.no_grad():
            if self.bnb4 is not None:
                out["bnb_nf4_us"] = time_us(lambda: self.bnb4(x16))
                out["bnb_int8_us"] = time_us(lambda: self.bnb8(x16))
        return out


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def plan_of(kernel, m: int):
    return kernel.plan_for(m) if hasattr(kernel, "plan_for") else kernel.config_for(m)


def check(kernel, w: GPTQWeight, batches, dtype, tol: float, w32=None, config=None) -> list[str]:
    """Every batch's path against the reference on this weight; returns failure lines.
    config(m): the Triton kernel's config to force (None: its own choice)."""
    failures = []
    w32 = dequantize(w, torch.float32) if w32 is None else w32
    for m in batches:
        x = torch.randn(m, w.in_features, device="cuda", dtype=dtype)
        bias = torch.randn(w.out_features, device="cuda", dtype=dtype)
        torch.full((m, w.out_features), float("nan"), device="cuda", dtype=dtype)  # poison the allocator
        cfg = config(m) if config else None
        y = kernel(x, bias, config=cfg) if cfg else kernel(x, bias)
        ref = x.float() @ w32 + bias.float()
        err = rel_err(y, ref)
        ok = err < tol and bool(torch.isfinite(y).all())
        if not ok:
            failures.append(f"{kernel.name} {w.in_features}x{w.out_features} bits={w.bits} m={m} {dtype} "
                            f"{cfg or plan_of(kernel, m)}: rel err {err:.2e}")
    return failures


def check_ours(w: GPTQWeight, batches, dtype, tol: float, w32=None, cuda: bool = True) -> list[str]:
    """The Triton kernel's own choice, its "dot" path, its GEMV (batches up to 8) and the CUDA kernel."""
    triton = TritonGPTQKernel(w, dtype)
    failures = check(triton, w, batches, dtype, tol, w32)
    failures += check(triton, w, batches, dtype, tol, w32, lambda m: triton_config(triton, m))
    if triton.gemv is not None:
        failures += check(triton, w, [m for m in batches if m <= 8] or [1, 5, 8], dtype, tol, w32,
                          lambda m: gemv_config(triton.gemv.plan_for(m)))
    else:
        failures.append(f"no GEMV for {w.in_features}x{w.out_features} bits={w.bits} {dtype}")
    if cuda:
        failures += check(CudaGPTQKernel(w, dtype), w, batches, dtype, tol, w32)
    return failures


def correctness_suite(args) -> list[str]:
    """Each decode variant (bits, dtype, zeros, act-order, group) on a mid shape through every path
    (split-K decode tile, 64-row tile, dense), then ours on every real shape and batch."""
    torch.backends.cuda.matmul.allow_tf32 = False
    failures = []
    for bits in (4, 8):
        for dtype in (torch.float16, torch.bfloat16):
            tol = 2e-3 if dtype == torch.float16 else 1.2e-2
            for group, sym, act in ((128, True, False), (128, False, True), (32, False, False), (-1, True, True)):
                w = random_gptq(1024, 768, bits, group, sym, act, "cuda")
                failures += check_ours(w, [1, 5, 40, 1100], dtype, tol, cuda=not args.skip_cuda)
    for k, n in args.shapes:
        for bits in (4, 8):
            w = random_gptq(k, n, bits, 128, True, False, "cuda")
            w32 = dequantize(w, torch.float32)
            failures += check_ours(w, args.batches, torch.float16, 2e-3, w32, cuda=not args.skip_cuda)
            del w32
    return failures


def sweep_configs(m: int, blocks: int, n: int, num_sms: int):
    """Candidate tile configs for M rows (the tuning grid; wider than the kernel's own)."""
    out = []
    if m <= 16:
        # wgmma tiles (a multiple of 64 out-features, warps a multiple of 4), and tiles that Triton
        # lowers to Ampere-style mma.sync instead (32 out-features, or 1-2 warps): no wgmma waits
        grid = [(16, bn, w, st, False) for bn in (64, 128, 256) for w, st in ((4, 3), (4, 4), (8, 3))]
        grid += [(16, 32, w, st, False) for w, st in ((1, 3), (2, 3), (2, 4), (4, 3), (4, 5))]
        grid += [(16, 64, w, st, False) for w, st in ((2, 3), (2, 5))] + [(16, 64, 4, 5, False)]
    elif m <= 64:
        grid = [(m, bn, w, st, sw) for bn in (64, 128) for w, st in ((4, 3), (4, 4), (8, 3)) for sw in (False, True)]
        # 256 out-features a tile: x read from L2 once per 256 columns instead of 64 / 128
        grid += [(m, 256, w, st, False) for w, st in ((4, 3), (8, 3), (8, 4))]
    else:
        grid = [(bm, bn, w, 3, sw) for bm in (64, 128) for bn in (64, 128) for w in (4, 8) for sw in (False, True)
                if not (bm == 128 and bn == 128 and w == 4)]
    for bm, bn, warps, stages, sw in grid:
        tiles = -(-m // bm) * -(-n // bn)
        for s in sorted({split_for(tiles, blocks, f * num_sms) for f in (1, 2, 4)}):
            out.append(GemmConfig("dot", bm, bn, s, warps, stages, sw))
    return out


def run_sweep(args, results: list) -> None:
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for k, n in args.sweep_shapes:
        for bits in args.sweep_bits:
            w = random_gptq(k, n, bits, 128, True, False, "cuda")
            for block_k in ((128, 256) if bits == 4 else (64, 128)):
                if args.sweep_block_k and block_k not in args.sweep_block_k:
                    continue
                kern = TritonGPTQKernel(w, torch.float16, block_k=block_k)
                blocks = kern.layout.k_padded // kern.layout.block_k
                for m in (args.sweep_batches if bits == 4 else [b for b in args.sweep_batches if b <= 16]):
                    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                    default = kern.config_for(m)
                    print(f"sweep {k}x{n} w{bits} block_k={block_k} m={m}: default {default}: "
                          f"{time_us(lambda: kern(x), warmup=5, rep=20):7.1f}us", flush=True)
                    timed = []
                    for cfg in sweep_configs(m, blocks, n, num_sms):
                        try:
                            timed.append((time_us(lambda: kern(x, config=cfg), warmup=5, rep=20), cfg))
                        except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                            print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    timed.sort(key=lambda p: p[0])
                    for t, cfg in timed[:3]:
                        print(f"    {t:7.1f}us {cfg}", flush=True)
                    results.append({"sweep": f"{k}x{n}", "bits": bits, "block_k": block_k, "m": m,
                                    "best": [[t, cfg.__dict__] for t, cfg in timed[:6]]})


def check_attention() -> str:
    """The paged decode kernel against gather + softmax on the GPU, and its time."""
    from flotilla.kernels.triton_attention import paged_attention_decode

    torch.manual_seed(0)
    batch, heads, kv_heads, dim, block = 16, 32, 8, 128, 16
    lens = torch.randint(1, 2048, (batch,), device="cuda", dtype=torch.int32)
    lens[0] = 2048
    max_blocks = 2048 // block
    k_cache = torch.randn(batch * max_blocks, block, kv_heads, dim, device="cuda", dtype=torch.float16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * max_blocks, device="cuda", dtype=torch.int32).view(batch, max_blocks)
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.float16)
    lines = []
    for splits in (1, 4):
        out = paged_attention_decode(q, k_cache, v_cache, tables, lens, num_splits=splits)
        errs = []
        for b in range(batch):
            n = int(lens[b])
            k = k_cache[tables[b].long()].reshape(-1, kv_heads, dim)[:n].float().repeat_interleave(4, 1)
            v = v_cache[tables[b].long()].reshape(-1, kv_heads, dim)[:n].float().repeat_interleave(4, 1)
            p = (torch.einsum("hd,nhd->hn", q[b].float(), k) * dim ** -0.5).softmax(-1)
            errs.append(rel_err(out[b], torch.einsum("hn,nhd->hd", p, v)))
        kv_bytes = 2 * int(lens.sum()) * kv_heads * dim * 2
        t = time_us(lambda: paged_attention_decode(q, k_cache, v_cache, tables, lens, num_splits=splits))
        lines.append(f"paged decode B={batch} Hq={heads} Hkv={kv_heads} D={dim} splits={splits}: "
                     f"max rel err {max(errs):.1e}, {t:.1f} us, {kv_bytes / (t * 1e-6) / 1e12:.2f} TB/s of KV")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object per row")
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--sweep", action="store_true", help="time a grid of tile configs (tuning)")
    ap.add_argument("--sweep-shapes", default="8192x28672,14336x4096,4096x4096")
    ap.add_argument("--sweep-batches", default="1,16,64,256")
    ap.add_argument("--sweep-bits", default="4,8")
    ap.add_argument("--sweep-block-k", default="", help="only these block_k (default: 128,256 at 4 bits, 64,128 at 8)")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--tune", action="store_true", help="let each kernel time its candidate configs first")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays instead of eager calls")
    ap.add_argument("--flush", choices=("write", "read"), default="write",
                    help="how the L2 is emptied before each call: do_bench's zeroing (the tables of record; the "
                         "call writes the dirty lines back), or that and a read of another 256 MB (clean lines)")
    ap.add_argument("--gguf", action="store_true", help="the GGUF forms' table instead (bench/kernels_gguf.py)")
    ap.add_argument("--skip-cuda", action="store_true", help="leave out the Marlin-style CUDA kernels (kernels/cuda)")
    ap.add_argument("--gemv-sweep", action="store_true", help="after the table, time the GEMV's plans (kernels_gemv.py)")
    ap.add_argument("--gemv-bits", default="4,8", help="the GEMV sweep's bit widths")
    ap.add_argument("--gemv-rows", default="1,2,4,8", help="the GEMV sweep's batches")
    ap.add_argument("--gemv-forms", default="",
                    help="the GGUF GEMV sweep's forms (--gguf; default one of each layout kind)")
    ap.add_argument("--gemv-chain", action="store_true", help="the GEMV sweep's best plans timed back to back too")
    ap.add_argument("--gemv-all", action="store_true", help="the GEMV sweep times the plans that always lost too")
    ap.add_argument("--dense-sweep", action="store_true", help="Triton tiles vs dequantize + cuBLAS (kernels_dense.py)")
    ap.add_argument("--dense-rows", default="128,256,512,1024,2048", help="the dense sweep's batches")
    ap.add_argument("--tile-sweep", action="store_true",
                    help="the CUDA tile GEMM's block heights vs the other paths (kernels_tile.py)")
    ap.add_argument("--tile-rows", default="64,128,256,512,1024,2048", help="the tile sweep's batches")
    ap.add_argument("--tile-heights", default="", help="the tile sweep's block heights (default: all of BLOCK_ROWS)")
    ap.add_argument("--only-sweeps", action="store_true", help="skip the table: only the sweeps asked for")
    args = ap.parse_args(argv)
    global GRAPHS, FLUSH
    GRAPHS, FLUSH = args.graph, args.flush
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU (none is visible)", file=sys.stderr)
        return 2
    parse = lambda s: [tuple(int(v) for v in p.split("x")) for p in s.split(",")]  # noqa: E731
    args.shapes, args.sweep_shapes = parse(args.shapes), parse(args.sweep_shapes)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.sweep_batches = [int(b) for b in args.sweep_batches.split(",")]
    args.sweep_bits = [int(b) for b in args.sweep_bits.split(",")]
    args.sweep_block_k = [int(b) for b in args.sweep_block_k.split(",") if b]
    args.gemv_bits = [int(b) for b in args.gemv_bits.split(",")]
    args.gemv_rows = [int(m) for m in args.gemv_rows.split(",")]
    args.dense_rows = [int(m) for m in args.dense_rows.split(",")]
    args.tile_rows = [int(m) for m in args.tile_rows.split(",")]
    args.tile_heights = [int(h) for h in args.tile_heights.split(",") if h.strip()]
    from flotilla.kernels.cuda.tile import BLOCK_ROWS
    if any(h not in BLOCK_ROWS for h in args.tile_heights):
        ap.error(f"--tile-heights {','.join(map(str, args.tile_heights))}: block heights among {BLOCK_ROWS}")
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, L2 flush: {FLUSH}", flush=True)
    if args.gguf:
        from bench.kernels_gguf import run_gguf

        return run_gguf(args, time_us, lambda k, n: TritonGPTQKernel(random_gptq(k, n, 4, 128, True, False, "cuda"),
                                                                    torch.float16))

    if not args.skip_check:
        failures = correctness_suite(args)
        print(f"correctness vs reference: {'OK' if not failures else f'{len(failures)} FAILED'}", flush=True)
        for f in failures:
            print("  FAIL", f, flush=True)

    if args.only_sweeps:
        return run_sweeps(args, [])
    print(check_attention(), flush=True)
    bw = copy_bandwidth()
    print(f"device-to-device copy bandwidth: {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for k, n in args.shapes:
        peers = Peers(k, n)
        if peers.bnb_error:
            print(f"bitsandbytes unavailable: {peers.bnb_error}", flush=True)
        weights = {bits: random_gptq(k, n, bits, 128, True, False, "cuda") for bits in (4, 8)}
        cuda = {} if args.skip_cuda else {bits: CudaGPTQKernel(w, torch.float16) for bits, w in weights.items()}
        ours = {bits: TritonGPTQKernel(w, torch.float16) for bits, w in weights.items()}
        if args.tune:
            for kern in ours.values():
                kern.tune(args.batches)
        for m in args.batches:
            row = {"shape": f"{k}x{n}", "batch": m, "flush": FLUSH}
            row.update(peers.time(m))
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            for bits, kern in ours.items():
                nbytes = kern.layout.nbytes()
                row[f"w{bits}_floor_us"] = nbytes / bw * 1e6
                row[f"pick_w{bits}"] = kern.config_for(m).kind
                t = row[f"triton_w{bits}_us"] = time_us(lambda: kern(x, config=triton_config(kern, m)))
                row[f"triton_w{bits}_speedup"] = row["fp16_us"] / t
                if kern.tile is not None and m >= 64:
                    t = row[f"tile_w{bits}_us"] = time_us(lambda: kern.tile(x))
                    row[f"tile_w{bits}_speedup"] = row["fp16_us"] / t
                    row[f"tile_w{bits}_rows"] = kern.tile.rows_for(m)
                if kern.gemv is not None and (m <= 8 or kern.gemv.picks(m)):  # past 8 rows: the wide plan, where picked
                    t = row[f"gemv_w{bits}_us"] = time_us(lambda: kern.gemv(x))
                    row[f"gemv_w{bits}_tbps"] = nbytes / (t * 1e-6) / 1e12
                    row[f"gemv_w{bits}_speedup"] = row["fp16_us"] / t
                    row[f"gemv_w{bits}_plan"] = str(kern.gemv.plan_for(m))
            for bits, kern in cuda.items():
                t = row[f"w{bits}_us"] = time_us(lambda: kern(x))
                row[f"w{bits}_tbps"] = kern.layout.nbytes() / (t * 1e-6) / 1e12
                row[f"w{bits}_config"] = str(kern.plan_for(m))
                row[f"w{bits}_speedup"] = row["fp16_us"] / t
            rows.append(row)
            print(("  " + json.dumps(row)) if args.json else _line(row), flush=True)
        del peers, ours, cuda, weights
        torch.cuda.empty_cache()
    print()
    print(_table(rows), flush=True)
    return run_sweeps(args, [])


def run_sweeps(args, extra: list) -> int:
    if args.gemv_sweep:
        run_gemv_sweep(args, time_us, random_gptq)
    if args.tile_sweep:
        from bench.kernels_tile import run_tile_sweep

        run_tile_sweep(args, time_us, random_gptq)
    if args.dense_sweep:
        from bench.kernels_dense import run_dense_sweep

        run_dense_sweep(args, time_us, random_gptq)
    if args.sweep:
        run_sweep(args, extra)
    if args.json:
        for r in extra:
            print(json.dumps(r))
    return 0


def _line(r: dict) -> str:
    def us(key: str) -> str:
        return f"{r[key]:7.1f}" if key in r else "    n/a"

    return (f"{r['shape']:>11} m={r['batch']:<5} fp16 {r['fp16_us']:7.1f}  gemv w4 {us('gemv_w4_us')} "
            f"w8 {us('gemv_w8_us')}  triton w4 {us('triton_w4_us')} w8 {us('triton_w8_us')}  "
            f"tile w4 {us('tile_w4_us')} w8 {us('tile_w8_us')}  cuda w4 {us('w4_us')} w8 {us('w8_us')}  "
            f"pick {r['pick_w4']}/{r['pick_w8']}")


def _table(rows: list) -> str:
    cols = [("shape", "shape", "{}"), ("batch", "batch", "{}"), ("fp16 µs", "fp16_us", "{:.1f}"),
            ("GEMV W4 µs", "gemv_w4_us", "{:.1f}"), ("×fp16", "gemv_w4_speedup", "{:.2f}"),
            ("W4 TB/s", "gemv_w4_tbps", "{:.2f}"), ("W4 floor µs", "w4_floor_us", "{:.1f}"),
            ("GEMV W8 µs", "gemv_w8_us", "{:.1f}"), ("×fp16", "gemv_w8_speedup", "{:.2f}"),
            ("W8 TB/s", "gemv_w8_tbps", "{:.2f}"), ("Triton W4 µs", "triton_w4_us", "{:.1f}"),
            ("×fp16", "triton_w4_speedup", "{:.2f}"), ("Triton W8 µs", "triton_w8_us", "{:.1f}"),
            ("×fp16", "triton_w8_speedup", "{:.2f}"), ("Tile W4 µs", "tile_w4_us", "{:.1f}"),
            ("×fp16", "tile_w4_speedup", "{:.2f}"), ("Tile W8 µs", "tile_w8_us", "{:.1f}"),
            ("×fp16", "tile_w8_speedup", "{:.2f}"), ("pick W4/W8", "picks", "{}"),
            ("CUDA W4 µs", "w4_us", "{:.1f}"), ("CUDA W8 µs", "w8_us", "{:.1f}"),
            ("tinygemm µs", "tinygemm_us", "{:.1f}"), ("bnb nf4 µs", "bnb_nf4_us", "{:.1f}"),
            ("bnb int8 µs", "bnb_int8_us", "{:.1f}")]
    lines = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        r = {**r, "picks": f"{r['pick_w4']}/{r['pick_w8']}"}
        lines.append("| " + " | ".join(fmt.format(r[key]) if key in r else "n/a" for _, key, fmt in cols) + " |")
    picked = [r.get(f"{r['pick_w4']}_w4_us", r["triton_w4_us"]) for r in rows]  # gemv, tile, else the Triton path
    if rows:
        w4 = [r["fp16_us"] / b for r, b in zip(rows, picked)]
        lines.append(f"\nW4A16 (the path the registry picks) over fp16: min {min(w4):.2f}x, "
                     f"median {statistics.median(w4):.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
