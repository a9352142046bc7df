"""Engine options (one typed config, shared by the CLI and the server) and building an engine
around a loaded model."""
from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass

import torch

from flotilla.errors import FlotillaError

from .cuda_graphs import capture_sizes
from .engine import EngineConfig, LLMEngine
from .kv_cache import (CPU_SHARED_TOKENS, DEFAULT_FRACTION, KVCache, KVCacheSpec, hybrid_groups, hybrid_plan,
                       parse_memory, plan_kv_cache)
from .loader import LoadedModel
from .model_runner import ModelRunner
from .scheduler import SchedulerConfig
from .spec.builder import build_spec_decoder
from .spec.config import SpeculativeConfig

log = logging.getLogger("flotilla.runtime")
MAX_BLOCK_SIZE = 1024  # tokens a KV block


@dataclass(frozen=True)
class EngineArgs:
    kv_cache_memory: str | None = None  # e.g. "2GiB"; default: see kv_cache.plan_kv_cache
    kv_cache_fraction: float | None = None  # of free memory, instead of the default
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # default: the model's
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    overlap: bool = True  # on a GPU (or a ring of one micro-batch), launch each decode before the last one's tokens are read
    speculative: str | None = None  # "ngram" or "draft:PATH" (see runtime/spec)
    num_speculative_tokens: int = 4
    # a model whose layers are of two kinds (some attend within a sliding window): keep every block for every
    # layer, as before the hybrid cache (HybridBlockManager), instead of the window's blocks for the sliding ones
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self):
        """Bad values fail here, before any model is loaded, with the flag to fix."""
        for flag, value, low in (("--block-size", self.block_size, 1), ("--max-num-seqs", self.max_num_seqs, 1),
                                 ("--max-num-batched-tokens", self.max_num_batched_tokens, 1),
                                 ("--max-model-len", self.max_model_len, 2)):
            if value is not None and value < low:
                raise FlotillaError(f"{flag} {value}: expected an integer of at least {low}")
        if self.block_size & (self.block_size - 1) or self.block_size > MAX_BLOCK_SIZE:
            raise FlotillaError(f"--block-size {self.block_size}: expected a power of two up to {MAX_BLOCK_SIZE} "
                                "(e.g. 16)")
        if self.kv_cache_fraction is not None and not 0 < self.kv_cache_fraction <= 1:
            raise FlotillaError(f"--kv-cache-fraction {self.kv_cache_fraction}: expected a fraction in (0, 1]")
        spec = self.speculative_config  # a bad --speculative (or --num-speculative-tokens) fails here too
        if spec is not None and spec.method == "draft":
            spec.check_draft_path()  # before the target loads

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        if not self.speculative:
            return None
        return SpeculativeConfig.parse(self.speculative, self.num_speculative_tokens)

    @classmethod
    def add_args(cls, p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("engine")
        g.add_argument("--kv-cache-memory", default=None,
                       help=f"memory for the KV cache, e.g. 2GiB or 512MiB (default: on a GPU "
                            f"{DEFAULT_FRACTION * 100:.0f}%% of free memory; on a CPU room for {CPU_SHARED_TOKENS} "
                            "tokens, or one whole context if longer, never more than --max-num-seqs contexts)")
        g.add_argument("--kv-cache-fraction", type=float, default=None,
                       help="fraction of free memory for the KV cache, instead of the default")
        g.add_argument("--block-size", type=int, default=cls.block_size, help="tokens per KV block (default %(default)s)")
        g.add_argument("--max-num-seqs", type=int, default=cls.max_num_seqs,
                       help="most sequences in one step (default %(default)s)")
        g.add_argument("--max-num-batched-tokens", type=int, default=cls.max_num_batched_tokens,
                       help="token budget of one step (default %(default)s)")
        g.add_argument("--max-model-len", type=int, default=None, help="longest context served (default: the model's)")
        g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="turn automatic prefix caching off")
        g.add_argument("--enforce-eager", action="store_true", help="on CUDA, run decode steps without CUDA graphs")
        g.add_argument("--no-overlap", dest="overlap", action="store_false",
                       help="on a GPU, wait for each decode step's tokens before launching the next (default: "
                            "the next is launched first, and the host's work hides behind the GPU's); in a "
                            "pipeline with one micro-batch in flight, wait for each step's tokens before sending "
                            "the next (default: the last stage feeds them to stage 0)")
        g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                       help="for a model with both sliding-window and global layers (Gemma 2 and 3): keep every "
                            "token's keys and values for every layer (default: the sliding-window layers keep "
                            "only their window's, in tables of their own over the one pool, so more tokens fit "
                            "the same memory)")
        g.add_argument("--speculative", default=None, metavar="ngram|draft:PATH",
                       help="speculative decoding: 'ngram' (prompt lookup) or 'draft:PATH' (a small model or a "
                            "lower-bit copy of the target, same tokenizer); the output distribution is the target's")
        g.add_argument("--num-speculative-tokens", type=int, default=None,
                       help=f"with --speculative: most draft tokens verified per step and sequence, 1 to 32 "
                            f"(default {cls.num_speculative_tokens})")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineArgs":
        k = args.num_speculative_tokens
        if k is not None and not args.speculative:
            raise FlotillaError(f"--num-speculative-tokens {k} without --speculative: add --speculative ngram "
                                f"(or draft:PATH), or leave it out")
        if args.kv_cache_memory is not None:
            parse_memory(args.kv_cache_memory)  # a bad size is said before the model loads, not after
        return cls(kv_cache_memory=args.kv_cache_memory, kv_cache_fraction=args.kv_cache_fraction,
                   block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                   enable_prefix_caching=args.enable_prefix_caching, enforce_eager=args.enforce_eager,
                   overlap=args.overlap,
                   disable_hybrid_kv_cache_manager=getattr(args, "disable_hybrid_kv_cache_manager", False),
                   speculative=args.speculative,
                   num_speculative_tokens=cls.num_speculative_tokens if k is None else k)


