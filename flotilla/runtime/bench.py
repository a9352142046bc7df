"""`runtime bench`: decode throughput of the engine, on a random-weight model of a named shape
(no checkpoint needed) or on a model path.

    runtime bench --random llama-3-8b --bits 4 --batch 1,16,64 --tokens 128

For each batch size B: B requests of `--prompt-len` random tokens, each generating `--tokens`
tokens greedily (EOS ignored), through the whole engine (scheduler, runner, CUDA graphs on a GPU,
sampler). The prompts are prefilled in one step; the clock runs over the decode steps only, from
the end of the step that gave every request its first token to the last token. A short round on
the same engine warms it up first. Prints aggregate tok/s, tok/s per stream and ms per step;
`--json` prints one JSON object per batch size. On a GPU the engine overlaps decode steps (each
launched before the last one's tokens are read); `--no-overlap` measures it without.
"""
from __future__ import annotations

import argparse
import json
import random
import time
import dataclasses
from dataclasses import asdict, dataclass

import torch

from flotilla.errors import FlotillaError
from flotilla.models.llama import CausalLM

from .cuda_graphs import BUCKETS, bucket_for
from .engine import EngineConfig, LLMEngine
from .kv_cache import KVCache, KVCacheSpec, hybrid_groups
from .model_runner import ModelRunner
from .random_model import (BITS, GGUF_MIXES, SHAPES, build_random_gguf_model, build_random_model, gguf_mix,
                           weight_bytes)
from .sampling import SamplingParams
from .scheduler import SchedulerConfig


@dataclass(frozen=True)
class DecodeRun:
    batch: int
    prompt_len: int
    decode_tokens: int  # tokens generated inside the timed window, all streams together
    decode_steps: int
    seconds: float
    graphs: bool
    overlap: bool = False

    @property
    def tok_s(self) -> float:
        """Aggregate decode tokens per second over all streams."""
        return self.decode_tokens / self.seconds

    @property
    def tok_s_per_stream(self) -> float:
        return self.tok_s / self.batch

    @property
    def ms_per_step(self) -> float:
        return 1000 * self.seconds / max(1, self.decode_steps)

    def row(self) -> dict:
        return {**asdict(self), "tok_s": self.tok_s, "tok_s_per_stream": self.tok_s_per_stream,
                "ms_per_step": self.ms_per_step}


def bench_engine(model: CausalLM, batch: int, context: int, prefill_tokens: int, graphs: bool = True,
                 block_size: int = 16, overlap: bool | None = None,
                 sizes: tuple[int, ...] | None = None, hybrid: bool = True) -> LLMEngine:
    """An engine for `batch` concurrent sequences of up to `context` tokens, whose KV cache holds
    exactly that, with one CUDA graph for the bucket that serves `batch` (on CUDA, `graphs`; or
    the buckets `sizes`). `overlap`: EngineConfig's (None: on where it pays, a GPU). `hybrid`: a model
    with both sliding-window and whole-context layers gets the hybrid cache, as `runtime serve` gives it."""
    cfg = model.config
    dtype = model.model.embed_tokens.weight.dtype
    device = model.model.embed_tokens.weight.device
    spec = KVCacheSpec(tuple(model.stage.layers), cfg.num_key_value_heads, cfg.head_dim, dtype, block_size)
    groups, windows = hybrid_groups(spec.layers, cfg.layer_window) if hybrid else ((), ())
    if groups:
        spec = dataclasses.replace(spec, groups=groups, group_windows=windows)
    num_blocks = batch * spec.blocks_per_sequence(context, max(prefill_tokens, batch)) + 1  # + the null block
    cache = KVCache(spec, num_blocks, device)
    config = EngineConfig(num_blocks=num_blocks, block_size=block_size, max_model_len=context,
                          scheduler=SchedulerConfig(batch, max(prefill_tokens, batch)), enable_prefix_caching=False,
                          overlap=overlap, sliding_window=cfg.kv_window, group_windows=windows)
    bucket = bucket_for(batch, BUCKETS)
    if sizes is None:
        sizes = (bucket,) if bucket is not None else ()
    sizes = sizes if graphs else ()
    runner = ModelRunner(model, cache, graph_sizes=sizes, max_model_len=config.context_len)
    return LLMEngine(runner, config, None, (), cfg.vocab_size)


