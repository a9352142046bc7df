"""A long prompt's prefill under a sliding window: the torch attention path gathering keys from the first block a
step's queries can see (the default) against gathering the whole context (the peer: how it ran before), same run.

    python bench/window_prefill.py                       # prompts of 2048, 4096 and 8192 tokens
    python bench/window_prefill.py --lens 4096 --json

A random Mistral-shaped model (every layer slides, so the cache also gives back the blocks behind the window) on
the CPU in fp32; the prompt's prefill is chunked by --chunk tokens a step, and one token is generated. Rows: prefill
tok/s (prompt tokens / time to the first token, median of --repeats) and the blocks given back.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]


def build_model(directory: Path, window: int, max_len: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, MistralConfig

    from flotilla.runtime.random_model import randomize

    config = MistralConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=max_len,
                           sliding_window=window, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = randomize(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())
    model.save_pretrained(str(directory))
    return directory


def prefill_time(path: Path, length: int, chunk: int, whole_context: bool) -> tuple[float, int]:
    """Seconds to the first token of a `length`-token prompt, and the blocks given back behind the window."""
    from flotilla.runtime import model_runner
    from flotilla.runtime.engine_args import EngineArgs, build_engine
    from flotilla.runtime.loader import load_model
    from flotilla.runtime.sampling import SamplingParams

    original = model_runner.prepare_step

    def gather_everything(step, block_size, device):  # the peer: no query position known, so nothing skipped
        positions, meta = original(step, block_size, device)
        return positions, dataclasses.replace(meta, min_decode_pos=0, min_prefill_pos=0)

    model_runner.prepare_step = gather_everything if whole_context else original
    try:
        engine = build_engine(load_model(path, "cpu", "float32", with_tokenizer=False, progress=False),
                              EngineArgs(max_num_batched_tokens=chunk, kv_cache_memory="1GiB",
                                         enable_prefix_caching=False))
        prompt = [(i * 7919) % 500 + 3 for i in range(length)]
        t0 = time.perf_counter()
        engine.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - t0, engine.block_manager.num_window_released
    finally:
        model_runner.prepare_step = original


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lens", default="2048,4096,8192", help="prompt lengths (default %(default)s)")
    p.add_argument("--window", type=int, default=512, help="the model's sliding window (default %(default)s)")
    p.add_argument("--chunk", type=int, default=512, help="prefill tokens a step (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    args = p.parse_args()
    lens = [int(x) for x in args.lens.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "m", args.window, max(lens) + 16)
        for peer in (False, True):  # warm-up, each way once (the CPU kernels' first load, the first plans)
            prefill_time(path, min(lens), args.chunk, peer)
        for n in lens:
            runs = {False: [], True: []}
            for i in range(args.repeats):  # interleaved, each first in turn: a slow moment hits both
                for peer in ((False, True) if i % 2 == 0 else (True, False)):
                    runs[peer].append(prefill_time(path, n, args.chunk, peer))
            for peer in (False, True):
                secs = statistics.median(r[0] for r in runs[peer])
                rows.append({"prompt": n, "window": args.window, "gather": "whole context" if peer else "window",
                             "seconds": round(secs, 3), "prefill_tok_s": round(n / secs, 1),
                             "blocks_given_back": runs[peer][0][1]})
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"{'prompt':>7} {'gather':>14} {'s':>8} {'prefill tok/s':>14} {'vs whole':>9} {'blocks back':>12}")
    for r in rows:
        base = next(x for x in rows if x["prompt"] == r["prompt"] and x["gather"] == "whole context")
        print(f"{r['prompt']:>7} {r['gather']:>14} {r['seconds']:>8.3f} {r['prefill_tok_s']:>14.1f} "
              f"{base['seconds'] / r['seconds']:>8.2f}x {r['blocks_given_back']:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