def build_engine(lm: LoadedModel, args: EngineArgs = EngineArgs(), report=None) -> LLMEngine:
    """An engine over a whole model loaded in this process. `report` (e.g. print to stderr)
    receives the one-line KV cache report; it is logged either way."""
    cfg = lm.config
    spec_config = args.speculative_config
    max_len = min(args.max_model_len or cfg.max_model_len, cfg.max_model_len)
    if args.max_model_len and args.max_model_len > cfg.max_model_len:
        note = f"--max-model-len {args.max_model_len} is past the model's context; serving {cfg.max_model_len}"
        log.info("%s", note)
        if report is not None:
            report(note)
    # the KV heads this process's layers cache (a share of them under tensor parallelism)
    spec = KVCacheSpec(tuple(lm.model.stage.layers), lm.model.num_kv_heads, cfg.head_dim, lm.dtype, args.block_size)
    shares = lm.parallel.memory_shares if lm.parallel else 1  # TP ranks on a CPU share its memory
    plan = plan_kv_cache(spec, lm.device, max_len, args.max_num_seqs, args.kv_cache_memory, args.kv_cache_fraction,
                         shares)
    num_blocks, wanted = plan.num_blocks, max_len
    groups, windows = hybrid_groups(spec.layers, cfg.layer_window) if use_hybrid(lm, args) else ((), ())
    if groups:
        spec = dataclasses.replace(spec, groups=groups, group_windows=windows)
        num_blocks, fit = hybrid_plan(spec, plan, max_len, args.max_num_seqs, args.max_num_batched_tokens)
        max_len = min(max_len, fit)
    else:
        max_len = min(max_len, (num_blocks - 1) * args.block_size)  # the whole pool (EngineConfig.context_len)
    cache = KVCache(spec, num_blocks, lm.device)
    lines = [f"{spec.describe(num_blocks, max_len)} [{plan.reason}]"]
    if max_len < wanted:  # said, not a silent cut (a prompt past it gets a 400 that names the context)
        lines.append(f"the KV cache holds contexts of up to {max_len} tokens, not the {wanted} of "
                     f"{'--max-model-len' if args.max_model_len else 'the model'}: give it more memory "
                     "(--kv-cache-memory) for longer ones")
    for line in lines:
        log.info("%s", line)
        if report is not None:
            report(line)
    line = lines[0]
    config = EngineConfig(num_blocks=num_blocks, block_size=args.block_size, max_model_len=max_len,
                          scheduler=SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens),
                          enable_prefix_caching=args.enable_prefix_caching, overlap=None if args.overlap else False,
                          sliding_window=cfg.kv_window, group_windows=windows)
    # CUDA graphs on one device; TP ranks step eagerly (the collectives stay outside graphs). A
    # verify step (each sequence's token and up to K drafts) replays them too: buckets of tokens.
    query_len = 1 + spec_config.num_speculative_tokens if spec_config is not None else 1
    graphs = () if args.enforce_eager or lm.parallel else capture_sizes(args.max_num_seqs * query_len)
    runner = ModelRunner(lm.model, cache, graph_sizes=graphs, max_model_len=config.context_len,
                         graph_query_len=query_len)
    executor = lm.parallel.executor(runner) if lm.parallel else runner  # rank 0 sends each step to the others
    decoder = None
    if spec_config is not None:  # after the target's cache: a draft's pool matches its size
        # a hybrid pool's blocks hold one group of layers: the draft's (one table a sequence, every block of every
        # layer) gets the plain plan's count, as without the hybrid cache; where the target's long sequences hold
        # more, the draft's pool runs short first and those sequences go on without drafts (runtime/spec)
        decoder = build_spec_decoder(spec_config, lm, plan.num_blocks, args.block_size, args.max_num_seqs, report,
                                     enforce_eager=args.enforce_eager or lm.parallel is not None,
                                     max_model_len=config.context_len)
    engine = LLMEngine(executor, config, lm.tokenizer, cfg.eos_token_ids, cfg.vocab_size, decoder)
    engine.kv_cache_report = line
    return engine


def use_hybrid(lm: LoadedModel, args: EngineArgs) -> bool:
    """Whether this engine's cache is hybrid (HybridBlockManager) where the model has both sliding-window and
    whole-context layers: unless --disable-hybrid-kv-cache-manager (every --tp rank gets the same groups)."""
    return not args.disable_hybrid_kv_cache_manager


def generate(engine: LLMEngine, prompts: list[list[int]], params) -> list[list[int]]:
    """Run prompts to completion (a convenience for scripts and tests): generated ids per prompt."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"gen-{id(engine)}-{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, plist):
        engine.add_request(rid, prompt, p)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    with torch.inference_mode():
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
    return [out[rid] for rid in ids]
