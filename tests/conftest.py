"""Shared fixtures: the embedded default model (SmolLM2-135M GGUF) and small random models."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(2)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real test model, fetched once into the cache like `runtime chat` does."""
    from flotilla.runtime.default_model import default_model_path

    return default_model_path()


def save_hf_model(hf_model, directory: Path, tokenizer_dir: Path | None = None) -> Path:
    """Write a transformers model as a safetensors Hugging Face directory."""
    hf_model.save_pretrained(str(directory), safe_serialization=True)
    return directory


def tiny_config(family: str = "llama", **overrides):
    """A small random-weight config of a Llama-family architecture, as transformers builds it."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-5,
                bos_token_id=1, eos_token_id=2)
    base.update(overrides)
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[family]
    return cls(**base)


def make_hf_model(config, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # larger-than-init weights so that errors show up in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.08)
    return model


@pytest.fixture
def tiny_llama_dir(tmp_path) -> Path:
    model = make_hf_model(tiny_config("llama"))
    return save_hf_model(model, tmp_path / "tiny-llama")


def read_json(p: Path) -> dict:
    return json.loads(p.read_text())


@pytest.fixture(scope="session")
def smollm2_int4(smollm2_gguf) -> Path:
    """SmolLM2-135M as an RTN INT4 (group 32) GPTQ-layout checkpoint, built once and cached."""
    from rtn_int4 import smollm2_int4_path

    return smollm2_int4_path(smollm2_gguf)
