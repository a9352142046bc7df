"""The two ends of a GPU decode step, each way of computing them timed in the same run.

    python bench/step_ends.py                 # the table
    python bench/step_ends.py --json          # one JSON object per row

Rows, per batch (llama-3's vocabulary 128 256 and hidden size 4096 by default):
  lm_head    fp16 GEMM then a conversion to fp32 (what the step did) | the GEMM writing fp32
             itself (torch.mm's out_dtype: what LMHead.logits_fn runs on a GPU); with each one's
             largest error against an fp32 product of the same half inputs
  greedy     sampler.first_max's two passes (no `out`) + the copy into the sampled-ids buffer |
             kernels/triton_sample.first_max_into (one launch, written in place)
  step start index_select + add + embedding + RMSNorm (torch ops, then flotilla's norm kernel) |
             fused.embed_rms_norm (one launch)

Each op is captured 50 times back to back in one CUDA graph; µs per op is the best of 20 replays.
Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flotilla.kernels import fused  # noqa: E402
from flotilla.kernels.triton_sample import first_max_into  # noqa: E402
from flotilla.runtime.sampler import first_max  # noqa: E402


def per_op_us(fn: Callable[[], object], reps: int = 50, replays: int = 20) -> float:
    """µs per call of fn, captured `reps` times in one CUDA graph (warmed up off the capture first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / reps)
    return best


def rows_for(batch: int, vocab: int, hidden: int) -> list[dict]:
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(batch)
    w = (0.02 * torch.randn(vocab, hidden, device=dev, generator=gen)).half()
    x = torch.randn(batch, hidden, device=dev, generator=gen).half()
    exact = x.float() @ w.float().t()
    before = lambda: torch.mm(x, w.t()).float()  # noqa: E731
    after = lambda: torch.mm(x, w.t(), out_dtype=torch.float32)  # noqa: E731
    head = {"op": "lm_head", "batch": batch, "before_us": per_op_us(before), "after_us": per_op_us(after),
            "before_max_err": (before() - exact).abs().max().item(), "after_max_err": (after() - exact).abs().max().item()}

    logits = torch.randn(batch, vocab, device=dev, generator=gen)
    sampled = torch.zeros(batch + 1, dtype=torch.int64, device=dev)
    two_pass = lambda: sampled[:batch].copy_(first_max(logits))  # noqa: E731
    one = lambda: first_max_into(logits, sampled[:batch])  # noqa: E731
    want = first_max(logits).tolist()
    if one().tolist() != want:
        raise SystemExit("first_max_into disagrees with the two-pass first maximum")
    greedy = {"op": "greedy", "batch": batch, "before_us": per_op_us(two_pass), "after_us": per_op_us(one)}

    table = torch.randn(vocab, hidden, device=dev, generator=gen).half()
    norm_w = torch.ones(hidden, device=dev).half()
    tok = torch.zeros(batch, dtype=torch.int64, device=dev)
    prev = torch.arange(batch, device=dev)
    sampled[:batch] = torch.randint(0, vocab, (batch,), device=dev, generator=gen)
    composed = lambda: fused.rms_norm(torch.nn.functional.embedding(  # noqa: E731
        tok + sampled.index_select(0, prev), table), norm_w, 1e-5)
    fused_start = lambda: fused.embed_rms_norm(table, tok, norm_w, 1e-5, sampled, prev)  # noqa: E731
    if not torch.equal(composed(), fused_start()[1]):
        raise SystemExit("embed_rms_norm disagrees with the composed ops")
    start = {"op": "step start", "batch": batch, "before_us": per_op_us(composed), "after_us": per_op_us(fused_start)}
    return [head, greedy, start]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/step_ends.py needs a CUDA GPU")
    rows = [r for b in args.batches.split(",") for r in rows_for(int(b), args.vocab, args.hidden)]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| op | batch | before µs | after µs | before max err | after max err |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        errs = (f"{r['before_max_err']:.2e} | {r['after_max_err']:.2e}" if "before_max_err" in r else " | ")
        print(f"| {r['op']} | {r['batch']} | {r['before_us']:.1f} | {r['after_us']:.1f} | {errs} |")


if __name__ == "__main__":
    main()
