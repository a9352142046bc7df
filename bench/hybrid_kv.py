"""What the hybrid KV cache holds against a plain one in the same memory, for Gemma 2 and 3 (sliding-window and
global layers), and (--measure) the decode speed of both on a random Gemma-3-4B-shaped model.

The capacity rows come from the planner the engine runs (kv_cache.hybrid_groups / hybrid_plan) over the published
configs' layer counts, KV heads, head sizes and windows, bf16, 16-token blocks: the longest context one sequence
can reach (the model's own limit aside), and how many sequences of 512 / 8192 / 32768 tokens fit at once while they
decode (a sliding group then holds its window's blocks, 2 more at the ends). The plain cache is the peer: every block
holds every layer.

    python -P bench/hybrid_kv.py                     # the capacity table, 8 GiB of KV cache
    python -P bench/hybrid_kv.py --memory 4GiB --measure --device cuda   # and the decode, hybrid against plain
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from flotilla.runtime.kv_cache import KVCachePlan, KVCacheSpec, hybrid_groups, hybrid_plan, parse_memory

# (layers, KV heads, head size, sliding window, a global layer every `pattern`, context), as their config.json say
MODELS = {
    "gemma-3-1b": (26, 1, 256, 512, 6, 32768),
    "gemma-3-4b": (34, 4, 256, 1024, 6, 131072),
    "gemma-3-12b": (48, 8, 256, 1024, 6, 131072),
    "gemma-3-27b": (62, 16, 128, 1024, 6, 131072),
    "gemma-2-9b": (42, 8, 256, 4096, 2, 8192),
    "gemma-2-27b": (46, 16, 128, 4096, 2, 8192),
}
BLOCK = 16
LENGTHS = (512, 8192, 32768)


def capacity(name: str, memory: int, max_num_seqs: int, chunk: int) -> dict:
    layers, heads, dim, window, pattern, max_model_len = MODELS[name]
    windows = [0 if i % pattern == pattern - 1 else window for i in range(layers)]
    plain = KVCacheSpec(tuple(range(layers)), heads, dim, torch.bfloat16, BLOCK)
    n_plain = memory // plain.bytes_per_block
    groups, group_windows = hybrid_groups(plain.layers, lambda i: windows[i])
    spec = dataclasses.replace(plain, groups=groups, group_windows=group_windows)
    n, fit = hybrid_plan(spec, KVCachePlan(n_plain, ""), max_model_len, max_num_seqs, chunk)

    row = {"model": name, "memory_gib": round(memory / 2**30, 2), "layers": layers,
           "groups": f"{sum(1 for w in group_windows if not w)}+{sum(1 for w in group_windows if w)}x{len(groups[0])}",
           "plain_longest": min((n_plain - 1) * BLOCK, max_model_len), "hybrid_longest": fit}
    for length in LENGTHS:  # (None: past the model's context)
        row[f"plain_{length}"] = (n_plain - 1) // -(-length // BLOCK) if length <= max_model_len else None
        row[f"hybrid_{length}"] = (n - 1) // spec.blocks_per_sequence(length) if length <= max_model_len else None
    return row


def measure(memory: str, device: str, batch: int, prompt: int, tokens: int, layers: int) -> list[dict]:
    """runtime bench's decode on a random Gemma-3-4B shape (fewer layers), hybrid and plain, in one process."""
    from flotilla.runtime.bench import run_batches
    from flotilla.runtime.random_model import build_random_model

    model = build_random_model("gemma-3-4b", 4, device, torch.bfloat16 if device != "cpu" else torch.float32,
                               num_layers=layers)
    rows = []
    for hybrid in (True, False, True, False):  # interleaved: the second pair says how far the first can be trusted
        (r,) = run_batches(model, [batch], prompt, tokens, hybrid=hybrid)
        rows.append({"cache": "hybrid" if hybrid else "plain", "batch": batch, "prompt": prompt, "tokens": tokens,
                     "tok_s": round(r.tok_s, 1), "ms_per_step": round(r.ms_per_step, 2)})
    return rows


def emit(rows: list[dict], as_json: bool, title: str, header: str, cells) -> None:
    """The rows as JSON objects, or as a markdown table under `title`."""
    if as_json:
        for r in rows:
            print(json.dumps(r))
        return
    print(title)
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for r in rows:
        print("| " + " | ".join(str(c) for c in cells(r)) + " |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memory", default="8GiB", help="the KV cache's memory (default 8GiB)")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--measure", action="store_true", help="also time the decode, hybrid against plain")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=1100, help="random prompt tokens (past the 1024-token window)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--layers", type=int, default=6, help="--measure's layers of the 4B shape (default 6)")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    args = p.parse_args()
    memory = parse_memory(args.memory)
    rows = [capacity(m, memory, 1 << 20, args.max_num_batched_tokens) for m in MODELS]
    emit(rows, args.json, f"KV cache {args.memory} in bf16, 16-token blocks: longest context one sequence reaches (at "
         f"most the model's), and sequences of 512 / 8192 / 32768 tokens decoding at once (plain / hybrid)",
         "| model | groups (whole+sliding x size) | longest, plain | longest, hybrid | 512 | 8192 | 32768 |",
         lambda r: [r["model"], r["groups"], r["plain_longest"], r["hybrid_longest"],
                    *(f"{r[f'plain_{n}']} / {r[f'hybrid_{n}']}" if r[f"plain_{n}"] is not None else "—"
                      for n in LENGTHS)])
    if args.measure:
        timed = measure(args.memory, args.device, args.batch, args.prompt, args.tokens, args.layers)
        emit(timed, args.json, f"\ndecode, random gemma-3-4b shape ({args.layers} layers, INT4) on {args.device}, "
             f"batch {args.batch}, prompt {args.prompt} + {args.tokens} tokens", "| cache | tok/s | ms/step |",
             lambda r: [r["cache"], r["tok_s"], r["ms_per_step"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
