"""The engine's own host time per decode step, with a forward that costs nothing.

    python bench/step_host.py                 # table: batch 1 and 16, phases in µs per step
    python bench/step_host.py --batches 1,64 --steps 2000 --json

What runs: the whole engine (scheduler, step input, the CUDA-graph runner's static-input fill,
sampler, output processing with SmolLM2's detokenizer and a stop string) over the tiny random
Llama, on the CPU, with the decode graphs' host path (`DecodeGraphRunner(capture=False)`) and
every graph "replay" answered by a precomputed logits tensor (64 ordinary tokens in turn): the GPU's work is taken out, what is
left is what the host does between two launches on a GPU. Each phase is timed by wrapping the
method that does it; `other` is the step's wall time not inside any of them (the engine's own
glue). Decode steps only: the prefill is done before the clock starts. Each row is the best of
`--repeats` runs, as mean µs per step. The clock is the thread's CPU time by default (what the
host's work costs, whatever else shares the machine; the timers themselves add ~0.5 µs a call);
`--clock wall` reads the wall clock instead.

Rows: `sync` is the engine with every step waiting for its sampled ids before the next is
built; `overlap` launches step N+1 before reading step N's ids (the default on CUDA).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from flotilla.runtime.cuda_graphs import BUCKETS, DecodeGraphRunner, bucket_for  # noqa: E402
from flotilla.runtime.engine import EngineConfig, LLMEngine  # noqa: E402
from flotilla.runtime.kv_cache import KVCache, KVCacheSpec  # noqa: E402
from flotilla.runtime.model_runner import ModelRunner  # noqa: E402
from flotilla.runtime.random_model import build_random_model  # noqa: E402
from flotilla.runtime.sampling import SamplingParams  # noqa: E402
from flotilla.runtime.scheduler import SchedulerConfig  # noqa: E402

PHASES = ["schedule", "step input", "fill static inputs", "sample", "wait for ids", "postprocess"]


def instrument(engine: LLMEngine, clock: "Clock") -> None:
    """Wrap the methods that do each phase (those this engine has)."""
    runner = engine.executor
    clock.wrap(engine.scheduler, "schedule", "schedule")
    clock.wrap(engine.scheduler, "schedule_ahead", "schedule")
    clock.wrap(engine, "_step_input", "step input")
    clock.wrap(engine, "_ahead_input", "step input")
    for bucket in runner.graphs.buckets.values():
        clock.wrap(bucket.inputs, "fill", "fill static inputs")
    clock.wrap(runner.sampler, "sample_ids", "sample")
    if not hasattr(runner.sampler, "sample_ids"):
        runner.sampler = _Timed(runner.sampler, clock, "sample")
    clock.wrap(engine, "_wait", "wait for ids")
    clock.wrap(engine, "_postprocess", "postprocess")


class _Timed:
    """A callable's stand-in that times its calls (for a sampler called as `self.sampler(...)`)."""

    def __init__(self, fn, clock: "Clock", phase: str):
        self.fn, self.total, self.phase, self.now = fn, clock.total, phase, clock.now
        self.total.setdefault(phase, 0.0)

    def __call__(self, *a, **kw):
        t = self.now()
        try:
            return self.fn(*a, **kw)
        finally:
            self.total[self.phase] += self.now() - t

    def __getattr__(self, name):
        return getattr(self.fn, name)


class Clock:
    """Accumulates the time spent inside wrapped methods, per phase (not re-entrant per phase)."""

    def __init__(self, now=time.thread_time):
        self.total: dict[str, float] = {}
        self.now = now

    def wrap(self, obj, name: str, phase: str) -> None:
        fn = getattr(obj, name, None)
        if fn is None:
            return
        total, now = self.total, self.now
        total.setdefault(phase, 0.0)

        def timed(*a, **kw):
            t = now()
            try:
                return fn(*a, **kw)
            finally:
                total[phase] += now() - t

        setattr(obj, name, timed)

    def reset(self) -> None:
        for k in self.total:
            self.total[k] = 0.0