def measure(engine: LLMEngine, batch: int, prompt_len: int, tokens: int, seed: int = 0) -> DecodeRun:
    """Run `batch` random prompts to `tokens` tokens each; time the decode steps."""
    rng = random.Random(seed)
    vocab = engine.vocab_size
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    ids = [f"bench-{seed}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(vocab) for _ in range(prompt_len)], params)
    started = set()
    start = None
    decode_tokens = steps = 0
    while engine.has_unfinished():
        outputs = engine.step()  # returns after the sampled ids are on the host
        if start is not None:
            steps += 1
            decode_tokens += sum(len(o.new_token_ids) for o in outputs)
            continue
        started.update(o.request_id for o in outputs if o.new_token_ids)
        if len(started) == batch:
            start = time.perf_counter()
    seconds = time.perf_counter() - (start or time.perf_counter())
    return DecodeRun(batch, prompt_len, decode_tokens, steps, seconds, engine.executor.graphs is not None,
                     engine.overlap)


def run_batches(model: CausalLM, batches: list[int], prompt_len: int, tokens: int, graphs: bool = True,
                overlap: bool | None = None, hybrid: bool = True):
    """One DecodeRun per batch size, each on its own engine (warmed up first)."""
    for b in batches:
        engine = bench_engine(model, b, prompt_len + tokens, b * prompt_len, graphs, overlap=overlap, hybrid=hybrid)
        measure(engine, b, prompt_len, min(tokens, 8), seed=1)  # warm-up: compile, allocate
        yield measure(engine, b, prompt_len, tokens, seed=2)
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def cache_kind(cfg, layers, hybrid: bool) -> str:
    """What bench_engine's cache is for this model, in words (a --layers cut can leave one kind of layer)."""
    windows = [cfg.layer_window(i) for i in layers]
    if all(windows):
        return f"every layer slides (window {max(windows)}): blocks behind the window go back"
    if not any(windows):
        return "every layer reads the whole context"
    sliding = sum(1 for w in windows if w)
    kinds = f"{len(windows) - sliding} whole-context and {sliding} sliding-window layers (window {max(windows)})"
    return f"hybrid, {kinds}" if hybrid else f"plain (--disable-hybrid-kv-cache-manager), {kinds}"


# ------------------------------------------------------------------------------------- the CLI

def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="a model path (default: the embedded SmolLM2-135M-Instruct); or use --random")
    p.add_argument("--random", metavar="SHAPE", default=None,
                   help=f"a random-weight model of a named shape, built on the device: {', '.join(SHAPES)}")
    p.add_argument("--bits", type=int, default=None, help="with --random: 4 or 8 (GPTQ, group --group-size), "
                                                        "16 for unquantized linears (default 4)")
    p.add_argument("--group-size", type=int, default=None, help="with --random (default 128)")
    p.add_argument("--gguf", metavar="TYPE", default=None,
                   help=f"with --random: the model a GGUF file of this llama.cpp type loads into, its blocks random "
                        f"({', '.join(GGUF_MIXES)}; Q4_K, Q5_K: the _M mixes, as llama-quantize reads them; each "
                        f"tensor's type as llama.cpp's quantizer picks it); instead of --bits")
    p.add_argument("--layers", type=int, default=None, help="with --random: fewer decoder layers than the shape's")
    p.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    from .cli import add_threads_arg  # runtime.cli imports this module

    add_threads_arg(p)
    p.add_argument("--dtype", default="auto",
                   help="activation dtype (default: float32 on CPU; on a GPU float16, bfloat16 for Gemma 2 / 3)")
    p.add_argument("--batch", default="1", help="comma-separated concurrent streams, e.g. 1,16,64 (default 1)")
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per stream (default 128)")
    p.add_argument("--prompt-len", type=int, default=32, help="random prompt tokens per stream (default 32)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--no-overlap", action="store_true",
                   help="each decode step waits for its tokens before the next is launched (default on a GPU: overlap)")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="a model with sliding-window and whole-context layers (Gemma 2 and 3): every layer keeps "
                        "every block, as `serve --disable-hybrid-kv-cache-manager`")
    p.add_argument("--json", action="store_true", help="one JSON object per batch size")


