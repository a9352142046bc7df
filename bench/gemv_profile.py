"""The GEMV's plans at one shape, for Nsight Compute and for the clocks under load:

    ncu --clock-control none -k regex:gemv --section SpeedOfLight --section WarpStateStats \\
        python3 -P bench/gemv_profile.py          # two launches of each plan (read the second)
    python3 -P bench/gemv_profile.py --spin 3     # each plan back to back for 3 s (sample nvidia-smi)

Shape 8192x28672 (llama-3-70b's up/gate) at batch 1, 4 bits group 128, by default: the
tensor-core plan and the CUDA-core plan (kernels/cuda/gemv.py).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernels import random_gptq
from flotilla.kernels.cuda.gemv import GemvPlan, choose_plan
from flotilla.kernels.triton_linear import TritonGPTQKernel


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8192x28672")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--spin", type=float, default=0.0, help="seconds of back-to-back launches a plan")
    args = ap.parse_args(argv)
    k, n = (int(v) for v in args.shape.split("x"))
    kern = TritonGPTQKernel(random_gptq(k, n, args.bits, 128, True, False, "cuda"), torch.float16)
    x = torch.randn(args.m, k, device="cuda", dtype=torch.float16)
    lay = kern.layout
    plans = {"mma": kern.gemv.plan_for(args.m),
             "cores": choose_plan(args.m, n, lay.words.shape[1], kern.num_sms, lay.bits)}
    for name, plan in plans.items():
        assert isinstance(plan, GemvPlan)
        for _ in range(2):
            kern.gemv(x, plan=plan)
        torch.cuda.synchronize()
        if args.spin:
            calls, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < args.spin:
                for _ in range(200):
                    kern.gemv(x, plan=plan)
                torch.cuda.synchronize()
                calls += 200
            us = (time.perf_counter() - t0) / calls * 1e6
            print(f"{name} {plan}: {us:.1f} us a call back to back ({lay.nbytes() / (us * 1e-6) / 1e12:.2f} TB/s)",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
