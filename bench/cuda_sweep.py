"""Sweep the CUDA dequant-matmul's plans (tile config x k-splits x rows per block, and the dense
path) per weight shape and batch, against the plan `choose_plan` picks, fp16 cuBLAS and the
Triton kernel. What bench/NOTES-kernels.md's crossovers and split rules come from.

    python bench/cuda_sweep.py --shapes 4096x4096,8192x28672 --batches 1,16,64,256 --bits 4,8
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels import random_gptq, time_us  # noqa: E402
import kernels as kbench  # noqa: E402

from flotilla.kernels.cuda.kernel import CONFIGS, CudaGPTQKernel, Plan, TILE_K, TILE_N  # noqa: E402
from flotilla.kernels.triton_linear import TritonGPTQKernel  # noqa: E402


def candidates(kern: CudaGPTQKernel, m: int) -> list[Plan]:
    lay = kern.layout
    out = [Plan("dense")] if m >= 64 else []
    mb_needed = min(4, -(-m // 16))
    for mb, cfg in CONFIGS:
        if mb != mb_needed and not (mb == 4 and m > 64):
            continue
        base = -(-m // (16 * mb)) * (lay.n_pad // TILE_N[cfg])
        slots = kern.occupancy(mb, cfg) * kern.num_sms
        kt = lay.k_pad // TILE_K[cfg]
        for s in (1, 2, 3, 4, 6, 8, 12, 16):
            if s <= kt and base * s <= slots or s == 1:
                out.append(Plan("fused", mb, cfg, s))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="4096x4096,4096x14336,14336x4096,8192x28672")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--bits", default="4,8")
    args = ap.parse_args(argv)
    kbench.GRAPHS = True
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    for k, n in shapes:
        w16 = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
        for bits in [int(b) for b in args.bits.split(",")]:
            w = random_gptq(k, n, bits, 128, True, False, "cuda")
            kern = CudaGPTQKernel(w, torch.float16)
            tri = TritonGPTQKernel(w, torch.float16)
            nbytes = kern.layout.nbytes()
            occ = {f"{mb}/{cfg}": kern.occupancy(mb, cfg) for mb, cfg in CONFIGS}
            print(f"== {k}x{n} w{bits}: {nbytes / 1e6:.1f} MB, occupancy {occ}", flush=True)
            for m in batches:
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                t16 = time_us(lambda: torch.nn.functional.linear(x, w16), warmup=5, rep=30)
                tt = time_us(lambda: tri(x), warmup=5, rep=30)
                chosen = kern.plan_for(m)
                tc = time_us(lambda: kern(x), warmup=5, rep=30)
                print(f"  m={m:<5} fp16 {t16:7.1f}  triton {tt:7.1f}  chosen {chosen}: {tc:7.1f} us "
                      f"({t16 / tc:.2f}x fp16, {nbytes / tc / 1e6:.2f} TB/s)", flush=True)
                timed = []
                for plan in candidates(kern, m):
                    try:
                        timed.append((time_us(lambda: kern(x, plan=plan), warmup=5, rep=20), plan))
                    except Exception as e:  # noqa: BLE001 - report and go on
                        print(f"    {plan}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                timed.sort(key=lambda p: p[0])
                for t, plan in timed[:5]:
                    print(f"    {t:7.1f} us {t16 / t:5.2f}x  mb={plan.mb} cfg={plan.cfg} splits={plan.splits} {plan.kind}",
                          flush=True)
            del kern, tri, w
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
