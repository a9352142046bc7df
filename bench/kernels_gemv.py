"""The CUDA GEMV's plans on the GPU (`python bench/kernels.py --gemv-sweep`): the evidence for
kernels/cuda/gemv.py's choose_plan and its crossovers (MMA_MAX_ROWS, CORES_MAX_ROWS).

Per weight shape, bit width (--gemv-bits) and batch M (1, 2, 4, 8; --gemv-rows): µs per call (CUDA-graph replay when --graph,
L2 cleared) of every GEMV plan (the tensor-core plan "mma", "mma8w4s": 8 warps, a
cp.async ring of 4 blocks a warp, "mma8w": the register double buffer; CUDA-core plans with the rows tile = M
rounded up and 2 or 4 columns a block; warps a block 1, 2, 4, 8) next to the built-in plan and the
Triton "dot" path, in fp16; then, at the built-in plans, the same against Triton in bf16 (CUDA-core
plans: the crossover M per bits and dtype). Every plan's result is checked
against the reference (fp32 matmul of the dequantized weight) before it is timed; a FAIL line
names a plan that is off. One JSON object per case with --json.
"""
from __future__ import annotations

import json

import torch

import dataclasses

from flotilla.kernels.cuda.gemv import MMA_COLS
from flotilla.kernels.reference import dequantize
from flotilla.kernels.triton_linear import TritonGPTQKernel, choose_config, weight_side

SWEEP_ROWS = (1, 2, 4, 8)
WARPS = (1, 2, 4, 8)


def triton_config(kern: TritonGPTQKernel, m: int):
    """The Triton path the registry would take without the GEMV."""
    return weight_side(choose_config(m, kern.layout, kern.num_sms), kern.layout)


def label(plan) -> str:
    if plan.cols == MMA_COLS:  # the tensor-core plan: "mma8w" its register double buffer, "mma8w4s" a ring of 4
        return f"mma{plan.warps}w" + (f"{plan.stages}s" if plan.stages else "")
    return f"{plan.cols}c{plan.warps}w"


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
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                ref = x.float() @ w32
                timed = []
                for shape in kern.gemv.plans():
                    if shape.cols != MMA_COLS and shape.rows != next(r for r in SWEEP_ROWS if r >= m):
                        continue
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
                mma = [f"{t:.1f} {label(p)}" for t, p in timed if p.cols == MMA_COLS]
                print(f"gemv sweep {k}x{n} w{bits} m={m}: built-in {label(built_in)} {t_built:.1f}us "
                      f"({nbytes / (t_built * 1e-6) / 1e12:.2f} TB/s), triton {t_triton:.1f}us; best {best}; mma {mma}",
                      flush=True)
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
            for m in rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                t_gemv = time_us(lambda: kern.gemv(x))
                t_triton = time_us(lambda: kern(x, config=triton_config(kern, m)))
                print(f"gemv bf16 {k}x{n} w{bits} m={m}: gemv {t_gemv:.1f}us triton {t_triton:.1f}us", flush=True)
                if args.json:
                    print(json.dumps({"gemv_bf16": f"{k}x{n}", "bits": bits, "m": m, "gemv_us": t_gemv,
                                      "triton_us": t_triton}), flush=True)
