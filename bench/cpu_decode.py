"""Single-stream decode of SmolLM2-135M INT4 on CPU: dense kernel vs flotilla's CPU kernels,
with llama.cpp (llama-cpp-python) on the same GGUF as the peer, all in the same run.

    python3 bench/cpu_decode.py                    # table
    python3 bench/cpu_decode.py --json --tokens 128

The INT4 checkpoint is made once by RTN from the default GGUF (bench/rtn_checkpoint.py; group
64, symmetric by default) and cached under $FLOTILLA_CACHE_DIR/bench/. Rows:

    dense            FLOTILLA_KERNEL=dense: dequantized fp32 weights, MKL; fp32 lm_head
    cpu              FLOTILLA_KERNEL=cpu: our W4 kernel; fp32 lm_head
    cpu+head         our W4 kernel and the lm_head in its exact compact form (compact_linear)
    llama.cpp        llama-cpp-python, same thread count, the original Q4_1 GGUF

Decode tok/s counts the tokens after the first (the first one pays for the prefill); greedy,
EOS ignored. `agree` is how many leading tokens equal the dense kernel's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.rtn_checkpoint import write_rtn_checkpoint  # noqa: E402
from flotilla.envs import cache_dir  # noqa: E402
from flotilla.kernels.cpu import compact_linear  # noqa: E402
from flotilla.kernels.registry import ENV_KERNEL  # noqa: E402
from flotilla.runtime.default_model import default_model_path  # noqa: E402
from flotilla.runtime.loader import load_model  # noqa: E402
from flotilla.runtime.sampling import SamplingParams  # noqa: E402
from flotilla.runtime.simple import generate_tokens  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


class CompactHead(nn.Module):
    """The lm_head through compact_linear's exact int8-block / fp16 form."""

    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)


def time_decode(model, prompt_ids: list[int], n: int) -> tuple[float, list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    list(generate_tokens(model, prompt_ids, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
    tokens, t_first = [], 0.0
    for tok in generate_tokens(model, prompt_ids, params):
        tokens.append(tok)
        if len(tokens) == 1:
            t_first = time.perf_counter()
    return (len(tokens) - 1) / (time.perf_counter() - t_first), tokens


def run_ours(checkpoint: Path, kernel: str, compact_head: bool, prompt_ids, n: int) -> dict:
    os.environ[ENV_KERNEL] = kernel
    try:
        loaded = load_model(checkpoint, device="cpu", with_tokenizer=False, progress=False)
    finally:
        os.environ.pop(ENV_KERNEL, None)
    model, head = loaded.model, "fp32"
    if compact_head:
        op = compact_linear(model.lm_head.weight)
        if op is not None:
            model.lm_head, head = CompactHead(op), op.name
    tok_s, tokens = time_decode(model, prompt_ids, n)
    return {"tok_s": tok_s, "tokens": tokens, "lm_head": head}


def run_llama_cpp(gguf: Path, prompt_ids: list[int], n: int, threads: int) -> dict | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    # n_batch=1: this llama-cpp-python build segfaults evaluating several tokens at once on this
    # machine, so the prompt goes one token at a time; decode (one token a step) is unaffected.
    llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=1,
                n_ubatch=1, verbose=False)
    best = 0.0
    for _ in range(2):
        llm.reset()
        count, t_first = 0, 0.0
        for _tok in llm.generate(prompt_ids, temp=0.0, top_k=1, reset=True):
            count += 1
            if count == 1:
                t_first = time.perf_counter()
            if count == n:
                break
        best = max(best, (count - 1) / (time.perf_counter() - t_first))
    return {"tok_s": best, "tokens": None, "lm_head": "q8_0"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--asym", action="store_true")
    ap.add_argument("--checkpoint", type=Path, help="an INT4 checkpoint (default: made once from the GGUF)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    gguf = default_model_path()
    checkpoint = args.checkpoint
    if checkpoint is None:
        kind = f"w4g{args.group_size}{'a' if args.asym else 's'}"
        checkpoint = cache_dir() / "bench" / f"smollm2-135m-rtn-{kind}"
        if not checkpoint.is_dir():
            checkpoint.parent.mkdir(parents=True, exist_ok=True)
            write_rtn_checkpoint(gguf, checkpoint, 4, args.group_size, not args.asym)
    from flotilla.models.tokenizer import load_tokenizer

    prompt_ids = load_tokenizer(gguf).encode(PROMPT)
    rows = [("dense", run_ours(checkpoint, "dense", False, prompt_ids, args.tokens)),
            ("cpu", run_ours(checkpoint, "cpu", False, prompt_ids, args.tokens)),
            ("cpu+head", run_ours(checkpoint, "cpu", True, prompt_ids, args.tokens)),
            ("llama.cpp", run_llama_cpp(gguf, prompt_ids, args.tokens, args.threads))]
    reference = rows[0][1]["tokens"]
    peer = rows[-1][1]["tok_s"] if rows[-1][1] else None
    if not args.json:
        print(f"{'variant':>10} {'tok/s':>8} {'ms/tok':>7} {'vs llama.cpp':>12} {'agree':>7}  lm_head")
    for name, r in rows:
        if r is None:
            print(f"{name:>10}  (llama-cpp-python not installed)", file=sys.stderr)
            continue
        agree = None
        if r["tokens"] is not None:
            agree = next((i for i, (a, b) in enumerate(zip(r["tokens"], reference)) if a != b), len(reference))
        row = {"variant": name, "tok_s": round(r["tok_s"], 1), "ms_per_token": round(1e3 / r["tok_s"], 2),
               "vs_llama_cpp": round(r["tok_s"] / peer, 2) if peer else None, "agree_with_dense": agree,
               "lm_head": r["lm_head"], "tokens": args.tokens, "threads": args.threads,
               "checkpoint": checkpoint.name}
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            ratio = f"{row['vs_llama_cpp']:.2f}x" if peer else "-"
            agree_s = f"{agree}/{args.tokens}" if agree is not None else "-"
            print(f"{name:>10} {row['tok_s']:>8.1f} {row['ms_per_token']:>7.2f} {ratio:>12} {agree_s:>7}  {r['lm_head']}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
