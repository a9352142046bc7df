"""What pipeline parallelism costs on one machine: SmolLM2-135M INT4 on the CPU, stages as local
worker processes on loopback.

    python bench/pp_overhead.py                  # pp 1, 2, 3 x wire dtype fp16, int8
    python bench/pp_overhead.py --pp 1,3 --json

Rows, per pipeline depth and wire dtype (the peer, measured in the same run, is pp=1: the model
in this process, no network):

    single tok/s     one stream's decode rate (first token to last; --tokens tokens); against pp=1
                     with all cores, and against pp=1 with the threads one stage has (the workers
                     split this machine's cores; on separate machines each stage has its own)
    8-stream tok/s   aggregate rate of 8 concurrent streams, prefill included
    bytes/tok/hop    bytes on the wire per decode token on a stage-to-stage hop (the workers count
                     every frame they send; a hop carries hidden states, the largest traffic)
    agreement        for int8: greedy tokens equal to fp16's at the same position, over 32 prompts
                     (and how many of the 32 sequences are identical)

Targets (issue 7): pp=3 single-stream >= 0.8x pp=1; bytes/tok/hop <= hidden_size x 2 + 256.
On a shared 2-core machine the figures are provisional; the stages also share the cores, so the
8-stream row shows the pipeline's overhead, not the gain of more machines.
"""
from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the repository root instead of bench/ (python puts the script's folder first): bench/kernels.py
# would shadow the `kernels` package that transformers looks for when it loads the tokenizer
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

from bench.cpu_throughput import TOPICS  # noqa: E402  (the same 32 chat prompts)


def prompts_for(tok, n: int) -> list[list[int]]:
    return [tok.apply_chat_template([{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."}])
            for i in range(n)]


def run(engine, prompts, tokens: int) -> tuple[list[list[int]], float, float]:
    """Greedy, EOS ignored: (tokens per prompt, seconds from submit to last token, decode seconds of
    the first request: its first token to its last)."""
    from flotilla.runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    tag = f"{time.perf_counter_ns()}"
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    out: dict[str, list[int]] = {}
    start = time.perf_counter()
    first = last = None
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.request_id == f"{tag}-0" and o.new_token_ids:
                now = time.perf_counter()
                first = first or now
                last = now
    end = time.perf_counter()
    engine.block_manager.pool.reset_prefix_cache()
    return [out[f"{tag}-{i}"] for i in range(len(prompts))], end - start, (last or end) - (first or start)


def measure(engine, tok, tokens: int, streams: int) -> dict:
    run(engine, prompts_for(tok, 2), 4)  # warm-up
    _, _, decode = run(engine, prompts_for(tok, 1), tokens)
    _, wall, _ = run(engine, prompts_for(tok, streams), tokens)
    return {"single_tok_s": (tokens - 1) / decode, "multi_tok_s": streams * tokens / wall}


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, int]:
    same = sum(x == y for s, t in zip(a, b) for x, y in zip(s, t))
    return same / sum(len(s) for s in a), sum(s == t for s, t in zip(a, b))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", default="1,2,3")
    ap.add_argument("--wire", default="fp16,int8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--agreement-prompts", type=int, default=32)
    ap.add_argument("--agreement-tokens", type=int, default=32)
    ap.add_argument("--model", default=None, help="an INT4 checkpoint (default: RTN w4 g32 of the embedded GGUF)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of the pp=1 engine (default: all cores) and of every worker (default: the "
                         "cores split among the workers, as `runtime serve --pp N` does)")
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    args = ap.parse_args(argv)
    with ThreadPoolExecutor(1) as pool:  # engines compute off the main thread, as `runtime serve`'s does
        return pool.submit(bench, args).result()


def bench(args) -> int:
    import os

    import torch

    threads = args.threads or os.cpu_count()
    torch.set_num_threads(threads)  # explicitly: a thread other than the main one uses it only then
    from flotilla.models.tokenizer import load_tokenizer
    from flotilla.runtime.default_model import default_model_path
    from flotilla.runtime.engine_args import EngineArgs, build_engine
    from flotilla.runtime.loader import load_model
    from flotilla.runtime.pipeline.head import build_pipeline_engine
    from flotilla.runtime.pipeline.local import LocalWorkers
    from flotilla.runtime.pipeline.peer import LinkSettings
    from flotilla.runtime.pipeline.pipeline import PipelineSettings
    from bench.cpu_decode import int4_checkpoint

    model = Path(args.model) if args.model else int4_checkpoint(default_model_path(), 32)
    tok = load_tokenizer(model)
    engine_args = EngineArgs(kv_cache_memory="256MiB", max_num_seqs=max(args.streams, args.agreement_prompts),
                             max_num_batched_tokens=2048)
    depths, wires = [int(x) for x in args.pp.split(",")], args.wire.split(",")
    agree_prompts = prompts_for(tok, args.agreement_prompts)
    rows, base, greedy = [], None, {}
    silent = lambda line: None  # noqa: E731

    cores = len(os.sched_getaffinity(0))
    worker_threads = {pp: args.threads or max(1, cores // pp) for pp in depths if pp > 1}
    per_stage = {}  # pp=1 at each workers' thread count: what a stage would do on its own machine
    if 1 in depths:
        lm = load_model(model, "cpu", "float32", progress=False)
        engine = build_engine(lm, engine_args)
        base = measure(engine, tok, args.tokens, args.streams)
        greedy["pp1"] = run(engine, agree_prompts, args.agreement_tokens)[0]
        rows.append({"pp": 1, "wire": "-", **base, "bytes_per_token_hop": 0, "threads": threads})
        per_stage[threads] = base
        for t in sorted(set(worker_threads.values()) - {threads}):
            torch.set_num_threads(t)
            per_stage[t] = measure(engine, tok, args.tokens, args.streams)
            rows.append({"pp": 1, "wire": "-", **per_stage[t], "bytes_per_token_hop": 0, "threads": t})
        torch.set_num_threads(threads)
        del engine, lm
    token = secrets.token_hex(16).encode()
    for pp in (d for d in depths if d > 1):
        workers = LocalWorkers(pp, model, token, threads=args.threads, log=silent)
        hosts = workers.start()
        try:
            for wire in wires:
                settings = PipelineSettings(tuple(hosts), LinkSettings(token), wire_dtype=wire)
                engine = build_pipeline_engine(model, engine_args, settings, silent)
                try:
                    row = {"pp": pp, "wire": wire, **measure(engine, tok, args.tokens, args.streams)}
                    engine.executor.pipeline.worker_stats(reset=True)
                    run(engine, prompts_for(tok, 1), args.tokens)
                    hops = engine.executor.pipeline.worker_stats()[:-1]
                    row["bytes_per_token_hop"] = max(h.decode_bytes / max(1, h.decode_tokens) for h in hops)
                    greedy[f"pp{pp}-{wire}"] = run(engine, agree_prompts, args.agreement_tokens)[0]
                    row["split"] = [s.end - s.start for s in engine.executor.pipeline.stages]
                finally:
                    engine.close()
                row["threads"] = worker_threads[pp]
                if base:
                    row["single_vs_pp1"] = row["single_tok_s"] / base["single_tok_s"]
                    row["multi_vs_pp1"] = row["multi_tok_s"] / base["multi_tok_s"]
                    same = per_stage[worker_threads[pp]]
                    row["single_vs_pp1_same_threads"] = row["single_tok_s"] / same["single_tok_s"]
                ref = greedy.get(f"pp{pp}-fp16") if wire != "fp16" else greedy.get("pp1")
                if ref is not None:
                    row["agreement"], row["identical"] = agreement(ref, greedy[f"pp{pp}-{wire}"])
                    row["agreement_vs"] = "fp16" if wire != "fp16" else "pp1"
                rows.append(row)
        finally:
            workers.stop()
    hidden = load_model_config(model).hidden_size
    for r in rows:
        r.update(tokens=args.tokens, streams=args.streams, byte_budget=hidden * 2 + 256)
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"SmolLM2-135M INT4 on CPU ({cores} cores; pp>1: the cores split among the workers unless --threads), "
          f"stages as local worker processes on loopback; {args.tokens} tokens a stream; byte budget per decode "
          f"token per hop: {hidden * 2 + 256}. 'vs pp1 same thr.': against pp=1 with the threads one stage has, "
          f"i.e. as if every stage had its own machine")
    print(f"{'pp':>3s} {'thr':>3s} {'wire':>5s} {'split':>10s} {'single tok/s':>13s} {'vs pp1':>7s} "
          f"{'vs pp1 same thr.':>16s} {f'{args.streams}-stream tok/s':>15s} {'vs pp1':>7s} {'bytes/tok/hop':>14s} "
          f"{'agreement':>22s}")
    for r in rows:
        split = ",".join(map(str, r.get("split", []))) or "-"
        vs1 = f"{r['single_vs_pp1']:.2f}x" if "single_vs_pp1" in r else ""
        same = f"{r['single_vs_pp1_same_threads']:.2f}x" if "single_vs_pp1_same_threads" in r else ""
        vsn = f"{r['multi_vs_pp1']:.2f}x" if "multi_vs_pp1" in r else ""
        agree = (f"{r['agreement']:.1%} ({r['identical']}/{args.agreement_prompts}) vs {r['agreement_vs']}"
                 if "agreement" in r else "")
        print(f"{r['pp']:>3d} {r['threads']:>3d} {r['wire']:>5s} {split:>10s} {r['single_tok_s']:13.1f} {vs1:>7s} "
              f"{same:>16s} {r['multi_tok_s']:15.1f} {vsn:>7s} {r['bytes_per_token_hop']:14.0f} {agree:>22s}")
    return 0


def load_model_config(model: Path):
    from flotilla.models.sources import open_source

    return open_source(model).config


if __name__ == "__main__":
    sys.exit(main())
