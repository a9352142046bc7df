"""Aggregate throughput and time to first token on the CPU: the engine against transformers.

    python bench/cpu_throughput.py                         # 1, 8 and 32 concurrent streams
    python bench/cpu_throughput.py --streams 1,8,32 --tokens 64 --json

Throughput rows: N different chat prompts submitted at once, each generating --tokens tokens
greedily (EOS ignored); aggregate tok/s = N * tokens / wall time from submission to the last
token (prefill included). The peer, in the same run, is transformers' batched `generate` on the
same prompts, left-padded into one batch of N (fp32 eager; transformers cannot run our GPTQ
checkpoint without extra packages, so it runs the same model's fp32 weights).

TTFT rows: a 512-token document + a question, on a fresh engine (cold: the whole prompt is
computed), then a different question after the same document (warm: the 512 tokens come from the
prefix cache, only the question is computed). Time from submission to the first token, median of
--repeats.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]  # not bench/: its kernels.py would shadow the `kernels` package transformers probes for

TOPICS = ["the ocean", "a robot", "Paris", "mathematics", "a cat", "the moon", "coffee", "winter", "a library",
          "music", "trains", "volcanoes", "bread", "chess", "rain", "the internet", "bicycles", "honey",
          "glaciers", "a violin", "deserts", "owls", "lighthouses", "tea", "origami", "comets", "gardens",
          "a bridge", "whales", "clocks", "maps", "snow"]


def prompts_for(tok, n: int) -> list[list[int]]:
    return [tok.apply_chat_template([{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."
                                      + (f" (variant {i // len(TOPICS)})" if i >= len(TOPICS) else "")}])
            for i in range(n)]


def ours_throughput(engine, prompts, tokens: int) -> float:
    from flotilla.runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"t{len(prompts)}-{i}-{start}", p, params)
    n = 0
    while engine.has_unfinished():
        n += sum(len(o.new_token_ids) for o in engine.step())
    assert n == len(prompts) * tokens
    engine.block_manager.pool.reset_prefix_cache()
    return n / (time.perf_counter() - start)


def transformers_throughput(model, tok, prompts, tokens: int) -> float:
    import torch

    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, pad_token_id=pad)
    elapsed = time.perf_counter() - start
    return (out.shape[1] - width) * len(prompts) / elapsed


def ttft(engine, prompt: list[int]) -> float:
    from flotilla.runtime.sampling import SamplingParams

    engine.add_request(f"ttft-{time.perf_counter()}", prompt, SamplingParams(max_tokens=1, temperature=0))
    start = time.perf_counter()
    while engine.has_unfinished():
        if engine.step():
            break
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def ttft_rows(build, tok, repeats: int) -> list[dict]:
    doc_text = " ".join(f"Note {i}: the harbour lights were checked at dusk and logged in the book." for i in range(80))
    doc = tok.encode(doc_text, add_special_tokens=False)[:512]
    questions = [tok.encode(f" Question {i}: what was checked at dusk? Answer:", add_special_tokens=False)
                 for i in range(repeats + 1)]
    cold, warm = [], []
    for r in range(repeats):
        engine = build()
        cold.append(ttft(engine, doc + questions[0]))
        warm.append(ttft(engine, doc + questions[r + 1]))
        assert engine.stats().cached_tokens_total == 512
    c, w = statistics.median(cold), statistics.median(warm)
    return [{"row": "ttft", "case": "512-token prefix, cold", "ttft_ms": c * 1e3},
            {"row": "ttft", "case": "512-token prefix, cached", "ttft_ms": w * 1e3, "speedup": c / w}]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="TTFT repeats")
    ap.add_argument("--int4", default=None, help="an INT4 checkpoint (default: RTN w4 g64 of the GGUF, made once: bench/rtn_checkpoint.py)")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from flotilla.models.linear import QuantLinear
    from flotilla.runtime.default_model import default_model_path
    from flotilla.runtime.engine_args import EngineArgs, build_engine
    from flotilla.runtime.loader import load_model
    from bench.cpu_decode import int4_checkpoint

    gguf = default_model_path()
    lm = load_model(Path(args.int4) if args.int4 else int4_checkpoint(gguf, 64), "cpu", "float32", progress=False)
    kernel = sorted({getattr(m.kernel, "name", "?") for m in lm.model.modules() if isinstance(m, QuantLinear)})
    streams = [int(s) for s in args.streams.split(",")]

    def build():
        return build_engine(lm, EngineArgs(kv_cache_memory="512MiB", max_num_seqs=max(streams),
                                           max_num_batched_tokens=2048))

    hf = hf_tok = None
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        hf_tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()

    rows, engine = [], build()
    ours_throughput(engine, prompts_for(lm.tokenizer, 2), 4)  # warm-up (first-call allocations)
    if hf is not None:
        transformers_throughput(hf, hf_tok, prompts_for(lm.tokenizer, 2), 4)
    ours_tag = f"flotilla INT4 ({', '.join(kernel)} kernel)"
    single = None
    for n in streams:
        prompts = prompts_for(lm.tokenizer, n)
        tps = ours_throughput(engine, prompts, args.tokens)
        single = single or (tps if n == 1 else None)
        row = {"row": "throughput", "streams": n, "impl": ours_tag, "tok_s": tps}
        if single:
            row["vs_single_stream"] = tps / single
        if hf is not None:
            peer = transformers_throughput(hf, hf_tok, prompts, args.tokens)
            rows.append({"row": "throughput", "streams": n, "impl": "transformers fp32 generate (padded batch)",
                         "tok_s": peer})
            row["vs_transformers"] = tps / peer
        rows.append(row)
    rows += ttft_rows(build, lm.tokenizer, args.repeats)
    for r in rows:
        r.update(threads=args.threads, tokens=args.tokens)
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"SmolLM2-135M on CPU, {args.threads} threads, {args.tokens} tokens per stream")
    print(f"{'streams':>7s}  {'implementation':48s} {'tok/s':>8s} {'vs transformers':>16s} {'vs 1 stream':>12s}")
    for r in rows:
        if r["row"] == "throughput":
            vt = f"{r['vs_transformers']:.2f}x" if "vs_transformers" in r else ""
            vs = f"{r['vs_single_stream']:.2f}x" if "vs_single_stream" in r else ""
            print(f"{r['streams']:>7d}  {r['impl']:48s} {r['tok_s']:8.1f} {vt:>16s} {vs:>12s}")
    print(f"\n{'time to first token':48s} {'ms':>8s} {'speedup':>8s}")
    for r in rows:
        if r["row"] == "ttft":
            sp = f"{r['speedup']:.1f}x" if "speedup" in r else ""
            print(f"{r['case']:48s} {r['ttft_ms']:8.1f} {sp:>8s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
