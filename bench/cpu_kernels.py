"""Microseconds per call of CPU linear kernels on SmolLM2-135M's shapes, all in the same run.

    python3 bench/cpu_kernels.py                  # table
    python3 bench/cpu_kernels.py --json           # one JSON object per row
    python3 bench/cpu_kernels.py --shapes 576x1536 --m 1,8

Per shape (in x out) and batch M:
    dense       fp32 F.linear (MKL), what the "dense" kernel runs
    ours_w4/w8  flotilla's CPU kernels on a GPTQ weight (group 64, symmetric)
    ours_i8b    flotilla's exact int8 x block-32 scale form (what a Q8_0 lm_head becomes)
    ours_f16    flotilla's fp16-weight form
    ours_f32    flotilla's fp32-weight form (plain_linear: batch-invariant, unlike MKL)
    torch_int4  torch._weight_int4pack_mm_for_cpu (group 64)
    torch_int8  torch._weight_int8pack_mm (per-channel)
GB/s is the weight bytes read per call over the time (the bound for decode, M = 1).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flotilla.kernels.cpu import build, cpu_gptq_kernel, half_linear, plain_linear  # noqa: E402
from flotilla.kernels.cpu.compact import INT8_BLOCK  # noqa: E402
from flotilla.kernels.cpu.packing import pack_int8_blocks  # noqa: E402
from flotilla.kernels.gptq import GPTQWeight, default_g_idx, num_groups  # noqa: E402

SMOLLM2_SHAPES = ("576x576", "576x192", "576x1536", "1536x576", "576x49152")
KERNELS = ("dense", "ours_w4", "ours_w8", "ours_i8b", "ours_f16", "ours_f32", "torch_int4", "torch_int8")
GROUP = 64  # divides 576 and 1536 (128 does not: SmolLM2 cannot use group 128)


def random_gptq(k: int, n: int, bits: int, group_size: int = GROUP) -> GPTQWeight:
    groups = num_groups(k, group_size)
    q = torch.randint(0, 1 << bits, (k, n), dtype=torch.int32)
    zeros = torch.full((groups, n), 1 << (bits - 1), dtype=torch.int32)
    scales = (torch.rand(groups, n) * 0.01 + 0.001).half()
    return GPTQWeight.from_codes(q, zeros, scales, default_g_idx(k, group_size), bits, group_size)


def build_kernels(k: int, n: int) -> dict[str, tuple[callable, int]]:
    """name -> (f(x), weight bytes read per call)."""
    out = {}
    dense = torch.randn(n, k) * 0.02
    out["dense"] = (lambda x: F.linear(x, dense), dense.nbytes)
    for bits in (4, 8):
        w = random_gptq(k, n, bits)
        op = cpu_gptq_kernel(w)
        out[f"ours_w{bits}"] = (op, op.nbytes)
    i8b = pack_int8_blocks(torch.randint(-127, 128, (n, k), dtype=torch.int8),
                           torch.rand(n, -(-k // INT8_BLOCK)) * 0.01, INT8_BLOCK).build(build.load())
    out["ours_i8b"] = (i8b, i8b.nbytes)
    f16 = half_linear(dense.half().float())
    out["ours_f16"] = (f16, f16.nbytes)
    f32 = plain_linear(dense)
    out["ours_f32"] = (f32, f32.nbytes)
    q4 = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed4 = torch._convert_weight_to_int4pack_for_cpu(q4, 2)
    sz = torch.rand(k // GROUP, n, 2) * 0.01
    out["torch_int4"] = (lambda x: torch._weight_int4pack_mm_for_cpu(x, packed4, GROUP, sz), packed4.nbytes + sz.nbytes)
    q8i = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s8 = torch.rand(n) * 0.01
    out["torch_int8"] = (lambda x: torch._weight_int8pack_mm(x, q8i, s8), q8i.nbytes + s8.nbytes)
    return out


def time_us(f, x, budget_s: float, repeats: int = 5) -> float:
    """Best mean over `repeats` rounds, each about budget_s / repeats long."""
    f(x)
    t0 = time.perf_counter()
    f(x)
    once = max(time.perf_counter() - t0, 1e-7)
    n = max(1, int(budget_s / repeats / once))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            f(x)
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SMOLLM2_SHAPES), help="comma-separated INxOUT")
    ap.add_argument("--m", default="1,8,32,256", help="comma-separated batch sizes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", type=float, default=0.3, help="seconds of timing per kernel and row")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = [k for k in args.kernels.split(",") if k]
    unknown = set(names) - set(KERNELS)
    if unknown:
        ap.error(f"unknown kernels {sorted(unknown)}; valid: {', '.join(KERNELS)}")
    ms = [int(m) for m in args.m.split(",")]
    if not args.json:
        head = f"{'shape':>10} {'M':>4} " + " ".join(f"{n:>11}" for n in names) + "   w4 vs dense  (µs/call; GB/s at M=1)"
        print(head)
    torch.manual_seed(0)
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            k, n = (int(v) for v in shape.lower().split("x"))
            kernels = build_kernels(k, n)
            for m in ms:
                x = torch.randn(m, k)
                row = {"shape": shape, "in": k, "out": n, "m": m, "threads": args.threads}
                for name in names:
                    f, nbytes = kernels[name]
                    us = time_us(f, x, args.budget)
                    row[f"{name}_us"] = round(us, 2)
                    row[f"{name}_gbps"] = round(nbytes / us / 1e3, 2)
                if "dense" in names and "ours_w4" in names:
                    row["w4_speedup_vs_dense"] = round(row["dense_us"] / row["ours_w4_us"], 2)
                if args.json:
                    print(json.dumps(row), flush=True)
                else:
                    cells = []
                    for name in names:
                        cell = f"{row[f'{name}_us']:.1f}"
                        if m == 1:
                            cell += f" ({row[f'{name}_gbps']:.0f})"
                        cells.append(f"{cell:>11}")
                    ratio = f"{row['w4_speedup_vs_dense']:>8.2f}x" if "w4_speedup_vs_dense" in row else ""
                    print(f"{shape:>10} {m:>4} " + " ".join(cells) + ratio, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
