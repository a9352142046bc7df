"""Sliding-window attention (Mistral, Qwen2 / Qwen3's upper layers, Phi-3) against transformers, whose mask lets
the token at position i see the keys at i - window + 1 … i: the dense forward's logits, and the engine's greedy
tokens through the paged cache past the window (batched decodes, chunked prefill, a cached prefix)."""
from __future__ import annotations

import pytest
import torch

from flotilla.models.config import ModelConfig
from flotilla.models.sources import open_source
from flotilla.models.weights import load_stage

from conftest import make_hf_model, save_byte_tokenizer, save_hf_model, tiny_config
from test_models import our_logits

WINDOWED = {  # family, config, each layer's window
    "mistral": ("mistral", dict(sliding_window=8, head_dim=32), [8, 8, 8]),
    # the first layer attends to the whole context, the two above it through the window
    "qwen2-upper-layers": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), [0, 8, 8]),
    # transformers 5 follows layer_types where given, whatever max_window_layers says
    "qwen2-alternating": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
                          [8, 0, 8]),
}


@pytest.mark.parametrize("case", sorted(WINDOWED))
def test_windowed_logits_match_transformers(case, tmp_path):
    family, overrides, expected = WINDOWED[case]
    hf = make_hf_model(tiny_config(family, **overrides), seed=3)
    source = open_source(save_hf_model(hf, tmp_path / case))
    assert source.config.max_model_len == 256  # the whole context is served, not the window
    windows = [source.config.layer_window(i) for i in range(3)]
    assert windows == expected
    # only where every layer slides may the cache give back what falls behind the window
    assert source.config.kv_window == (8 if all(expected) else 0)
    assert [ModelConfig.from_hf_dict(source.config.to_hf_dict()).layer_window(i) for i in range(3)] == expected
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    got = our_logits(load_stage(source), ids)
    assert (got - ref).abs().max().item() < 1e-4
    # the window matters here: the same weights with every layer attending to everything differ
    full = make_hf_model(tiny_config(family, **{**overrides, "sliding_window": None, "use_sliding_window": False,
                                                "layer_types": None}),
                         seed=3)
    with torch.no_grad():
        assert (full(ids).logits - ref).abs().max().item() > 1e-2


def test_a_window_as_long_as_the_context_is_no_window():
    cfg = ModelConfig.from_hf_dict(tiny_config("mistral", sliding_window=256).to_dict())
    assert cfg.sliding_window == 256 and cfg.layer_window(0) == 0


@pytest.mark.parametrize("kernels", ["compiled", "torch"])
def test_the_engine_decodes_past_the_window_as_transformers(kernels, tmp_path, monkeypatch):
    """Three requests at once, two sharing a 20-token prefix (the second reads it from the prefix cache), prompts
    past the 8-token window, prefills chunked by a 16-token budget: every greedy token is transformers'."""
    from flotilla.kernels.cpu import ops
    from flotilla.runtime.engine_args import EngineArgs, build_engine
    from flotilla.runtime.loader import load_model

    if kernels == "torch":
        monkeypatch.setenv("FLOTILLA_KERNEL", "dense")
    ops.reset()
    hf = make_hf_model(tiny_config("mistral", sliding_window=8, head_dim=32), seed=5)
    save_hf_model(hf, tmp_path / "m")
    save_byte_tokenizer(tmp_path / "m")
    engine = build_engine(load_model(tmp_path / "m", "cpu", "float32", progress=False),
                          EngineArgs(block_size=4, max_num_batched_tokens=16))
    prefix = list(range(40, 60))
    prompts = {"a": prefix + [7, 8, 9], "b": list(range(100, 127)), "c": prefix + [11]}
    got = greedy_rounds(engine, prompts, [["a", "b"], ["c"]], 14)  # "c" after "a" finished: its prefix is cached
    ops.reset()
    # every layer slides: the blocks behind the window went back to the pool as the sequences moved on
    assert engine.config.sliding_window == 8 and engine.block_manager.num_window_released >= 3 * 5
    assert engine.stats().cached_tokens_total == 20
    for name, prompt in prompts.items():
        assert got[name] == transformers_greedy(hf, prompt, 14), name


def greedy_rounds(engine, prompts: dict[str, list[int]], rounds: list[list[str]], max_tokens: int):
    """Each round's requests added at once and run to the end, greedy: {name: generated ids}."""
    from flotilla.runtime.sampling import SamplingParams

    got: dict[str, list[int]] = {k: [] for k in prompts}
    for names in rounds:
        for name in names:
            engine.add_request(name, prompts[name], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                   ignore_eos=True))
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += list(out.new_token_ids)
            engine.check_integrity()
    return got


def transformers_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
