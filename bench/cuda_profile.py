"""One launch of each CUDA dequant-matmul plan worth profiling, for Nsight Compute:

    ncu --clock-control none -k regex:wqa16 --section WarpStateStats ... python bench/cuda_profile.py

Shape 8192x28672 (llama-3-70b's up/gate) at batch 1 by default; each launch is preceded by an
untimed warm-up launch of the same plan (ncu profiles both; read the second).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels import random_gptq  # noqa: E402

from flotilla.kernels.cuda.kernel import CudaGPTQKernel, Plan  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="8192x28672")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--plans", default="4:0:1,4:1:2,8:0:1", help="bits:cfg:splits, comma-separated (mb 1)")
    args = ap.parse_args(argv)
    k, n = (int(v) for v in args.shape.split("x"))
    kernels = {}
    for spec in args.plans.split(","):
        bits, cfg, splits = (int(v) for v in spec.split(":"))
        if bits not in kernels:
            kernels[bits] = CudaGPTQKernel(random_gptq(k, n, bits, 128, True, False, "cuda"), torch.float16)
        x = torch.randn(args.m, k, device="cuda", dtype=torch.float16)
        plan = Plan("fused", 1, cfg, splits)
        for _ in range(2):
            kernels[bits](x, plan=plan)
        torch.cuda.synchronize()
        print(f"profiled w{bits} {plan}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
