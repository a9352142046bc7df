"""The CUDA tile GEMM (kernels/cuda/tile.py, Hopper) against the other paths: `python bench/kernels.py --graph
--only-sweeps --tile-sweep`, the evidence for tile.MIN_ROWS, MAX_ROWS and block_rows.

Per weight shape (--shapes), bit width (4, 8) and batch (--tile-rows), g128 symmetric, fp16: µs per call
(CUDA-graph replay when --graph, L2 cleared) of fp16 cuBLAS on the dense weight, the path the registry took
before the tile GEMM (Triton tiles or dequantize + cuBLAS: `choose_config`), and the tile GEMM at each block
height (64, 128, 256 batch rows), each checked against the reference first (a failure is printed with the
largest error's position, and that height is not timed); ×fp16 of each, and the height `block_rows` picks.
One JSON object per case with --json. Without a Hopper GPU (or nvcc) it says so and times nothing.
With --tile-depth, each height's deeper ring (tile.RING_STAGES) is timed too.

Standalone, the tile GEMM alone against fp16 (no "before" column, so neither the GEMV nor a Triton kernel is
built; quick on a fresh machine):

    python bench/kernels_tile.py --shapes 4096x4096,14336x4096 --rows 64,256,1024 --bits 4 --depth
"""
from __future__ import annotations

import json

import torch

from flotilla.kernels.cuda.tile import BLOCK_ROWS, RING_STAGES, tile_for
from flotilla.kernels.reference import dequantize
from flotilla.kernels.triton_layout import repack
from flotilla.kernels.triton_linear import TritonGPTQKernel, choose_config, weight_side


def variants(depth: bool):
    """(height, ring depth, column key) of each tile variant timed: the default ring, and the deeper ones."""
    for rows in BLOCK_ROWS:
        for i, stages in enumerate(RING_STAGES[rows] if depth else RING_STAGES[rows][:1]):
            yield rows, stages, f"tile{rows}_us" if i == 0 else f"tile{rows}d{stages}_us"


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
    time_variants(kern.tile, x, bias, ref, row, f"{k}x{n} w{bits} m={m}", getattr(args, "tile_depth", False), time_us)
    timed = [(row[f"tile{r}_us"], r) for r in BLOCK_ROWS if f"tile{r}_us" in row]
    row["best_rows"] = min(timed)[1] if timed else 0
    parts = "  ".join(f"{key[:-3]} {row[key]:.1f} ({row['fp16_us'] / row[key]:.2f}x)"
                      for _, _, key in variants(True) if key in row)
    print(f"tile sweep {k}x{n} w{bits} m={m}: fp16 {row['fp16_us']:.1f}us, {before.kind} {row['before_us']:.1f} "
          f"({row['fp16_us'] / row['before_us']:.2f}x)  {parts}  (block_rows picks {row['pick']})", flush=True)
    if args.json:
        print(json.dumps({"tile_sweep": row}), flush=True)
    return row


def time_variants(tile, x, bias, ref, row: dict, what: str, depth: bool, time_us) -> None:
    """Check each variant against the reference (a failure printed with its worst entry, and not timed), then time
    it into row[key]."""
    m, n = ref.shape
    for rows, stages, key in variants(depth):
        torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)  # poison the allocator
        y = tile(x, bias, rows=rows, stages=stages).float()
        err = ((y - ref).norm() / ref.norm()).item()
        if not err < 2e-3 or not bool(torch.isfinite(y).all()):
            bad = (y - ref).abs().nan_to_num(float("inf")).flatten().argmax().item()
            print(f"FAIL tile {what} rows={rows} ring={stages}: rel err {err:.2e}; worst at (row {bad // n}, col "
                  f"{bad % n}): {y.flatten()[bad].item():.4g} vs {ref.flatten()[bad].item():.4g}", flush=True)
            continue
        row[key] = time_us(lambda: tile(x, rows=rows, stages=stages))  # noqa: B023 - called at once


def main(argv=None) -> int:
    import argparse

    from bench import kernels

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x4096,4096x14336,14336x4096,8192x28672")
    ap.add_argument("--rows", default="64,256,1024")
    ap.add_argument("--bits", default="4")
    ap.add_argument("--depth", action="store_true", help="time the deeper rings too")
    ap.add_argument("--eager", action="store_true", help="eager calls instead of CUDA-graph replays")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernels_tile.py needs a CUDA GPU (none is visible)")
        return 2
    kernels.GRAPHS = not args.eager
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        w16 = None
        for bits in (int(b) for b in args.bits.split(",")):
            w = kernels.random_gptq(k, n, bits, 128, True, False, "cuda")
            tile = tile_for(repack(w), torch.float16)
            if tile is None:
                print(f"the tile GEMM does not serve {shape} at {bits} bits here")
                return 2
            w16 = dequantize(w, torch.float16).t().contiguous()
            for m in (int(v) for v in args.rows.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                bias = torch.randn(n, device="cuda", dtype=torch.float16)
                ref = x.float() @ w16.float().t() + bias.float()
                row = {"fp16_us": kernels.time_us(lambda: torch.nn.functional.linear(x, w16))}  # noqa: B023
                time_variants(tile, x, bias, ref, row, f"{shape} w{bits} m={m}", args.depth, kernels.time_us)
                parts = "  ".join(f"{key[:-3]} {row[key]:.1f} ({row['fp16_us'] / row[key]:.2f}x)"
                                  for _, _, key in variants(True) if key in row)
                print(f"{shape} w{bits} m={m}: fp16 {row['fp16_us']:.1f}us  {parts}  (picks {tile.rows_for(m)})",
                      flush=True)
        del w16
        torch.cuda.empty_cache()
    return 0


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


if __name__ == "__main__":
    raise SystemExit(main())
