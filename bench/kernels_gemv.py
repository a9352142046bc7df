"""The CUDA GEMV's plans on the GPU (`python bench/kernels.py --gemv-sweep`): the evidence for
kernels/cuda/gemv.py's choose_plan and its crossovers (MMA_MAX_ROWS, CORES_MAX_ROWS).

Per weight shape, bit width (--gemv-bits) and batch M (1, 2, 4, 8, 12, 16; --gemv-rows): µs per call (CUDA-graph replay when
--graph, L2 cleared) of every GEMV plan (the tensor-core plan "mma", "mma8w4s": 8 warps, a
cp.async ring of 4 blocks a warp, "mma8w": the register double buffer; past 8 rows the wide tensor-core plan,
"wide16c8w": 16 columns a block, 8 warps; CUDA-core plans with the rows tile = M
rounded up and 2 or 4 columns a block; warps a block 1, 2, 4, 8) next to the built-in plan and the
Triton "dot" path, in fp16; then, at the built-in plans, the same against Triton in bf16 (CUDA-core
plans: the crossover M per bits and dtype). Every plan's result is checked
against the reference (fp32 matmul of the dequantized weight) before it is timed; a FAIL line
names a plan that is off. One JSON object per case with --json.

With --gemv-chain, the best plans of each case (and Triton, and a plain read of the same bytes: the
floor no GEMV beats) are timed again as a decode step runs them: one CUDA graph of CHAIN_CALLS
calls back to back, rotating over copies of the weight that together exceed the L2 (no L2 clearing,
so no dirty lines to write back; launch gaps of a graph included).
"""
from __future__ import annotations

import dataclasses
import json

import torch

from flotilla.kernels.cuda.gemv import MMA_COLS, ROW_TILES, WIDE_ROWS
from flotilla.kernels.reference import dequantize
from flotilla.kernels.triton_linear import (
    TritonGPTQKernel,
    TritonLayoutKernel,
    choose_config,
    weight_side,
)

SWEEP_ROWS = (1, 2, 4, 8, 12, 16)
WARPS = (1, 2, 4, 8)
CHAIN_CALLS = 64
CHAIN_BYTES = 160e6  # the weight copies of a chain together: > 3x the H200's 50 MB L2
CHAIN_TOP = 6  # plans of a case re-timed in the chain


def triton_config(kern: TritonGPTQKernel, m: int):
    """The Triton path the registry would take without the GEMV."""
    return weight_side(choose_config(m, kern.layout, kern.num_sms), kern.layout)


def label(plan) -> str:
    if plan.rows == WIDE_ROWS:  # the wide tensor-core plan
        return f"wide{plan.cols}c{plan.warps}w"
    if plan.cols == MMA_COLS:  # the tensor-core plan: "mma8w" its register double buffer, "mma8w4s" a ring of 4
        return f"mma{plan.warps}w" + (f"{plan.stages}s" if plan.stages else "")
    return f"{plan.cols}c{plan.warps}w" + ("t" if plan.stages else "")  # "2c1wt": the tables a strip ahead


