"""The GEMV's L2 prefetch (GemvPlan.prefetch) on the GPU: µs a call of the tensor-core plans with the L2
asked for each warp's weights 0 (off), 2, 4 or 8 of its blocks ahead, next to the Triton path and the read
floor, on the llama-3-8b shapes at 1-16 rows (W4 g128, fp16).

    python3 -P bench/gemv_prefetch.py [--shapes 4096x6144,...] [--rows 1,4,8,16] [--ahead 0,2,4,8] [--json]

Two timings a case (bench/kernels_gemv.py): one call with the L2 cleared (CUDA-graph replays), and the
chain: 64 calls back to back in one graph over weight copies larger than the L2, as a decode step runs them.
"Plan" is the registry's own plan at that M (the M <= 8 tensor-core plan, or the wide plan at 9-16 rows)
and, on the columns of at least 32 blocks, the register double buffer beside the ring. Every variant's
output is checked bit for bit against the plan without prefetch first (a FAIL line names one that is not).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from bench.kernels import random_gptq, time_us
from bench.kernels_gemv import CHAIN_CALLS, _copies, chain_time_us, floor_chain_us, label, triton_config
from flotilla.kernels.triton_linear import TritonGPTQKernel

SHAPES = "4096x6144,4096x4096,4096x28672,14336x4096,8192x28672"


def plans_of(kern, m: int):
    """The registry's plan at M, and the register double buffer where it picks the ring."""
    plan = kern.gemv.plan_for(m)
    out = [plan]
    if plan.stages:
        out.append(dataclasses.replace(plan, stages=0))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--ahead", default="0,2,4,8", help="prefetch distances, blocks of a warp (0: off)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemv_prefetch: no CUDA GPU", file=sys.stderr)
        return 2
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    aheads = [int(a) for a in args.ahead.split(",")]
    print(f"# {torch.cuda.get_device_name(0)}; µs a call: L2 cleared / chain of {CHAIN_CALLS} (TB/s of the "
          f"layout's bytes in the chain)")
    print("| shape | M | plan | Triton | " + " | ".join(f"ahead {a}" for a in aheads) + " | floor (chain) |")
    print("|---|---|---|---|" + "---|" * len(aheads) + "---|")
    failures = 0
    for k, n in shapes:
        kern = TritonGPTQKernel(random_gptq(k, n, 4, 128, True, False, "cuda"), torch.float16)
        if kern.gemv is None or not kern.gemv.geo.mma:
            print(f"{k}x{n}: no tensor-core GEMV here", flush=True)
            continue
        copies = _copies(kern)
        seq = [copies[i % len(copies)] for i in range(CHAIN_CALLS)]
        nbytes = kern.layout.nbytes()
        floor = floor_chain_us(kern, seq)
        for m in rows:
            if m > kern.gemv.most_rows:
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            t_tri = (time_us(lambda: kern(x, config=triton_config(kern, m))),
                     chain_time_us([(lambda kc=kc: kc(x, config=triton_config(kc, m))) for kc in seq]))
            for plan in plans_of(kern, m):
                base = kern.gemv(x, plan=plan)
                cells, row = [], {}
                for a in aheads:
                    pa = dataclasses.replace(plan, prefetch=a)
                    if not torch.equal(kern.gemv(x, plan=pa), base):
                        print(f"FAIL {k}x{n} m={m} {pa}: output differs from prefetch 0", flush=True)
                        failures += 1
                    one = time_us(lambda pa=pa: kern.gemv(x, plan=pa))
                    chain = chain_time_us([(lambda kc=kc, pa=pa: kc.gemv(x, plan=pa)) for kc in seq])
                    row[a] = (one, chain)
                    cells.append(f"{one:.1f} / {chain:.1f} ({nbytes / (chain * 1e-6) / 1e12:.2f})")
                print(f"| {k}x{n} | {m} | {label(plan)} | {t_tri[0]:.1f} / {t_tri[1]:.1f} | " + " | ".join(cells)
                      + f" | {floor:.1f} |", flush=True)
                if args.json:
                    print(json.dumps({"shape": f"{k}x{n}", "m": m, "plan": label(plan), "triton_us": t_tri,
                                      "floor_chain_us": floor, "ahead_us": row}), flush=True)
        del copies, seq
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