def _batches(text: str) -> list[int]:
    try:
        batches = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        raise FlotillaError(f"--batch {text!r}: expected positive integers separated by commas, e.g. 1,16,64")
    return batches


def _model(args: argparse.Namespace) -> tuple[CausalLM, str]:
    from .host_memory import lean_cpu_load
    from .loader import load_model, parse_device, parse_dtype

    device = parse_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    if args.random is not None and args.dtype in (None, "auto"):  # as load_model picks it (Gemma 3: bf16)
        from .loader import default_dtype
        from .random_model import SHAPES

        if args.random in SHAPES:
            dtype = default_dtype(device, SHAPES[args.random])
    if args.random is None:
        if args.gguf is not None:
            raise FlotillaError(f"--gguf {args.gguf} builds a random model: give --random SHAPE too "
                                f"(a GGUF file of your own: pass its path instead)")
        changed = [f for f, value in (("--bits", args.bits), ("--group-size", args.group_size),
                                      ("--layers", args.layers)) if value is not None]
        if changed:
            raise FlotillaError(f"{', '.join(changed)}: only with --random SHAPE (a random model); a model file "
                                f"or checkpoint (the default one too) runs as it was quantized")
        with lean_cpu_load(device):  # the `runtime bench` process
            lm = load_model(args.model, device, args.dtype, with_tokenizer=False)
        return lm.model, str(lm.path)
    if args.model is not None:
        raise FlotillaError(f"give a model path or --random, not both (got {args.model!r} and --random {args.random})")
    if args.gguf is not None:
        if args.bits is not None or args.group_size is not None:
            raise FlotillaError(f"--gguf {args.gguf} gives every tensor its llama.cpp type: leave out --bits and "
                                f"--group-size")
        mix = gguf_mix(args.gguf)
        model = build_random_gguf_model(args.random, mix, device, dtype, num_layers=args.layers)
        return model, f"random {args.random} (GGUF {mix})"
    nbits = args.bits if args.bits is not None else 4
    group = args.group_size if args.group_size is not None else 128
    if nbits not in BITS:
        raise FlotillaError(f"--bits {nbits}: expected one of {', '.join(map(str, BITS))}")
    if group != -1 and (group < 16 or group % 16):
        raise FlotillaError(f"--group-size {group}: expected a multiple of 16 (32, 64, 128, ...) or -1")
    model = build_random_model(args.random, nbits, device, dtype, group, num_layers=args.layers)
    bits = "fp" if nbits == 16 else f"int{nbits} g{group}"
    return model, f"random {args.random} ({bits})"


def run(args: argparse.Namespace) -> int:
    batches = _batches(args.batch)
    if args.tokens < 2 or args.prompt_len < 1:
        raise FlotillaError("--tokens must be at least 2 and --prompt-len at least 1")
    model, name = _model(args)
    device = model.model.embed_tokens.weight.device
    dtype = model.model.embed_tokens.weight.dtype
    gib = weight_bytes(model) / 2**30
    if not args.json:
        print(f"{name} on {device} ({str(dtype).removeprefix('torch.')}), {gib:.2f} GiB of weights read per step, "
              f"prompt {args.prompt_len} + {args.tokens} tokens per stream; KV cache: "
              f"{cache_kind(model.config, model.stage.layers, not args.disable_hybrid_kv_cache_manager)}", flush=True)
        print(f"{'batch':>5} {'tok/s':>10} {'tok/s/stream':>13} {'ms/step':>8} {'graphs':>6} {'overlap':>7}", flush=True)
    overlap = False if args.no_overlap else None
    for r in run_batches(model, batches, args.prompt_len, args.tokens, graphs=not args.enforce_eager, overlap=overlap,
                         hybrid=not args.disable_hybrid_kv_cache_manager):
        if args.json:
            print(json.dumps({"model": name, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                              **r.row()}), flush=True)
        else:
            print(f"{r.batch:>5} {r.tok_s:>10.1f} {r.tok_s_per_stream:>13.1f} {r.ms_per_step:>8.2f} "
                  f"{'yes' if r.graphs else 'no':>6} {'yes' if r.overlap else 'no':>7}", flush=True)
    return 0
