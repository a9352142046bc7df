"""Large batches: the Triton tile kernel against dequantize + cuBLAS (`python bench/kernels.py --dense-sweep`),
the evidence for triton_linear.dense_min_rows.

Per weight shape (--shapes) and batch (--dense-rows), W4 g128 symmetric, fp16: µs per call (CUDA-graph
replay when --graph, L2 cleared) of fp16 cuBLAS on the dense weight, the Triton kernel's tile config
(`dot_config`), the dense path (the dequantize kernel into a scratch W^T, then cuBLAS), the dequantize
alone, and the overlapped dense path (`dense_chunked`) at the rule's chunk (`dense_chunk`) and at 1024 -
8192 out-features a chunk, each checked against the reference first; ×fp16 of each. One JSON object per
case with --json.
"""
from __future__ import annotations

import json

import torch

from flotilla.kernels.reference import dequantize
from flotilla.kernels.triton_linear import (
    GemmConfig,
    TritonGPTQKernel,
    dense_chunk,
    dequantize_layout,
    dot_config,
    weight_side,
)


def run_dense_sweep(args, time_us, random_gptq) -> None:
    for k, n in args.shapes:
        _dense_shape(args, k, n, time_us, random_gptq)
        torch.cuda.empty_cache()


def _dense_shape(args, k: int, n: int, time_us, random_gptq) -> None:
    w = random_gptq(k, n, 4, 128, True, False, "cuda")
    kern = TritonGPTQKernel(w, torch.float16)
    w16 = dequantize(w, torch.float16).t().contiguous()  # [out, in]
    for m in args.dense_rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        ref = x.float() @ w16.float().t()
        dot = weight_side(dot_config(m, kern.layout, kern.num_sms), kern.layout)
        dense = GemmConfig("dense")
        for name, cfg in (("dot", dot), ("dense", dense)):
            err = ((kern(x, config=cfg).float() - ref).norm() / ref.norm()).item()
            if not err < 2e-3:
                print(f"FAIL dense sweep {k}x{n} m={m} {name}: rel err {err:.2e}", flush=True)
        row = {"shape": f"{k}x{n}", "m": m,
               "fp16_us": time_us(lambda: torch.nn.functional.linear(x, w16)),  # noqa: B023 - called at once
               "dot_us": time_us(lambda: kern(x, config=dot)),  # noqa: B023
               "dense_us": time_us(lambda: kern(x, config=dense)),  # noqa: B023
               "dequant_us": time_us(lambda: dequantize_layout(kern.layout, torch.float16))}
        print(f"dense sweep {k}x{n} m={m}: fp16 {row['fp16_us']:.1f}us, dot {row['dot_us']:.1f} "
              f"({row['fp16_us'] / row['dot_us']:.2f}x), dense {row['dense_us']:.1f} "
              f"({row['fp16_us'] / row['dense_us']:.2f}x; dequant {row['dequant_us']:.1f})", flush=True)
        rule = dense_chunk(m, n)
        for chunk in sorted({rule, *(c for c in (1024, 2048, 4096, 8192) if 2 * c <= n)} - {0}):
            cfg = GemmConfig("dense", chunk=chunk)
            err = ((kern(x, config=cfg).float() - ref).norm() / ref.norm()).item()
            if not err < 2e-3:
                print(f"FAIL dense sweep {k}x{n} m={m} chunk {chunk}: rel err {err:.2e}", flush=True)
                continue
            us = time_us(lambda: kern(x, config=cfg))  # noqa: B023
            row[f"chunk{chunk}_us"] = us
            print(f"  chunks of {chunk}{' (rule)' if chunk == rule else ''}: {us:.1f}us "
                  f"({row['fp16_us'] / us:.2f}x fp16)", flush=True)
        if args.json:
            print(json.dumps({"dense_sweep": row}), flush=True)
