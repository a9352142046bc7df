"""Building the speculative decoder of an engine from `--speculative` and the target's config."""
from __future__ import annotations

from typing import Callable

import torch

from flotilla.errors import FlotillaError

from ..cuda_graphs import capture_sizes
from ..kv_cache import KVCache, KVCacheSpec
from ..loader import LoadedModel, load_model
from .config import SpeculativeConfig
from .decoder import SpecDecoder
from .draft import DraftProposer, check_compatible
from .ngram import NgramProposer


def build_spec_decoder(config: SpeculativeConfig, target: LoadedModel, num_blocks: int, block_size: int,
                       max_num_seqs: int, report: Callable[[str], None] | None = None,
                       enforce_eager: bool = False, max_model_len: int | None = None) -> SpecDecoder:
    """The decoder for `config` over a target loaded in this process: a draft model goes on the
    target's device and dtype (see `spec_decoder`)."""
    return spec_decoder(config, target.config.vocab_size, target.device, str(target.dtype).removeprefix("torch."),
                        num_blocks, block_size, max_num_seqs, report, enforce_eager, max_model_len)


def spec_decoder(config: SpeculativeConfig, vocab_size: int, device: str | torch.device | None, dtype: str,
                 num_blocks: int, block_size: int, max_num_seqs: int, report: Callable[[str], None] | None = None,
                 enforce_eager: bool = False, max_model_len: int | None = None) -> SpecDecoder:
    """The decoder for `config` over a target of `vocab_size` tokens whose pool has `num_blocks`
    blocks (the null block included). A draft model is loaded on `device` in `dtype` and gets a
    pool of the same size plus room for each running sequence's drafts, and on CUDA (unless
    `enforce_eager`) graphs for its passes over contexts of up to `max_model_len` tokens;
    `report` receives its one-line KV cache report. (A pipeline's head builds one without the
    target's weights.)"""
    k = config.num_speculative_tokens
    if config.method == "ngram":
        if report is not None:
            report(f"speculative decoding: n-gram prompt lookup, up to {k} draft tokens a step")
        return SpecDecoder(config, NgramProposer(config.ngram_min, config.ngram_max))
    try:
        draft = load_model(config.draft_path, device, dtype, with_tokenizer=False)
    except FlotillaError as e:  # the target's own errors read alike: say which model this is
        raise FlotillaError(f"--speculative draft:{config.draft_path}: {e}") from None
    cfg = draft.config
    check_compatible(vocab_size, cfg.vocab_size, f"--speculative draft:{config.draft_path}")
    spec = KVCacheSpec(tuple(draft.model.stage.layers), cfg.num_key_value_heads, cfg.head_dim, draft.dtype, block_size)
    n = num_blocks + max_num_seqs * -(-k // block_size)
    cache = KVCache(spec, n, draft.device)
    if report is not None:
        report(f"speculative decoding: draft model {config.draft_path}, up to {k} draft tokens a step")
        report(f"draft {spec.describe(n)}")
    # CUDA graphs for the draft's passes: one or two tokens a sequence after the first (catching up)
    graphs = capture_sizes(2 * max_num_seqs) if draft.device.type == "cuda" and not enforce_eager else ()
    proposer = DraftProposer(draft.model, cache, n, graph_sizes=graphs, graph_query_len=k + 1,
                             max_model_len=min(cfg.max_model_len, max_model_len or cfg.max_model_len))
    return SpecDecoder(config, proposer, max_len=cfg.max_model_len)
