"""Write a seeded random-weight INT4 (or INT8) checkpoint of a named shape, generated on the device
itself, so that pipeline runs on a GPU machine need no carried weights and no download.

    python bench/random_checkpoint.py llama-3-8b /tmp/llama8b-int4 [--bits 4] [--device cuda] [--seed 0]
    python bench/random_checkpoint.py tiny /tmp/tiny --layers 6 --device cpu

The weights are those of `runtime bench --random` (flotilla/runtime/random_model.py: uniform
random codes, scales that keep each linear's output variance near its input's), streamed layer by
layer into the checkpoint writer (shards, index, manifest with sha256), so `load_model(OUT)` and
pipeline workers read it like any flotilla checkpoint. No tokenizer: drive it with token ids.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flotilla.runtime.random_model import SHAPES, write_random_checkpoint  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=list(SHAPES))
    ap.add_argument("out", help="the checkpoint directory to write (replaced if it exists)")
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8))
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    ap.add_argument("--head-bits", type=int, default=None, choices=(4, 8),
                    help="quantize the lm_head too, to 4 or 8 bits (default: fp16, as GPTQ tools write it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the weights are generated (default: cuda if available)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    path = write_random_checkpoint(args.shape, args.out, args.bits, args.group_size, args.seed, args.device,
                                   args.layers, args.head_bits)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"wrote {path}: {args.shape} int{args.bits} g{args.group_size}"
          f"{'' if args.head_bits is None else f', lm_head int{args.head_bits}'}, {size / 2**30:.2f} GiB in "
          f"{time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
