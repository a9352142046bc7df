"""One launch of each tile-GEMM case worth profiling, for Nsight Compute:

    ncu --clock-control none -k regex:tile_kernel --section SpeedOfLight --section WarpStateStats \\
        python3 -P bench/tile_profile.py        # two launches of each case (read the second)

Cases are shape:batch:rows:splits (4 bits, group 128, fp16); by default the narrow weights at 64 and 256
batch rows, whole and split (kernels/cuda/tile.py).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels import random_gptq  # noqa: E402

from flotilla.kernels.triton_linear import TritonGPTQKernel  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cases", default="4096x4096:64:64:1,4096x4096:256:256:1,4096x4096:256:256:4,"
                                       "14336x4096:256:256:4")
    ap.add_argument("--bits", type=int, default=4)
    args = ap.parse_args(argv)
    kernels = {}
    for case in args.cases.split(","):
        shape, m, rows, splits = case.split(":")
        k, n = (int(v) for v in shape.split("x"))
        if shape not in kernels:
            kernels[shape] = TritonGPTQKernel(random_gptq(k, n, args.bits, 128, True, False, "cuda"), torch.float16)
        kern = kernels[shape]
        if kern.tile is None:
            print(f"{case}: the tile GEMM does not serve here (needs a Hopper GPU and nvcc)")
            return 1
        x = torch.randn(int(m), k, device="cuda", dtype=torch.float16)
        for _ in range(2):
            kern.tile(x, rows=int(rows), splits=int(splits))
        torch.cuda.synchronize()
        print(f"{case}: two launches", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