def run_gemv_sweep(args, time_us, random_gptq) -> None:
    rows = [m for m in SWEEP_ROWS if m in args.gemv_rows]
    for k, n in args.shapes:
        for bits in args.gemv_bits:
            w = random_gptq(k, n, bits, 128, True, False, "cuda")
            kern = TritonGPTQKernel(w, torch.float16)
            if kern.gemv is None:
                print(f"gemv sweep {k}x{n} w{bits}: no GEMV (see the log)", flush=True)
                continue
            nbytes = kern.layout.nbytes()
            w32 = dequantize(w, torch.float32)
            for m in rows:
                if m > kern.gemv.most_rows:
                    continue
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                ref = x.float() @ w32
                timed = []
                for shape in kern.gemv.plans():
                    if shape.rows != WIDE_ROWS and m > ROW_TILES[-1]:
                        continue  # past 8 rows the wide plan only (it runs any M <= 16)
                    if shape.rows != WIDE_ROWS and shape.cols != MMA_COLS \
                            and shape.rows != next(r for r in SWEEP_ROWS if r >= m):
                        continue
                    if kern.gemv.geo.mma and not args.gemv_all and shape.rows != WIDE_ROWS \
                            and (shape.cols != MMA_COLS or shape.stages not in (0, 2)):
                        continue  # plans that lost in every earlier run (NOTES-kernels.md: CUDA cores, rings > 2)
                    for warps in WARPS:
                        plan = dataclasses.replace(shape, warps=warps)
                        torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)  # poison
                        err = ((kern.gemv(x, plan=plan).float() - ref).norm() / ref.norm()).item()
                        if not err < 2e-3:
                            print(f"FAIL gemv {k}x{n} w{bits} m={m} {plan}: rel err {err:.2e}", flush=True)
                        timed.append((time_us(lambda: kern.gemv(x, plan=plan), warmup=5, rep=20), plan))
                timed.sort(key=lambda p: p[0])
                built_in = kern.gemv.plan_for(m)
                t_built = time_us(lambda: kern.gemv(x))
                t_triton = time_us(lambda: kern(x, config=triton_config(kern, m)))
                best = ", ".join(f"{t:.1f} {label(p)}" for t, p in timed[:4])
                mma = [f"{t:.1f} {label(p)}" for t, p in timed if p.cols == MMA_COLS or p.rows == WIDE_ROWS]
                print(f"gemv sweep {k}x{n} w{bits} m={m}: built-in {label(built_in)} {t_built:.1f}us "
                      f"({nbytes / (t_built * 1e-6) / 1e12:.2f} TB/s), triton {t_triton:.1f}us; best {best}; mma {mma}",
                      flush=True)
                if args.gemv_chain:
                    chain_case(kern, x, [p for _, p in timed[:CHAIN_TOP]] + [built_in], m, args.json)
                if args.json:
                    print(json.dumps({"gemv_sweep": f"{k}x{n}", "bits": bits, "m": m, "built_in_us": t_built,
                                      "built_in": built_in.__dict__, "triton_us": t_triton,
                                      "plans": [[t, p.__dict__] for t, p in timed]}), flush=True)
            del w32
    for k, n in args.shapes[:2]:
        for bits in args.gemv_bits:
            kern = TritonGPTQKernel(random_gptq(k, n, bits, 128, True, False, "cuda"), torch.bfloat16)
            if kern.gemv is None:
                continue
            for m in [r for r in rows if r <= kern.gemv.most_rows]:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                t_gemv = time_us(lambda: kern.gemv(x))
                t_triton = time_us(lambda: kern(x, config=triton_config(kern, m)))
                print(f"gemv bf16 {k}x{n} w{bits} m={m}: gemv {t_gemv:.1f}us triton {t_triton:.1f}us", flush=True)
                if args.json:
                    print(json.dumps({"gemv_bf16": f"{k}x{n}", "bits": bits, "m": m, "gemv_us": t_gemv,
                                      "triton_us": t_triton}), flush=True)


def _copies(kern: TritonGPTQKernel) -> list[TritonLayoutKernel]:
    """The kernel and kernels over copies of its weight (fresh tensors, same values) that together
    exceed the L2."""
    lay = kern.layout
    count = max(2, min(16, -(-int(CHAIN_BYTES) // lay.nbytes())))
    def copy(t):
        return None if t is None else t.clone()

    return [kern] + [TritonLayoutKernel(dataclasses.replace(lay, words=lay.words.clone(), scales=lay.scales.clone(),
                                                            zeros=copy(lay.zeros), offsets=copy(lay.offsets)),
                                        kern.dtype) for _ in range(count - 1)]


def chain_time_us(calls) -> float:
    """µs a call of the list `calls` (each a no-argument callable) captured back to back in one CUDA
    graph and replayed: median of 10 replays after 3."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1000 / len(calls))
    return sorted(times)[len(times) // 2]


def chain_case(kern: TritonGPTQKernel, x: torch.Tensor, plans, m: int, as_json: bool) -> None:
    """The chain timings of one case: the read floor, Triton, each plan (bench docstring)."""
    import ctypes

    kerns = _copies(kern)
    seq = [kerns[i % len(kerns)] for i in range(CHAIN_CALLS)]
    lib, out = kern.gemv.lib.cdll, torch.zeros(1, dtype=torch.int32, device="cuda")
    lib.flotilla_gemv_read_floor.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_int,
                                             ctypes.c_void_p]
    sms = kern.num_sms

    def floor_call(kc):
        words = kc.layout.words
        return lambda: lib.flotilla_gemv_read_floor(words.data_ptr(), words.numel() * 4, out.data_ptr(),
                                                    4 * sms, torch.cuda.current_stream().cuda_stream)

    row = {"floor": chain_time_us([floor_call(kc) for kc in seq]),
           "triton": chain_time_us([(lambda kc=kc: kc(x, config=triton_config(kc, m))) for kc in seq])}
    for plan in dict.fromkeys(plans):
        row[label(plan)] = chain_time_us([(lambda kc=kc, plan=plan: kc.gemv(x, plan=plan)) for kc in seq])
    nbytes = kern.layout.nbytes()
    text = ", ".join(f"{k} {v:.1f} ({nbytes / (v * 1e-6) / 1e12:.2f})" for k, v in row.items())
    print(f"  chain {kern.layout.in_features}x{kern.layout.out_features} m={m} ({len(kerns)} copies), "
          f"us (TB/s): {text}", flush=True)
    if as_json:
        print(json.dumps({"gemv_chain": f"{kern.layout.in_features}x{kern.layout.out_features}", "m": m,
                          "copies": len(kerns), "us": row}), flush=True)
    del kerns