def build(batch: int, max_model_len: int, overlap: bool | None, tokenizer) -> LLMEngine:
    model = build_random_model("tiny", 16, "cpu", torch.float32, num_layers=1)
    cfg = model.config
    block_size = 16
    spec = KVCacheSpec(tuple(model.stage.layers), cfg.num_key_value_heads, cfg.head_dim, torch.float32, block_size)
    num_blocks = batch * -(-max_model_len // block_size) + 1
    cache = KVCache(spec, num_blocks, torch.device("cpu"))
    runner = ModelRunner(model, cache, max_model_len=max_model_len)
    bucket = bucket_for(batch, BUCKETS)
    shared = {"sampled": runner.sampled} if hasattr(runner, "sampled") else {}  # (an engine without overlap: none)
    runner.graphs = DecodeGraphRunner(model, cache, (bucket,), max_model_len, runner.scale, capture=False, **shared)
    # the "GPU's" output: step k samples token 300 + k % 64 for every row (ordinary text pieces of
    # SmolLM2's vocabulary, so the detokenizer does its usual work)
    logits = torch.zeros(64, bucket, cfg.vocab_size)
    logits[torch.arange(64), :, 300 + torch.arange(64)] = 1.0
    calls = itertools.count()
    for b in runner.graphs.buckets.values():
        b.replay = lambda: logits[next(calls) % 64]
    kw = {} if overlap is None else {"overlap": overlap}
    config = EngineConfig(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                          scheduler=SchedulerConfig(max(batch, 64), 1024), enable_prefix_caching=True, **kw)
    engine = LLMEngine(runner, config, tokenizer, (), cfg.vocab_size)
    return engine


def run(engine: LLMEngine, batch: int, steps: int, prompt_len: int, clock: Clock, seed: int) -> dict[str, float]:
    """µs per decode step, by phase, over `steps` steps after the prefill."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True, stop=["<|stop here|>"])
    gen = torch.Generator().manual_seed(seed)
    for i in range(batch):
        engine.add_request(f"s{seed}-{i}", torch.randint(1, 500, (prompt_len,), generator=gen).tolist(), params)
    while engine.stats().generation_tokens_total < batch:  # the prefill: every stream has its first token
        engine.step()
    for _ in range(4):
        engine.step()
    clock.reset()
    t = clock.now()
    for _ in range(steps):
        engine.step()
    wall = clock.now() - t
    for rid in list(engine.seqs):
        engine.abort(rid)
    while engine.has_unfinished():  # an overlapped step still in flight
        engine.step()
    row = {phase: 1e6 * v / steps for phase, v in clock.total.items()}
    row["other (engine glue)"] = 1e6 * wall / steps - sum(row.values())
    row["step"] = 1e6 * wall / steps  # (the clock's: CPU time by default)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=4096, help="block tables as wide as a served context")
    ap.add_argument("--modes", default="sync,overlap", help="sync, overlap, or both")
    ap.add_argument("--no-tokenizer", action="store_true", help="no detokenization (token ids only)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="the thread's CPU time, or wall time")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    now = time.thread_time if args.clock == "cpu" else time.perf_counter
    tokenizer = None
    if not args.no_tokenizer:
        from flotilla.models.tokenizer import load_tokenizer
        from flotilla.runtime.default_model import default_model_path
        tokenizer = load_tokenizer(default_model_path())
    modes = [m for m in args.modes.split(",") if m]
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for mode in modes:
            best = None
            for rep in range(args.repeats):
                try:
                    engine = build(batch, args.max_model_len, mode == "overlap", tokenizer)
                except TypeError:  # an engine without the overlap option
                    if mode == "overlap":
                        break
                    engine = build(batch, args.max_model_len, None, tokenizer)
                clock = Clock(now)
                instrument(engine, clock)
                with torch.inference_mode():
                    row = run(engine, batch, args.steps, args.prompt_len, clock, rep)
                if best is None or row["step"] < best["step"]:
                    best = row
            if best is not None:
                rows.append({"batch": batch, "mode": mode, **best})
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    phases = [p for p in PHASES + ["other (engine glue)", "step"] if any(p in r for r in rows)]
    print(f"µs per decode step ({'CPU' if args.clock == 'cpu' else 'wall'} time of the host's work; the forward is a "
          f"precomputed tensor)")
    print("| " + " | ".join(["batch", "mode"] + phases) + " |")
    print("|" + "---|" * (len(phases) + 2))
    for r in rows:
        print("| " + " | ".join([str(r["batch"]), r["mode"]] + [f"{r[p]:.1f}" if p in r else "" for p in phases]) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
