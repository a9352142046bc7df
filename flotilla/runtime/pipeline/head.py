"""Building the head: the model's config and tokenizer (no weights), the pipeline, the engine."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from flotilla.models.sources import open_source
from flotilla.models.tokenizer import load_tokenizer
from flotilla.runtime.engine import EngineConfig
from flotilla.runtime.engine_args import EngineArgs
from flotilla.runtime.kv_cache import parse_memory
from flotilla.runtime.scheduler import SchedulerConfig
from flotilla.runtime.spec.builder import spec_decoder

from .engine import PipelineEngine
from .executor import PipelineExecutor
from .pipeline import Pipeline, PipelineSettings


def build_pipeline_engine(model: str | Path, args: EngineArgs, settings: PipelineSettings, report=None,
                          with_tokenizer: bool = True, device: str | None = None) -> PipelineEngine:
    """Connect to the workers, set the pipeline up (split, load, push, size the KV pool) and return
    an engine over it. The head itself loads no weights of the model; with `--speculative
    draft:PATH` it loads the draft model on `device` (default: cuda if available, else cpu), in
    the pipeline's dtype, with a KV pool as large as the pipeline's."""
    path = Path(model).expanduser()
    cfg = open_source(path).config
    tokenizer = load_tokenizer(path, cfg.eos_token_ids) if with_tokenizer else None
    max_len = min(args.max_model_len or cfg.max_model_len, cfg.max_model_len)
    # GPU stages capture decode graphs as a local engine does: buckets up to max_num_seqs tokens
    # (x 1 + K with speculative verify steps; `settings` may ask for longer rows), never more than
    # a step's token budget
    query_len = max(settings.graph_query_len, 1 + args.speculative_config.num_speculative_tokens
                    if args.speculative_config is not None else 1)
    graph_tokens = 0 if args.enforce_eager else min(max(settings.graph_tokens, args.max_num_seqs * query_len),
                                                     args.max_num_batched_tokens)
    # each stage sizes its KV pool as a single-process run would (kv_cache.plan_kv_cache)
    settings = replace(settings, block_size=args.block_size, kv_fraction=args.kv_cache_fraction or 0.0,
                       max_num_seqs=args.max_num_seqs,
                       kv_memory=parse_memory(args.kv_cache_memory) if args.kv_cache_memory else 0,
                       graph_tokens=graph_tokens, graph_query_len=query_len, max_model_len=max_len)
    pipeline = Pipeline(path, cfg, settings, report)
    pipeline.start()
    config = EngineConfig(num_blocks=pipeline.num_blocks, block_size=args.block_size, max_model_len=max_len,
                          scheduler=SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens),
                          enable_prefix_caching=args.enable_prefix_caching,
                          overlap=None if args.overlap else False,  # None: with one micro-batch in flight
                          sliding_window=cfg.kv_window)
    if config.context_len < max_len and report is not None:  # said, as a single process says it (build_engine)
        report(f"the KV cache holds contexts of up to {config.context_len} tokens, not the {max_len} of "
               f"{'--max-model-len' if args.max_model_len else 'the model'}: give it more memory "
               "(--kv-cache-memory) for longer ones")
    spec = None
    try:
        if args.speculative_config is not None:
            spec = spec_decoder(args.speculative_config, cfg.vocab_size, device, settings.dtype, pipeline.num_blocks,
                                args.block_size, args.max_num_seqs, report, args.enforce_eager, config.context_len)
    except BaseException:
        pipeline.close()
        raise
    return PipelineEngine(PipelineExecutor(pipeline), config, tokenizer, cfg.eos_token_ids, cfg.vocab_size,
                          settings.stage_timeout, spec)
