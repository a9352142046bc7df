"""Our decoder against transformers' forward on the same weights."""
from __future__ import annotations

import pytest
import torch

from flotilla.models.attention import DenseCausalAttention
from flotilla.models.config import ModelConfig
from flotilla.models.sources import open_source
from flotilla.models.weights import load_stage

from conftest import make_hf_model, save_hf_model, tiny_config

CASES = {
    "llama3-rope-scaling": ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                                          rope_theta=500000.0)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-untied-bias": ("llama", dict(tie_word_embeddings=False, attention_bias=True)),
    "llama-linear-rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "mistral": ("mistral", dict(sliding_window=None, head_dim=32)),
    "qwen2-qkv-bias": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    # Qwen3: q/k norms; head_dim 32 apart from hidden / heads (16), as Qwen3's 128 is; and with q/k/v/o biases
    "qwen3-tied": ("qwen3", dict(tie_word_embeddings=True, head_dim=32)),
    "qwen3-untied-bias": ("qwen3", dict(tie_word_embeddings=False, attention_bias=True)),
}


def our_logits(model, ids: torch.Tensor) -> torch.Tensor:
    B, L = ids.shape
    positions = torch.arange(L).repeat(B)
    with torch.no_grad():
        hidden = model(ids.flatten(), positions, DenseCausalAttention(B, L))
        return model.compute_logits(hidden).view(B, L, -1)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    family, overrides = CASES[case]
    hf = make_hf_model(tiny_config(family, **overrides), seed=hash(case) % 1000)
    path = save_hf_model(hf, tmp_path / case)
    source = open_source(path)
    assert source.config.family == family
    ours = load_stage(source)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    got = our_logits(ours, ids)
    assert (got - ref).abs().max().item() < 1e-4


def test_smollm2_gguf_logits_match_transformers(smollm2_gguf):
    from transformers import AutoModelForCausalLM

    ours = load_stage(open_source(smollm2_gguf))
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                              dtype=torch.float32).eval()
    ids = torch.randint(0, 49152, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    got = our_logits(ours, ids)
    assert (got - ref).abs().max().item() < 1e-4


def test_config_from_gguf_matches_hf_config(smollm2_gguf):
    cfg = open_source(smollm2_gguf).config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.eos_token_ids == (2,)


def test_config_round_trips_through_hf_dict():
    cfg = ModelConfig.from_hf_dict(tiny_config("llama", rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}).to_dict())
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
