"""Versions of the CUDA tile GEMM side by side in one process (Hopper): each variant's csrc compiled into a
library of its own, run on the same layout and inputs as this tree's kernel, its output compared with this
tree's bit for bit, and timed beside it and fp16 cuBLAS. The A/B behind bench/NOTES-kernels.md round 9.

    git archive HEAD~3 flotilla/kernels/cuda/csrc | tar -x -C /tmp/before     # a variant: a csrc directory
    python3 -P bench/tile_variants.py --variants /tmp/before/flotilla/kernels/cuda/csrc \\
        --shapes 4096x4096,8192x28672 --rows 256,2048                         # + --json: one object a case
    python3 -P bench/tile_variants.py --plans 64,128 --rows 256               # this tree's other block heights

On the device tool, put the variant directories inside the repository (an ignored folder named in `carry`).
A build whose TileParams layout differs from this tree's (before round 11: `stages_per_group` where `group_magic`
is now) is refused when loaded: the same bytes would mean another thing to it.
Each case runs at the plan the registry picks (`rows_for`, `split_k`); `--plans` times this tree's kernel at
other block heights as well (each with its own `split_k`). µs per call are CUDA-graph replays
with the L2 cleared (bench/kernels.py's `time_us`). The same code timed twice moved by up to 4-7% at 2048 rows
on an H100: differences under that are noise. Without a Hopper GPU and nvcc it says so and times nothing.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import kernels as kernels_bench  # noqa: E402  (bench/kernels.py: random_gptq, time_us)

from flotilla.kernels.cuda import build, tile  # noqa: E402
from flotilla.kernels.triton_linear import TritonGPTQKernel, dequantize_layout  # noqa: E402


def compile_variant(csrc: Path, out: Path) -> tile._Library:
    """The tile library built from another csrc directory (the same sources and flags as this tree's)."""
    missing = [s for s in (*build.TILE.sources, *build.TILE.headers) if not (csrc / s).is_file()]
    if missing:
        raise SystemExit(f"{csrc} is not a csrc directory: it lacks {', '.join(missing)}")
    nvcc = build.find_nvcc()
    if nvcc is None:
        raise SystemExit("nvcc not found: set CUDA_HOME or put nvcc on PATH")
    here, build.CSRC = build.CSRC, csrc
    try:
        build.compile_library(nvcc, tuple(torch.cuda.get_device_capability()), out, build.TILE)
    finally:
        build.CSRC = here
    return tile._Library(ctypes.CDLL(str(out)))


def parse_plans(text: str) -> list[int]:
    """"64,256" -> [64, 256]: block heights of this tree's kernel to time beside the pick (each once)."""
    try:
        plans = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--plans {text!r}: comma-separated block heights, e.g. 64,128") from None
    if any(r not in tile.BLOCK_ROWS for r in plans):
        raise SystemExit(f"--plans {text!r}: block heights among {tile.BLOCK_ROWS}")
    return list(dict.fromkeys(plans))


def run(args) -> list[dict]:
    variants = [Path(v).resolve() for v in args.variants.split(",") if v]
    work = Path(tempfile.mkdtemp(prefix="tile_variants_"))
    libs = {v: compile_variant(v, work / f"v{i}" / "flotilla_tile.so") for i, v in enumerate(variants)}
    plans = parse_plans(args.plans)
    kernels_bench.GRAPHS = True
    rows = []
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        for bits in (int(b) for b in args.bits.split(",")):
            kern = TritonGPTQKernel(kernels_bench.random_gptq(k, n, bits, 128, True, False, "cuda"), torch.float16)
            ours = kern.tile
            if ours is None:
                raise SystemExit(f"the tile GEMM does not serve {shape} at {bits} bits here (see the log)")
            others = {v: tile.TileKernel(ours.layout, ours.dtype, lib) for v, lib in libs.items()}
            w16 = torch.randn(n, k, device="cuda", dtype=torch.float16)
            dense = dequantize_layout(ours.layout, torch.float32)  # [N, K]
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                r = ours.rows_for(m)
                s = ours.splits_for(m, r)
                want = ours(x, rows=r, splits=s)
                ref = x.float() @ dense.t()
                row = dict(shape=shape, bits=bits, m=m, rows=r, splits=s,
                           err=((want.float() - ref).norm() / ref.norm()).item(),
                           fp16_us=kernels_bench.time_us(lambda: torch.nn.functional.linear(x, w16)),
                           this_us=kernels_bench.time_us(lambda: ours(x, rows=r, splits=s)), plans={}, variants={})
                for pr in plans:
                    ps = ours.splits_for(m, pr)
                    got = ours(x, rows=pr, splits=ps)
                    row["plans"][str(pr)] = dict(  # another split count sums in another order: not compared bit for bit
                        splits=ps, us=kernels_bench.time_us(lambda: ours(x, rows=pr, splits=ps)),
                        bit_equal=torch.equal(got, want) if ps == s else None,
                        err=((got.float() - ref).norm() / ref.norm()).item())
                for v, kv in others.items():
                    got = kv(x, rows=r, splits=s)
                    row["variants"][str(v)] = dict(
                        us=kernels_bench.time_us(lambda: kv(x, rows=r, splits=s)),
                        bit_equal=torch.equal(got, want),
                        err=((got.float() - ref).norm() / ref.norm()).item())
                rows.append(row)
                print(json.dumps(row) if args.json else _line(row, variants), flush=True)
    return rows


def _line(row: dict, variants: list[Path]) -> str:
    pick = f"{row['rows']} / {row['splits']}"
    cells = [row["shape"], f"W{row['bits']}", str(row["m"]), pick, f"{row['fp16_us']:.1f}",
             f"{row['this_us']:.1f} ({row['fp16_us'] / row['this_us']:.2f}x)", f"{row['err']:.1e}"]
    for r in row["plans"].values():
        cells.append(f"{r['us']:.1f} ({row['fp16_us'] / r['us']:.2f}x, {r['splits']} split"
                     + ("" if r["bit_equal"] is not False else f", DIFFERENT, err {r['err']:.1e}")
                     + (f", err {r['err']:.1e}" if r["bit_equal"] is None else "") + ")")
    for v in variants:
        r = row["variants"][str(v)]
        cells.append(f"{r['us']:.1f} ({row['fp16_us'] / r['us']:.2f}x, "
                     + ("bit-equal" if r["bit_equal"] else f"DIFFERENT, err {r['err']:.1e}") + ")")
    return "| " + " | ".join(cells) + " |"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="", help="comma-separated csrc directories (each a version of the kernel)")
    ap.add_argument("--plans", default="", help="this tree's kernel also at these block heights, e.g. 64,128")
    ap.add_argument("--shapes", default="4096x4096,14336x4096,8192x28672", help="KxN weight shapes")
    ap.add_argument("--rows", default="256,1024,2048", help="batch rows")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--json", action="store_true", help="one JSON object per case instead of the table")
    args = ap.parse_args(argv)
    plans = parse_plans(args.plans)  # a bad list is refused before anything compiles
    if not torch.cuda.is_available() or tuple(torch.cuda.get_device_capability()) != tile.CAPABILITY:
        print("bench/tile_variants.py needs a Hopper (sm_90) GPU", file=sys.stderr)
        return 2
    variants = [Path(v).resolve() for v in args.variants.split(",") if v]
    if not args.json:
        head = ["shape", "bits", "rows", "block / splits", "fp16 µs", "this tree µs", "rel err"]
        head += [f"{p} µs" for p in plans]
        head += [f"variant {i + 1} µs" for i in range(len(variants))]
        print("variants: " + ", ".join(f"{i + 1}: {v}" for i, v in enumerate(variants)))
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head), flush=True)
    rows = run(args)
    different = [r for r in rows if any(v["bit_equal"] is False for v in (*r["variants"].values(), *r["plans"].values()))]
    if different:
        print(f"{len(different)} case(s) where a variant's or plan's output differs from the pick's", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
