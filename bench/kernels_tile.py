"""The CUDA tile GEMM (kernels/cuda/tile.py, Hopper) against the other paths: `python bench/kernels.py --graph
--only-sweeps --tile-sweep`, the evidence for tile.MIN_ROWS, MAX_ROWS and block_rows.

Per weight shape (--shapes), bit width (4, 8) and batch (--tile-rows), g128 symmetric, fp16: µs per call
(CUDA-graph replay when --graph, L2 cleared) of fp16 cuBLAS on the dense weight, the path the registry took
before the tile GEMM (Triton tiles or dequantize + cuBLAS: `choose_config`), and the tile GEMM at each block
height (64, 128, 256 batch rows, or --tile-heights) and split-K count (1, and those whose grid stays within two waves), each
checked against the reference first (a failure is printed with the largest error's position, and that case is
not timed); ×fp16 of each, the best, and the plan `rows_for` (`plan_rows`) / `split_k` picks.
One JSON object per case with --json. Without a Hopper GPU (or nvcc) it says so and times nothing.
"""
from __future__ import annotations

import json

import torch

from flotilla.kernels.cuda.tile import BLOCK_COLS, BLOCK_ROWS, TWO_A_SM
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


def split_counts(m: int, n: int, rows: int, k_blocks: int, num_sms: int) -> list[int]:
    """The split-K counts the sweep times at one block height: 1, and those whose grid stays within two waves."""
    tiles = -(-m // rows) * -(-n // BLOCK_COLS)
    slots = num_sms * (2 if rows <= TWO_A_SM else 1)
    return [1] + [s for s in (2, 3, 4, 6, 8) if s <= k_blocks and tiles * s <= 2 * slots]


def _case(args, kern, w16, k: int, n: int, bits: int, m: int, time_us) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    bias = torch.randn(n, device="cuda", dtype=torch.float16)
    ref = x.float() @ w16.float().t() + bias.float()
    before = weight_side(choose_config(m, kern.layout, kern.num_sms), kern.layout)
    pick_rows = kern.tile.rows_for(m)
    row = {"shape": f"{k}x{n}", "bits": bits, "m": m, "before": before.kind, "pick": pick_rows,
           "pick_splits": kern.tile.splits_for(m, pick_rows),
           "fp16_us": time_us(lambda: torch.nn.functional.linear(x, w16)),
           "before_us": time_us(lambda: kern(x, config=before))}
    for rows in args.tile_heights or BLOCK_ROWS:
        for splits in split_counts(m, n, rows, kern.tile.k_blocks, kern.num_sms):
            key = f"tile{rows}" if splits == 1 else f"tile{rows}s{splits}"
            torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)  # poison the allocator
            y = kern.tile(x, bias, rows=rows, splits=splits).float()
            err = ((y - ref).norm() / ref.norm()).item()
            if not err < 2e-3 or not bool(torch.isfinite(y).all()):
                bad = (y - ref).abs().nan_to_num(float("inf")).flatten().argmax().item()
                print(f"FAIL tile {k}x{n} w{bits} m={m} rows={rows} splits={splits}: rel err {err:.2e}; worst at "
                      f"(row {bad // n}, col {bad % n}): {y.flatten()[bad].item():.4g} vs {ref.flatten()[bad].item():.4g}",
                      flush=True)
                row[f"{key}_failed"] = True
                continue
            row[f"{key}_us"] = time_us(lambda: kern.tile(x, rows=rows, splits=splits))  # noqa: B023 - called at once
        split_keys = [(row[key], key) for key in row if key.startswith(f"tile{rows}s")]
        if split_keys:  # the best split count at this height
            row[f"tile{rows}split_us"], best = min(split_keys)
            row[f"tile{rows}split"] = int(best[len(f"tile{rows}s"):-3])
    timed = [(row[key], key) for key in row if key.startswith("tile") and key.endswith("_us")
             and "split_us" not in key]
    row["best"] = min(timed)[1][:-3] if timed else ""
    pick = f"tile{pick_rows}" + (f"s{row['pick_splits']}" if row["pick_splits"] > 1 else "")
    row["pick_us"] = row.get(f"{pick}_us", 0.0)
    parts = "  ".join(f"{key[:-3]} {row[key]:.1f} ({row['fp16_us'] / row[key]:.2f}x)" for key in row
                      if key.startswith("tile") and key.endswith("_us") and "split_us" not in key)
    print(f"tile sweep {k}x{n} w{bits} m={m}: fp16 {row['fp16_us']:.1f}us, {before.kind} {row['before_us']:.1f} "
          f"({row['fp16_us'] / row['before_us']:.2f}x)  {parts}  (picks {pick})", flush=True)
    if args.json:
        print(json.dumps({"tile_sweep": row}), flush=True)
    return row


def _table(rows: list) -> str:
    head = ["shape", "bits", "batch", "fp16 µs", "before", "before µs", "×fp16",
            *[f"tile {r} µs" for r in BLOCK_ROWS], *[f"tile {r} split-K µs (splits)" for r in BLOCK_ROWS],
            "best", "best ×fp16", "picked", "picked ×fp16"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        tiles = [f"{r[f'tile{h}_us']:.1f}" if f"tile{h}_us" in r else "fail" if f"tile{h}_failed" in r else "-"
                 for h in BLOCK_ROWS]  # "-": a height not asked for (--tile-heights)
        splits = [f"{r[f'tile{h}split_us']:.1f} ({r[f'tile{h}split']})" if f"tile{h}split_us" in r else "" for h in BLOCK_ROWS]
        best = f"{r['fp16_us'] / r[r['best'] + '_us']:.2f}" if r["best"] else "n/a"
        picked = f"{r['fp16_us'] / r['pick_us']:.2f}" if r["pick_us"] else "n/a"
        pick = f"{r['pick']}" + (f" / {r['pick_splits']}" if r["pick_splits"] > 1 else "")
        lines.append("| " + " | ".join([r["shape"], str(r["bits"]), str(r["m"]), f"{r['fp16_us']:.1f}", r["before"],
                                        f"{r['before_us']:.1f}", f"{r['fp16_us'] / r['before_us']:.2f}", *tiles, *splits,
                                        r["best"], best, pick, picked]) + " |")
    return "\n".join(lines)
