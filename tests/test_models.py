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
    # llama3 rope without original_max_position_embeddings: transformers takes max_position_embeddings (256)
    "llama3-rope-no-original": ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0})),
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


def test_qwen_sliding_window_is_read_and_written_as_transformers_does():
    """Qwen2 / Qwen3 window only the layers from max_window_layers on, and only under use_sliding_window; a
    checkpoint's config.json keeps both (a quantized Qwen2 with a window once came back without it)."""
    full = ModelConfig.from_hf_dict(tiny_config("qwen2", use_sliding_window=True, sliding_window=16,
                                                max_window_layers=3).to_dict())
    assert full.sliding_window is None and full.max_model_len == 256  # every layer attends to the whole context
    off = ModelConfig.from_hf_dict(tiny_config("qwen2", use_sliding_window=False, sliding_window=16).to_dict())
    assert off.sliding_window is None
    for family in ("qwen2", "qwen3"):
        cfg = ModelConfig.from_hf_dict(tiny_config(family, use_sliding_window=True, sliding_window=16,
                                                   max_window_layers=1).to_dict())
        assert cfg.sliding_window == 16 and cfg.window_layers == 1 and cfg.max_model_len == 256
        assert [cfg.layer_window(i) for i in range(3)] == [0, 16, 16]
        d = cfg.to_hf_dict()
        assert (d["use_sliding_window"], d["sliding_window"], d["max_window_layers"]) == (True, 16, 1)
        assert ModelConfig.from_hf_dict(d) == cfg
        assert tiny_config(family, **{k: d[k] for k in ("use_sliding_window", "sliding_window",
                                                         "max_window_layers")}).layer_types == \
            ["full_attention", "sliding_attention", "sliding_attention"]  # transformers reads it back the same


def test_rope_scaling_is_written_with_its_own_keys():
    linear = ModelConfig.from_hf_dict(tiny_config("llama", rope_scaling={"rope_type": "linear",
                                                                          "factor": 2.0}).to_dict())
    assert linear.to_hf_dict()["rope_scaling"] == {"rope_type": "linear", "factor": 2.0, "type": "linear"}
    llama3 = ModelConfig.from_hf_dict(tiny_config("llama", rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                          "low_freq_factor": 1.0,
                                                                          "high_freq_factor": 4.0}).to_dict())
    assert llama3.rope_scaling.original_max_position_embeddings == 256  # the model's max_position_embeddings


def test_a_weight_beyond_fp16_is_refused_in_fp16_and_runs_in_bf16(tmp_path):
    from flotilla.errors import FlotillaError

    hf = make_hf_model(tiny_config("llama", tie_word_embeddings=False), seed=3)
    with torch.no_grad():
        hf.model.embed_tokens.weight[5, 0] = 1e5  # bf16 and fp32 hold it; fp16 would make it inf
    path = save_hf_model(hf, tmp_path / "big")
    with pytest.raises(FlotillaError, match=r"embed_tokens.weight.*beyond fp16's range.*--dtype bfloat16"):
        load_stage(open_source(path), dtype=torch.float16)
    ours = load_stage(open_source(path), dtype=torch.bfloat16)
    assert torch.isfinite(our_logits(ours, torch.tensor([[1, 5, 7]])).float()).all()


def test_pickle_only_weights_are_refused_with_the_conversion_to_run(tmp_path):
    from flotilla.errors import FlotillaError

    hf = make_hf_model(tiny_config("llama"), seed=1)
    path = save_hf_model(hf, tmp_path / "m")
    for f in path.glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))  # never read: the name alone refuses it
    with pytest.raises(FlotillaError, match=r"only pickle weights.*save_pretrained\('OUT'\)"):
        open_source(path).names()
