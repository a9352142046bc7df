"""Sliding-window attention and Gemma 3 on a GPU (skipped without one): the Triton decode's window and the
prefill masks against the CPU torch path, and the engine's greedy tokens (CUDA graphs, the fused rope + KV store,
Gemma 3's two ropes, Gemma 2's soft-capping in the Triton decode) against transformers on the CPU."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import make_hf_model, needs_gpu, save_byte_tokenizer, save_hf_model, tiny_config
from flotilla.kernels.attention import PagedAttentionMetadata, paged_attention, store_kv
from test_paged_attention import CASES, D, build, windowed_reference

pytestmark = needs_gpu


def to_cuda(meta: PagedAttentionMetadata) -> PagedAttentionMetadata:
    return PagedAttentionMetadata(meta.slot_mapping.cuda(), meta.block_tables.cuda(), meta.seq_lens.cuda(),
                                  meta.query_lens.cuda(), meta.block_size, meta.num_decodes, meta.max_decode_seq_len,
                                  meta.max_prefill_query_len, meta.max_prefill_seq_len, meta.first_block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_window_on_the_gpu_matches_the_dense_window(case, window, dtype):
    seqs = CASES[case]
    kc, vc, full_k, full_v, q, k, v, meta = build(seqs)
    want = windowed_reference(seqs, full_k, full_v, q, window)
    kc, vc, q, k, v = (t.cuda().to(dtype) for t in (kc, vc, q, k, v))
    meta = to_cuda(meta)
    store_kv(kc, vc, k, v, meta)
    got = paged_attention(q, kc, vc, meta, scale=1 / math.sqrt(D), window=window).float().cpu()
    assert (got - want).abs().max().item() < (1e-4 if dtype == torch.float32 else 2e-2)


def greedy_on(path, device: str, prompts, n: int):
    from flotilla.runtime.engine_args import EngineArgs, build_engine
    from flotilla.runtime.loader import load_model
    from test_sliding_window import greedy_rounds

    engine = build_engine(load_model(path, device, "float32", progress=False),
                          EngineArgs(block_size=16, max_num_batched_tokens=64, kv_cache_memory="64MiB"))
    return greedy_rounds(engine, prompts, [list(prompts)], n)


@pytest.mark.parametrize("family", ["mistral", "gemma3", "gemma2"])
def test_the_engine_on_the_gpu_decodes_past_the_window_as_transformers(family, tmp_path):
    from test_gemma import gemma2_config, gemma3_config
    from test_sliding_window import transformers_greedy

    config = {"gemma3": gemma3_config, "gemma2": gemma2_config}.get(
        family, lambda: tiny_config("mistral", sliding_window=8, head_dim=32))()
    hf = make_hf_model(config, seed=11)
    save_hf_model(hf, tmp_path / "m")
    save_byte_tokenizer(tmp_path / "m")
    prompts = {"a": list(range(30, 60)), "b": list(range(70, 83)), "c": list(range(100, 140))}
    got = greedy_on(tmp_path / "m", "cuda:0", prompts, 24)
    for name, prompt in prompts.items():
        assert got[name] == transformers_greedy(hf, prompt, 24), name


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_the_hybrid_cache_on_the_gpu_gives_the_plain_caches_tokens(family, tmp_path):
    """Gemma's sliding and global layers in groups of their own blocks (HybridBlockManager), with CUDA graphs and
    the Triton decode, past the window and through prefix hits: the same greedy tokens as every block kept."""
    from flotilla.runtime.engine_args import EngineArgs, build_engine
    from flotilla.runtime.loader import load_model
    from test_gemma import gemma2_config, gemma3_config
    from test_sliding_window import greedy_rounds

    hf = make_hf_model(gemma3_config() if family == "gemma3" else gemma2_config(), seed=13)
    save_hf_model(hf, tmp_path / "m")
    save_byte_tokenizer(tmp_path / "m")
    prompts = {"a": list(range(30, 60)), "b": list(range(70, 83)), "c": list(range(30, 60)) + [9, 8]}
    got = {}
    for hybrid in (False, True):
        engine = build_engine(load_model(tmp_path / "m", "cuda:0", "float32", progress=False),
                              EngineArgs(block_size=16, max_num_batched_tokens=64, kv_cache_memory="64MiB",
                                         disable_hybrid_kv_cache_manager=not hybrid))
        assert ("hybrid:" in engine.kv_cache_report) == hybrid
        got[hybrid] = greedy_rounds(engine, prompts, [["a", "b"], ["c"]], 40)
        if hybrid:
            assert engine.block_manager.num_window_released > 0
    assert got[True] == got[False]
