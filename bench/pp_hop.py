"""The pipeline ring's own latency: µs per hop of a decode step, with a model that computes almost
nothing, against pp=1 in the same run (issue 19's per-hop cost, measured on a CPU).

    python bench/pp_hop.py                       # tiny random INT4 model, pp=1 vs pp=2 (local CPU workers)
    python bench/pp_hop.py --pp 2,3 --tokens 256 --repeats 5 --json
    python bench/pp_hop.py --device cuda:0        # GPU stages (all on that GPU) and pp=1 there
    python bench/pp_hop.py --spin-us 0,auto --micro-batches 0,2   # each ring with and without polling, ...

The model is the `tiny` random shape (hidden 128, --layers layers, INT4 g128; written to a temporary
directory), so a stage's compute is a few hundred µs and what remains of a token's time is the ring:
the head's scheduling and encoding, every frame's MAC and msgpack, the sockets, and the wake-ups
of threads and event loops between them. Rows, each the median of --repeats runs of one stream of
--tokens greedy tokens (EOS ignored):

    ms/token       one stream's decode time per token (first token to last)
    stages ms      the stages' compute per step, summed (the workers time each step: input, layers, output)
    µs/hop         (ms/token - stages ms) / hops, hops = pp + 1 (head -> stage 0 -> ... -> head), or pp
                   when overlapped (--overlap: last stage -> stage 0, the head off the ring); for pp=1,
                   ms/token - its own compute (the engine's overhead per step: schedule, sample, postprocess)
    over pp1 µs/hop (ms/token - pp1's ms/token) / hops: what the ring adds per hop beyond what pp=1 costs
    N-stream tok/s  --streams concurrent greedy streams, aggregate tokens per second (prefill included)
    identical       of the --streams streams and the single stream (an untimed run of each, with each
                    step's top-2 logprobs), those whose tokens equal pp=1's; "+K tie": K more that
                    diverge at a near-tie (below)

A ring need not be bit-equal to pp=1: hidden states cross the wire in fp16 (a CPU stage computes
in fp32: the wire rounds them), and a GPU's matmuls pick their tiles by the number of rows, which
the micro-batches change. On a random tiny model the logits are nearly flat (top-2 margins of
1e-5 nats occur), so greedy argmax can flip there. A stream that diverges counts as a tie when, at
its first differing token, the ring picked pp=1's second choice and pp=1's top-2 margin is below
the run's noise: the largest |logprob difference| of the chosen token over the steps where the two
runs still agree (and below TIE_LIMIT); anything else is a mismatch. Each divergence is printed
with its margin and the noise (bench/NOTES-gpu-pipeline.md, "Ties").

Each ring runs once per --spin-us value (the workers and the head poll that long before sleeping,
spin.py; auto: as `runtime serve` decides, by the cores to spare) and --micro-batches value (kept
in flight; 0: one per stage that can compute at once, stages on one GPU counting once).

On a shared machine the figures move with the load (the load average is printed); compare rows of
one run. Workers get --threads threads each (default 1), and so does pp=1.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]


def engine_args(streams: int, overlap: bool = True):
    from flotilla.runtime.engine_args import EngineArgs

    return EngineArgs(kv_cache_memory="64MiB", max_num_seqs=max(streams, 1), max_num_batched_tokens=256,
                      max_model_len=1024, enable_prefix_caching=False, overlap=overlap)


TIE_LIMIT = 0.02  # nats: a divergence at a larger top-2 margin is a mismatch whatever the noise


def run_stream(engine, prompts: list[list[int]], tokens: int, top: int = 0):
    """Greedy, EOS ignored: (seconds per decode token of the first stream, aggregate tok/s, tokens,
    each token's top-`top` (token, logprob) when top > 0)."""
    from flotilla.runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=top > 0, top_logprobs=top)
    tag = time.perf_counter_ns()
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    tops: dict[str, list] = {rid: [] for rid in ids}
    begin = time.perf_counter()
    first = last = None
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            tops[o.request_id] += o.top_logprobs or []
            if o.request_id == ids[0] and o.new_token_ids:
                last = time.perf_counter()
                first = first or last
    end = time.perf_counter()
    per_token = (last - first) / max(1, len(out[ids[0]]) - 1)
    return per_token, sum(map(len, out.values())) / (end - begin), [out[r] for r in ids], [tops[r] for r in ids]


def check_run(engine, prompts, args) -> tuple[list[list[int]], list]:
    """Untimed: the tokens and top-2 logprobs of the --streams streams together and of the first alone."""
    _, _, tokens, tops = run_stream(engine, prompts, args.tokens, top=2)
    _, _, single, single_tops = run_stream(engine, prompts[:1], args.tokens, top=2)
    return tokens + single, tops + single_tops


