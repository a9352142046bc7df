"""Tensor parallel: TP=1 against TP=N (default 2) through the engine, in the same run.

    python3 bench/tp_cpu.py                          # the table
    python3 bench/tp_cpu.py --json                   # one JSON object per row
    python3 bench/tp_cpu.py --model CKPT --tp 3      # any model whose heads divide (SmolLM2: 3)
    python3 bench/tp_cpu.py --device cuda --model CKPT   # NCCL: rank r on cuda:r, fp16

On the CPU the ranks are processes on one host joined by gloo; with --device cuda TP=1 runs on
cuda:0 and TP=N on cuda:0..N-1, joined by NCCL (e.g. the llama-3-8b checkpoint of
bench/random_checkpoint.py, written on the GPU machine itself). Rows: TP=1 and TP=N, each with one stream and with
--streams concurrent streams (greedy, EOS ignored). The same --threads cores are used either way:
TP=1 runs them in one process, TP=N gives each rank threads / N.

The default model is SmolLM2-135M's shape with heads that halve (SmolLM2's own 9 heads do not
divide by 2): hidden 512, 8 heads x 64, 4 KV heads, intermediate 1536, 30 layers, vocabulary
49152 (SmolLM2's tokenizer), tied embeddings; random weights, RTN INT4 (group 64, symmetric),
made once under $FLOTILLA_CACHE_DIR/bench/.

Decode tok/s counts the tokens of the steps after the one that sampled every stream's first
token, over their time; the best of --repeats. `vs TP=1` divides by the TP=1 row with the same
streams; `agree` is how many leading tokens of stream 0 equal TP=1's. Each step of TP=N costs
2 x layers + 1 all-reduces of [streams, hidden] and one gather of the logits.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]  # not bench/: its kernels.py would shadow the `kernels` package transformers probes for

SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True,
             rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def default_model() -> Path:
    """The SmolLM2-shaped INT4 checkpoint, made once."""
    from bench.rtn_checkpoint import write_rtn_checkpoint
    from flotilla.envs import cache_dir

    path = cache_dir() / "bench" / "tp-llama-512x30-rtn-w4g64s"
    if path.is_dir():
        return path
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from flotilla.models.tokenizer import load_tokenizer
    from flotilla.runtime.default_model import default_model_path

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE), dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        load_tokenizer(default_model_path()).save(Path(tmp))
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_rtn_checkpoint(tmp, path, 4, 64, True)


def prompts(n: int) -> list[list[int]]:
    return [[1] + [(97 * s + 31 * i) % 40000 + 100 for i in range(24)] for s in range(n)]


def run(model: Path, tp: int, streams_list: list[int], tokens: int, repeats: int, device: str = "cpu") -> list[dict]:
    import torch

    from flotilla.runtime.engine_args import EngineArgs, build_engine
    from flotilla.runtime.sampling import SamplingParams
    from flotilla.runtime.tp import load_model_parallel

    lm = load_model_parallel(model, device, "float32" if device == "cpu" else "float16", tp=tp,
                             with_tokenizer=False, progress=False)
    rows = []
    try:
        engine = build_engine(lm, EngineArgs(kv_cache_memory="256MiB", max_num_seqs=max(streams_list),
                                             max_num_batched_tokens=2048))
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        for streams in streams_list:
            best, first = 0.0, []
            with torch.inference_mode():
                for r in range(repeats):
                    ids = [f"{streams}-{r}-{s}" for s in range(streams)]
                    for rid, p in zip(ids, prompts(streams)):
                        engine.add_request(rid, p, params)
                    stamps, counts, out0 = [], [], []
                    while engine.has_unfinished():
                        outs = engine.step()
                        stamps.append(time.perf_counter())
                        counts.append(sum(len(o.new_token_ids) for o in outs))
                        out0 += [t for o in outs if o.request_id == ids[0] for t in o.new_token_ids]
                    start = next(i for i in range(len(counts)) if sum(counts[:i + 1]) >= streams)  # all have one
                    best = max(best, sum(counts[start + 1:]) / (stamps[-1] - stamps[start]))
                    first = out0
                    engine.block_manager.pool.reset_prefix_cache()
            rows.append({"tp": tp, "streams": streams, "tok_s": best, "tokens_out": first,
                         "threads_per_rank": torch.get_num_threads()})
    finally:
        if lm.parallel is not None:
            lm.parallel.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a checkpoint (default: the SmolLM2-shaped INT4 model, made once)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="cores in all: TP=N gives each rank threads / N")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch

    model = args.model or default_model()
    rows = []
    for tp in (1, args.tp):
        torch.set_num_threads(args.threads)  # load_model_parallel divides it among the ranks
        rows += run(model, tp, [1, args.streams], args.tokens, args.repeats, args.device)
    peers = {r["streams"]: r for r in rows if r["tp"] == 1}
    for r in rows:
        peer = peers[r["streams"]]
        got, ref = r["tokens_out"], peer["tokens_out"]
        r.update(model=model.name, device=args.device, threads=args.threads, tokens=args.tokens, vs_tp1=r["tok_s"] / peer["tok_s"],
                 agree=next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref))))
    for r in rows:
        r.pop("tokens_out", None)
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"{args.device.upper()} tensor parallel, {model.name}: {args.tokens} tokens a stream, {args.threads} cores in all, "
          f"best of {args.repeats}")
    print(f"{'TP':>3s} {'streams':>8s} {'threads/rank':>13s} {'decode tok/s':>13s} {'vs TP=1':>8s} {'agree':>7s}")
    for r in rows:
        print(f"{r['tp']:>3d} {r['streams']:>8d} {r['threads_per_rank']:>13d} {r['tok_s']:>13.1f} "
              f"{r['vs_tp1']:>7.2f}x {r['agree']:>4d}/{args.tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
