"""Speculative decoding on the CPU: plain decoding against n-gram lookup and an INT4 draft, in
the same run, on prompts whose answer repeats the input.

    python3 bench/spec_decode.py                    # the table
    python3 bench/spec_decode.py --json             # one JSON object per row
    python3 bench/spec_decode.py --k 2,4,6 --tokens 192
    python3 bench/spec_decode.py --pp 2             # and the same rows over a 2-stage pipeline

Target: SmolLM2-135M-Instruct, the embedded GGUF dequantized to fp32 (what `runtime` loads by
default). Draft: an RTN INT4 copy of the same weights (group 32, symmetric; built once from the
GGUF by bench/rtn_checkpoint.py and cached under $FLOTILLA_CACHE_DIR/bench/), run with its own
paged KV cache through flotilla's compiled W4 kernel.

Prompts (chat template, batch 1, greedy, EOS ignored): "edit" asks for a paragraph back with
its typos fixed; "summarize" asks for a summary, which reuses the text's phrases less.

With `--pp N` every configuration runs again with the target split over N local worker
processes on loopback (activations fp16 on the wire); the head proposes, a draft model runs on
the head, and the verify pass travels the ring.

Columns: decode tok/s = (tokens - those of the first output) / (time of the last output - time
of the first), the best of --repeats; `vs plain` is its ratio to the plain row of the same
prompt and pipeline depth; acceptance = accepted / verified drafts; `per step` = drafts accepted
per verify step (each step also yields the target's own token); `same` says whether the tokens
equal plain decoding's of the same depth (they must: greedy speculation is exact).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PARAGRAPH = (
    "The lighthouse stood on the edge of the cliff for more then two hundred years. Every night the keeper "
    "climbed the narow stairs, lit the great lamp and watched the ships pass safely through the strait. "
    "In winter the storms were fierce and the waves reached the windows of the tower, but the light never "
    "went out. When the old keeper retired, the village feared that the lighthouse would be abandonned, yet "
    "his grandaughter took his place and kept the lamp burning, just as he had taught her."
)
PROMPTS = {
    "edit": f"Fix the spelling mistakes in this text and write the whole corrected text:\n\n{PARAGRAPH}",
    "summarize": f"Summarize this text in three sentences, reusing its words:\n\n{PARAGRAPH}",
}


def int4_draft(gguf: Path, group_size: int) -> Path:
    from bench.rtn_checkpoint import write_rtn_checkpoint
    from flotilla.envs import cache_dir

    path = cache_dir() / "bench" / f"smollm2-135m-rtn-w4g{group_size}s"
    if not path.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_rtn_checkpoint(gguf, path, 4, group_size, True)
    return path


def run(engine, prompt: list[int], tokens: int, repeats: int) -> tuple[float, list[int], dict]:
    """Best decode tok/s over the repeats, the tokens, and the speculation counters of one run."""
    import torch

    from flotilla.runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    best, out, counters = 0.0, [], {}
    with torch.inference_mode():
        for r in range(repeats):
            before = engine.stats()
            engine.add_request(f"r{r}", prompt, params)
            stamps, counts, out = [], [], []
            while engine.has_unfinished():
                for o in engine.step():
                    stamps.append(time.perf_counter())
                    counts.append(len(o.new_token_ids))
                    out += o.new_token_ids
            best = max(best, (len(out) - counts[0]) / (stamps[-1] - stamps[0]))
            after = engine.stats()
            counters = {k: getattr(after, k) - getattr(before, k)
                        for k in ("spec_draft_tokens_total", "spec_accepted_tokens_total", "spec_verify_steps_total",
                                  "steps_total")}
    return best, out, counters


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per request (default 128)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per row; the best counts (default 2)")
    ap.add_argument("--k", default="3,5", help="comma-separated numbers of speculative tokens (default 3,5)")
    ap.add_argument("--group-size", type=int, default=32, help="the INT4 draft's group size (default 32)")
    ap.add_argument("--prompts", default=",".join(PROMPTS), help=f"which of {', '.join(PROMPTS)}")
    ap.add_argument("--pp", type=int, default=1, help="also run every row over this many pipeline stages (local "
                                                      "worker processes; default 1: no pipeline rows)")
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    args = ap.parse_args(argv)

    import torch

    from flotilla.runtime.default_model import default_model_path
    from flotilla.runtime.engine_args import EngineArgs, build_engine
    from flotilla.runtime.loader import load_model

    gguf = default_model_path()
    draft = int4_draft(gguf, args.group_size)
    target = load_model(gguf, "cpu", "float32", progress=False)
    ks = [int(k) for k in args.k.split(",")]
    configs = [("plain", None, 0)] + [("ngram", "ngram", k) for k in ks] + \
              [(f"draft int4 g{args.group_size}", f"draft:{draft}", k) for k in ks]
    engine_args = lambda spec, k: EngineArgs(kv_cache_memory="64MiB", max_num_seqs=1, speculative=spec,  # noqa: E731
                                             num_speculative_tokens=max(k, 1))
    prompts = {p: target.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[p]}])
               for p in args.prompts.split(",")}
    results = {}  # (prompt, pp, config index) -> (tok/s, tokens, counters)
    engines = [build_engine(target, engine_args(spec, k)) for _, spec, k in configs]
    for pname, prompt in prompts.items():
        for eng in engines:  # warm-up: kernels, caches, the prompt's prefix blocks
            run(eng, prompt, 8, 1)
        for i, eng in enumerate(engines):
            results[(pname, 1, i)] = run(eng, prompt, args.tokens, args.repeats)
    del engines
    if args.pp > 1:
        results.update(pipeline_runs(gguf, args.pp, configs, engine_args, prompts, args))
    rows = []
    for pname, prompt in prompts.items():
        for pp in sorted({1, args.pp}):
            base_tps, base_tokens = results[(pname, pp, 0)][:2]
            for i, (name, spec, k) in enumerate(configs):
                tps, tokens, c = results[(pname, pp, i)]
                drafts, accepted, verify = (c["spec_draft_tokens_total"], c["spec_accepted_tokens_total"],
                                            c["spec_verify_steps_total"])
                rows.append({
                    "prompt": pname, "pp": pp, "method": name, "k": k, "prompt_tokens": len(prompt),
                    "tokens": len(tokens), "decode_tok_s": round(tps, 2), "vs_plain": round(tps / base_tps, 3),
                    "acceptance": round(accepted / drafts, 3) if drafts else None,
                    "accepted_per_step": round(accepted / verify, 3) if verify else None,
                    "steps": c["steps_total"], "same_tokens": tokens == base_tokens,
                    "threads": torch.get_num_threads(),
                })
                if args.json:
                    print(json.dumps(rows[-1]), flush=True)
    if not args.json:
        print_table(rows, args.tokens)
    return 0 if all(r["same_tokens"] for r in rows) else 1


def pipeline_runs(gguf: Path, pp: int, configs, engine_args, prompts: dict, args) -> dict:
    """Every configuration over `pp` local worker processes: one engine at a time (a worker serves
    one head), warmed up on each prompt first."""
    import secrets

    from flotilla.runtime.pipeline.head import build_pipeline_engine
    from flotilla.runtime.pipeline.local import LocalWorkers
    from flotilla.runtime.pipeline.peer import LinkSettings
    from flotilla.runtime.pipeline.pipeline import PipelineSettings

    token = secrets.token_hex(16).encode()
    workers = LocalWorkers(pp, gguf, token, log=lambda line: None)
    settings = PipelineSettings(tuple(workers.start()), LinkSettings(token), dtype="float32")
    results = {}
    try:
        for i, (_, spec, k) in enumerate(configs):
            engine = build_pipeline_engine(gguf, engine_args(spec, k), settings, lambda line: None, device="cpu")
            try:
                for pname, prompt in prompts.items():
                    run(engine, prompt, 8, 1)
                    results[(pname, pp, i)] = run(engine, prompt, args.tokens, args.repeats)
            finally:
                engine.close()
    finally:
        workers.stop()
    return results


def print_table(rows: list[dict], tokens: int) -> None:
    print(f"SmolLM2-135M fp32 target on the CPU ({rows[0]['threads']} threads), batch 1, greedy, {tokens} tokens")
    head = f"{'prompt':<10} {'pp':>2} {'method':<18} {'k':>2} {'decode tok/s':>12} {'vs plain':>9} " \
           f"{'acceptance':>10} {'per step':>8} {'steps':>5} {'same':>5}"
    print(head)
    print("-" * len(head))
    for r in rows:
        acc = f"{r['acceptance']:.0%}" if r["acceptance"] is not None else "-"
        per = f"{r['accepted_per_step']:.2f}" if r["accepted_per_step"] is not None else "-"
        print(f"{r['prompt']:<10} {r['pp']:>2} {r['method']:<18} {r['k'] or '-':>2} {r['decode_tok_s']:>12.1f} "
              f"{r['vs_plain']:>8.2f}x {acc:>10} {per:>8} {r['steps']:>5} {'yes' if r['same_tokens'] else 'NO':>5}")


if __name__ == "__main__":
    sys.exit(main())
