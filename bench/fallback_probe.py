"""Which of a step's fused ops fall back to torch on the GPU: runs `runtime bench` in this process with
kernels/fused's CPU gate (kernels/cpu/ops.ready) and its torch fallbacks watched, and prints each distinct
call site that handed a CUDA tensor to a torch fallback, with the tensors' shapes, dtypes and strides.

    python3 -P bench/fallback_probe.py --random llama-3-8b --gguf Q4_K_M --batch 1,16 --layers 4

Arguments are `runtime bench`'s. Every fallback path of kernels/fused is counted: an op whose CUDA
inputs miss the Triton kernel's conditions (dtype, rank, stride, shape) asks ops.ready() about them
and then runs the torch expression; that is one call more than a fused launch, on every step.
"""
from __future__ import annotations

import collections
import sys
import traceback

import torch

from flotilla.kernels.cpu import ops
from flotilla.server.cli import main as cli_main


def describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} stride {t.stride()} {t.device}"


def main(argv: list[str]) -> int:
    seen: collections.Counter = collections.Counter()
    first: dict[tuple, str] = {}
    real_ready = ops.ready

    def watched(*tensors: torch.Tensor) -> bool:
        if any(t.is_cuda for t in tensors):
            stack = traceback.extract_stack()[:-1]
            site = tuple((f.filename.rsplit("/", 2)[-1], f.lineno, f.name) for f in stack[-4:])
            seen[site] += 1
            if site not in first:
                first[site] = " | ".join(describe(t) for t in tensors)
        return real_ready(*tensors)

    ops.ready = watched
    rc = cli_main(["bench", *argv])
    print(f"\n{len(seen)} call site(s) handed CUDA tensors to a torch fallback:")
    for site, count in seen.most_common():
        print(f"  {count} calls: " + " <- ".join(f"{f}:{line} {name}" for f, line, name in reversed(site)))
        print(f"    tensors: {first[site]}")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