def agreement(ref: tuple[list, list], got: tuple[list, list]) -> dict:
    """Streams equal to pp=1's; the divergences, each a tie or a mismatch (see the docstring)."""
    (ref_tokens, ref_tops), (tokens, tops) = ref, got
    noise = 0.0  # the largest |logprob difference| of the chosen token where the runs agree
    firsts = []
    for a, b, ta, tb in zip(ref_tokens, tokens, ref_tops, tops):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        firsts.append(k)
        for pa, pb in zip(ta[:k] if k is not None else ta, tb):
            noise = max(noise, abs(pa[0][1] - pb[0][1]))
    divergences = []
    for stream, k in enumerate(firsts):
        if k is None:
            continue
        (best, lp1), (second, lp2) = ref_tops[stream][k][:2]
        margin = lp1 - lp2
        tie = tokens[stream][k] == second and margin <= min(noise, TIE_LIMIT)
        divergences.append({"stream": stream, "token": k, "pp1": best, "ring": tokens[stream][k],
                            "pp1_margin": margin, "tie": tie})
    return {"identical": firsts.count(None), "ties": sum(d["tie"] for d in divergences),
            "noise": noise, "divergences": divergences}


def measure(engine, prompts, args, stats=None) -> dict:
    """Median over --repeats single-stream runs; `stats()` -> the workers' (compute seconds, steps)."""
    run_stream(engine, prompts[:2], 8)  # warm-up
    per_token, compute = [], []
    for _ in range(args.repeats):
        before = stats() if stats else (0.0, 0)
        t = run_stream(engine, prompts[:1], args.tokens)[0]
        per_token.append(t)
        if stats:
            after = stats()
            compute.append((after[0] - before[0]) / max(1, after[1] - before[1]))
    multi = [run_stream(engine, prompts, args.tokens) for _ in range(max(1, args.repeats // 2))]
    return {"ms_per_token": statistics.median(per_token) * 1e3,
            "stage_ms": statistics.median(compute) * 1e3 if compute else None,
            "multi_tok_s": statistics.median(m[1] for m in multi), "check": check_run(engine, prompts, args)}


def pp1_row(checkpoint: Path, prompts, args) -> dict:
    import torch

    from flotilla.runtime.engine_args import build_engine
    from flotilla.runtime.loader import load_model

    torch.set_num_threads(args.threads)
    lm = load_model(checkpoint, args.device, "float32" if args.device == "cpu" else None, with_tokenizer=False,
                    progress=False)
    engine = build_engine(lm, engine_args(args.streams))
    runner = engine.executor
    compute = [0.0, 0]
    execute = runner.execute

    def timed(step):  # the model's own time per step, as a worker counts it
        t = time.perf_counter()
        try:
            return execute(step)
        finally:
            compute[0] += time.perf_counter() - t
            compute[1] += 1

    runner.execute = timed
    row = measure(engine, prompts, args, lambda: tuple(compute))
    row.update(pp=1, hops=0, us_per_hop=(row["ms_per_token"] - row["stage_ms"]) * 1e3)
    return row


def ring_row(checkpoint: Path, pp: int, spin_us: int | None, micro_batches: int, overlap: bool, prompts, args,
             base: dict) -> dict:
    from flotilla.runtime.pipeline.head import build_pipeline_engine
    from flotilla.runtime.pipeline.local import LocalWorkers
    from flotilla.runtime.pipeline.peer import LinkSettings
    from flotilla.runtime.pipeline.pipeline import PipelineSettings

    token = secrets.token_hex(16).encode()
    workers = LocalWorkers(pp, checkpoint, token, devices=[args.device] * pp, threads=args.threads,
                           log=lambda line: None, spin_us=spin_us)
    engine = None
    try:
        hosts = workers.start()
        settings = PipelineSettings(tuple(hosts), LinkSettings(token), spin_us=workers.spin_us,
                                    micro_batches=micro_batches)
        engine = build_pipeline_engine(checkpoint, engine_args(args.streams, overlap), settings, lambda line: None,
                                       with_tokenizer=False)
        pipeline = engine.executor.pipeline

        def stats():
            s = pipeline.worker_stats()
            return sum(w.compute_seconds for w in s), s[0].steps

        row = measure(engine, prompts, args, stats)
        hops = pp if engine.overlap else pp + 1  # overlapped: last stage -> stage 0, the head off the ring
        row.update(pp=pp, hops=hops, spin_us=workers.spin_us, micro_batches=pipeline.depth, overlap=engine.overlap,
                   steps_ahead=engine.num_ahead, us_per_hop=(row["ms_per_token"] - row["stage_ms"]) / hops * 1e3,
                   over_pp1_us_per_hop=(row["ms_per_token"] - base["ms_per_token"]) / hops * 1e3,
                   single_vs_pp1=base["ms_per_token"] / row["ms_per_token"],
                   multi_vs_pp1=row["multi_tok_s"] / base["multi_tok_s"], **agreement(base["check"], row["check"]))
        return row
    finally:
        if engine is not None:
            engine.close()
        workers.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", default="2", help="pipeline depths besides pp=1, comma-separated")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the largest --pp)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of pp=1 and of each worker")
    ap.add_argument("--device", default="cpu", help="pp=1's device and every stage's (e.g. cuda:0: stages share it)")
    ap.add_argument("--seed", type=int, default=0, help="the random checkpoint's and the prompts' seed")
    ap.add_argument("--spin-us", default="auto", help="comma-separated: µs the workers and the head poll before "
                    "sleeping, or auto; each ring runs once per value")
    ap.add_argument("--micro-batches", default="0", help="comma-separated: micro-batches in flight (0: automatic); "
                    "each ring runs once per value")
    ap.add_argument("--overlap", default="on", help="comma-separated on/off: decodes sent before the step before is "
                    "read (with one micro-batch in flight); each ring runs once per value")
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    args = ap.parse_args(argv)
    from flotilla.runtime.random_model import write_random_checkpoint

    depths = [int(x) for x in args.pp.split(",") if x]
    layers = args.layers or max(depths + [2])
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="flotilla-hop-") as tmp:
        checkpoint = write_random_checkpoint("tiny", Path(tmp) / "tiny", 4, 128, args.seed, "cpu", layers)
        vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
        prompts = [[rng.randrange(vocab) for _ in range(16)] for _ in range(args.streams)]
        base = pp1_row(checkpoint, prompts, args)
        rows = [base] + [ring_row(checkpoint, pp, spin, mb, overlap, prompts, args, base) for pp in depths
                         for spin in [None if v == "auto" else int(v) for v in args.spin_us.split(",")]
                         for mb in [int(v) for v in args.micro_batches.split(",")]
                         for overlap in [{"on": True, "off": False}[v] for v in args.overlap.split(",")]]
    load = os.getloadavg()
    for r in rows:
        r.update(tokens_per_stream=args.tokens, streams=args.streams, repeats=args.repeats, threads=args.threads,
                 device=args.device, load_avg=[round(x, 2) for x in load])
        r.pop("check")
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"tiny random INT4 model ({layers} layers), local workers on {args.device} over loopback, "
          f"{args.threads} thread(s) a "
          f"stage; one stream of {args.tokens} tokens (median of {args.repeats}); load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'pp':>3s} {'spin µs':>7s} {'mb':>2s} {'ovl':>3s} {'ms/token':>9s} {'tok/s':>7s} {'x pp1':>6s} {'stages ms':>10s} {'µs/hop':>7s} "
          f"{'over pp1 µs/hop':>16s} {f'{args.streams}-stream tok/s':>15s} {'x pp1':>6s} {'identical':>15s}")
    for r in rows:
        ring = r["pp"] > 1
        print(f"{r['pp']:>3d} {r['spin_us'] if ring else '-':>7} {r['micro_batches'] if ring else '-':>2} "
              f"{('on' if r['overlap'] else 'off') if ring else '-':>3} "
              f"{r['ms_per_token']:9.3f} {1e3 / r['ms_per_token']:7.1f} "
              f"{r['single_vs_pp1'] if ring else 1.0:5.2f}x {r['stage_ms']:10.3f} {r['us_per_hop']:7.0f} "
              f"{r['over_pp1_us_per_hop'] if ring else 0:16.0f} {r['multi_tok_s']:15.1f} "
              f"{r['multi_vs_pp1'] if ring else 1.0:5.2f}x "
              f"{same(r) if ring else '-':>15s}")
    for r in rows[1:]:
        for d in r["divergences"]:
            print(f"pp={r['pp']} (spin {r['spin_us']}, {r['micro_batches']} mb) stream {d['stream']}{' (alone)' if d['stream'] == args.streams else ''}: first "
                  f"differs at token {d['token']} ({d['ring']} for pp=1's {d['pp1']}); pp=1's top-2 margin there "
                  f"{d['pp1_margin']:.1e} nats, the run's noise {r['noise']:.1e}: "
                  f"{'a near-tie' if d['tie'] else 'A MISMATCH'}")
    return 0


def same(row: dict) -> str:
    ties = f" +{row['ties']} tie" if row["ties"] else ""
    return f"{row['identical']}/{row['streams'] + 1}{ties}"


if __name__ == "__main__":
    sys.exit(main())
