"""The CUDA tile GEMM (kernels/cuda/tile.py, Hopper) against the other paths: `python bench/kernels.py --graph
--only-sweeps --tile-sweep`, the evidence for tile.MIN_ROWS, MAX_ROWS and block_rows.

Per weight shape (--shapes), bit width (4, 8) and batch (--tile-rows), g128 symmetric, fp16: µs per call
(CUDA-graph replay when --graph, L2 cleared) of fp16 cuBLAS on the dense weight, the path the registry took
before the tile GEMM (Triton tiles or dequantize + cuBLAS: `choose_config`), and the tile GEMM at each block
height (64, 128, 256 batch rows), each checked against the reference first (a failure is printed with the
largest error's position, and that height is not timed); ×fp16 of each, and the height `block_rows` picks.
One JSON object per case with --json. Without a Hopper GPU (or nvcc) it says so and times nothing.
"""
from __future__ import annotations

import json

import torch

from flotilla.kernels.cuda.tile import BLOCK_ROWS
from flotilla.kernels.reference import dequantize
from flotilla.kernels.triton_linear import TritonGPTQKernel, choose_config, weight_side


def run_tile_sweep(args, time_us, random_gptq) -> None:
    rows_table = []
    for k, n in args.shapes:
        for bits in (4, 8):
            w = random_gptq(k, n, bits, 128, True, False, "cuda")
            kern = TritonGPTQKernel(w, torch.float16)
            if kern.tile is None:
                print(f"tile sweep: the tile GEMM does not serve {k}x{n} at {bits} bits here "
                      f"({torch.cuda.get_device_name(0)}); nothing timed", flush=True)
                return
            w16 = dequantize(w, torch.float16).t().contiguous()  # [out, in]
            for m in args.tile_rows:
                rows_table.append(_case(args, kern, w16, k, n, bits, m, time_us))
            del kern, w16
            torch.cuda.empty_cache()
    print()
    print(_table(rows_table), flush=True)


def _case(args, kern, w16, k: int, n: int, bits: int, m: int, time_us) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    bias = torch.randn(n, device="cuda", dtype=torch.float16)
    ref = x.float() @ w16.float().t() + bias.float()
    before = weight_side(choose_config(m, kern.layout, kern.num_sms), kern.layout)
    row = {"shape": f"{k}x{n}", "bits": bits, "m": m, "before": before.kind, "pick": kern.tile.rows_for(m),
           "fp16_us": time_us(lambda: torch.nn.functional.linear(x, w16)),
           "before_us": time_us(lambda: kern(x, config=before))}
    for rows in BLOCK_ROWS:
        torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)  # poison the allocator
        y = kern.tile(x, bias, rows=rows).float()
        err = ((y - ref).norm() / ref.norm()).item()
        if not err < 2e-3 or not bool(torch.isfinite(y).all()):
            bad = (y - ref).abs().nan_to_num(float("inf")).flatten().argmax().item()
            print(f"FAIL tile {k}x{n} w{bits} m={m} rows={rows}: rel err {err:.2e}; worst at "
                  f"(row {bad // n}, col {bad % n}): {y.flatten()[bad].item():.4g} vs {ref.flatten()[bad].item():.4g}",
                  flush=True)
            continue
        row[f"tile{rows}_us"] = time_us(lambda: kern.tile(x, rows=rows))  # noqa: B023 - called at once
    timed = [(row[f"tile{r}_us"], r) for r in BLOCK_ROWS if f"tile{r}_us" in row]
    row["best_rows"] = min(timed)[1] if timed else 0
    parts = "  ".join(f"tile{r} {row[f'tile{r}_us']:.1f} ({row['fp16_us'] / row[f'tile{r}_us']:.2f}x)"
                      for r in BLOCK_ROWS if f"tile{r}_us" in row)
    print(f"tile sweep {k}x{n} w{bits} m={m}: fp16 {row['fp16_us']:.1f}us, {before.kind} {row['before_us']:.1f} "
          f"({row['fp16_us'] / row['before_us']:.2f}x)  {parts}  (block_rows picks {row['pick']})", flush=True)
    if args.json:
        print(json.dumps({"tile_sweep": row}), flush=True)
    return row


def _table(rows: list) -> str:
    head = ["shape", "bits", "batch", "fp16 µs", "before", "before µs", "×fp16",
            *[f"tile {r} µs" for r in BLOCK_ROWS], "best ×fp16", "picked rows", "picked ×fp16"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        tiles = [f"{r[f'tile{h}_us']:.1f}" if f"tile{h}_us" in r else "fail" for h in BLOCK_ROWS]
        best_key, pick_key = f"tile{r['best_rows']}_us", f"tile{r['pick']}_us"
        best = f"{r['fp16_us'] / r[best_key]:.2f}" if r["best_rows"] else "n/a"
        picked = f"{r['fp16_us'] / r[pick_key]:.2f}" if pick_key in r else "n/a"
        lines.append("| " + " | ".join([r["shape"], str(r["bits"]), str(r["m"]), f"{r['fp16_us']:.1f}", r["before"],
                                        f"{r['before_us']:.1f}", f"{r['fp16_us'] / r['before_us']:.2f}", *tiles,
                                        best, str(r["pick"]), picked]) + " |")
    return "\n".join(lines)
