"""Shared fixtures: the embedded default model (SmolLM2-135M GGUF) and small random models."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(2)

# Triton chooses its interpreter when a kernel is defined (at import) and keeps it for the whole process. With
# no GPU visible, every Triton test runs on CPU tensors through the interpreter: switched on here, before any
# test module imports triton. On a GPU the kernels compile for it, the GPU tests run, and the interpreter's
# test files skip (run them apart: TRITON_INTERPRET=1 python -m pytest tests/test_triton_kernels.py ...);
# TRITON_INTERPRET=1 set before pytest starts runs those and skips the GPU tests instead. (Mixed in one
# process, kernels defined after the switch were interpreted inside GPU tests: "Cannot copy between CPU and
# CUDA tensors during CUDA graph capture".)
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRETED = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")  # as Triton reads it
GPU = torch.cuda.is_available() and not INTERPRETED
GPU_SKIP_REASON = ("needs a CUDA GPU" if not torch.cuda.is_available()
                   else "Triton interprets in this process (TRITON_INTERPRET=1): the GPU tests run without it")
needs_gpu = pytest.mark.skipif(not GPU, reason=GPU_SKIP_REASON)


def interpreter_only() -> None:
    """Skip the calling test module unless Triton interprets in this process (see above)."""
    if not INTERPRETED:
        pytest.skip("Triton kernels compile for the GPU in this process; run this file apart with "
                    "TRITON_INTERPRET=1 python -m pytest ...", allow_module_level=True)

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
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-5,
                bos_token_id=1, eos_token_id=2)
    base.update(overrides)
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    return cls(**base)


def make_hf_model(config, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    from flotilla.runtime.random_model import randomize

    # larger-than-init weights so that errors show up in the logits; eager attention, the reference's: a transformers
    # whose default is SDPA leaves Gemma 2's attention soft-cap out (the device image's did: every token differed)
    return randomize(AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                      attn_implementation="eager").eval())


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


def save_byte_tokenizer(directory: Path, chat_template: str | None = None) -> None:
    """A 256-token byte-level tokenizer (ids 0..255), enough to drive a tiny random model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=alphabet[2])
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(str(directory))


SIMPLE_CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")


def write_llama_gguf(hf_model, path: Path, qtype: str = "F32", uint32s: dict | None = None) -> Path:
    """Write a transformers Llama (or Qwen3, or Phi-3) model as a llama.cpp-style GGUF (a Llama's q/k permuted,
    names mapped; Phi-3's fused q/k/v and gate/up kept so, its longrope factors as llama.cpp's two tensors);
    `uint32s`: more metadata keys."""
    import gguf
    import numpy as np

    cfg = hf_model.config
    arch = {"gemma3_text": "gemma3"}.get(cfg.model_type, cfg.model_type)  # llama.cpp's architecture names
    w = gguf.GGUFWriter(str(path), arch)
    w.add_key_length(cfg.head_dim if getattr(cfg, "head_dim", None) else cfg.hidden_size // cfg.num_attention_heads)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if "rope_theta" in cfg.rope_parameters:
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    w.add_eos_token_id(2)
    for key, value in (uint32s or {}).items():
        w.add_uint32(key, value)
    rope = cfg.rope_parameters
    if arch == "gemma2":  # every second layer global (llama.cpp's rule, not written); the soft-capping
        w.add_sliding_window(cfg.sliding_window)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):  # (None: a file from before llama.cpp wrote them)
            if getattr(cfg, key) is not None:
                w.add_float32(f"gemma2.{key}", getattr(cfg, key))
    if arch == "gemma3":  # the global layers' rope; every sixth layer global (llama.cpp's rule, not written)
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_sliding_window(cfg.sliding_window)
        if rope["full_attention"].get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["full_attention"]["factor"])
    elif rope.get("rope_type") == "longrope":  # as llama.cpp's convert_hf_to_gguf writes Phi-3's
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:
            w.add_float32(f"{arch}.rope.scaling.attn_factor", rope["attention_factor"])
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))

    def permute(t, n_head):
        return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "qkv_proj": "attn_qkv", "gate_up_proj": "ffn_up"}
    qt = gguf.GGMLQuantizationType[qtype]
    for name, t in hf_model.state_dict().items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            out = "output.weight"
        else:
            parts = name.split(".")  # model.layers.N.(self_attn|mlp).X.weight or model.layers.N.X.weight
            proj = parts[-2]
            if proj == "q_proj" and arch == "llama":  # llama.cpp permutes a Llama's q and k rows (not Qwen's)
                a = permute(a, cfg.num_attention_heads)
            elif proj == "k_proj" and arch == "llama":
                a = permute(a, cfg.num_key_value_heads)
            layer_names = {**names, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm":
                           "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"} if arch.startswith("gemma") \
                else names
            out = f"blk.{parts[2]}.{layer_names[proj]}.{parts[-1]}"
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            a = a + 1.0  # llama.cpp stores Gemma's norms as 1 + w
        if a.ndim == 2 and qt != gguf.GGMLQuantizationType.F32:
            w.add_tensor(out, gguf.quants.quantize(np.ascontiguousarray(a), qt), raw_dtype=qt)
        else:
            w.add_tensor(out, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
