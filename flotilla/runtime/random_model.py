"""Random-weight models of named shapes, built straight on the device: benchmarks need no checkpoint.

    model = build_random_model("llama-3-8b", bits=4, device="cuda", dtype=torch.float16)

Quantized linears get random GPTQ tensors (uniform codes, symmetric zero, one scale per group
and output) and choose their kernel through the registry exactly as a loaded checkpoint does;
`bits=16` builds plain fp linears. Scales are sized so that each linear roughly preserves the
variance of its input, which keeps the activations of a deep random model finite in fp16.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from flotilla.errors import FlotillaError
from flotilla.models.config import ModelConfig, QuantConfig
from flotilla.models.linear import Linear, QuantLinear
from flotilla.models.llama import CausalLM, RMSNorm
from flotilla.models.weights import build_stage

_LLAMA3 = dict(architecture="LlamaForCausalLM", vocab_size=128256, head_dim=128, rms_norm_eps=1e-5,
               rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
               bos_token_id=128000, eos_token_ids=(128001,), torch_dtype="bfloat16")

SHAPES: dict[str, ModelConfig] = {
    "llama-3-8b": ModelConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=8, **_LLAMA3),
    "llama-3-70b": ModelConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                               num_attention_heads=64, num_key_value_heads=8, **_LLAMA3),
    # small enough for CPU tests; every linear's input is a multiple of group size 128
    "tiny": ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=1024,
                        tie_word_embeddings=False, eos_token_ids=()),
}

BITS = (4, 8, 16)  # 16: unquantized linears in the activation dtype


def shape_config(name: str, bits: int = 16, group_size: int = 128, num_layers: int | None = None) -> ModelConfig:
    """The config of a named shape, quantized to `bits` (GPTQ, symmetric, `group_size`)."""
    if name not in SHAPES:
        raise FlotillaError(f"unknown model shape {name!r}; valid: {', '.join(SHAPES)}")
    if bits not in BITS:
        raise FlotillaError(f"--bits {bits}: expected one of {', '.join(map(str, BITS))}")
    cfg = SHAPES[name]
    if num_layers is not None:
        if not 1 <= num_layers <= cfg.num_hidden_layers:
            raise FlotillaError(f"{name} has {cfg.num_hidden_layers} layers; asked for {num_layers}")
        cfg = replace(cfg, num_hidden_layers=num_layers)
    quant = None if bits == 16 else QuantConfig(bits=bits, group_size=group_size, sym=True, method="rtn")
    return cfg.with_quant(quant)


@torch.no_grad()
def build_random_model(name: str, bits: int = 4, device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.float32, group_size: int = 128, seed: int = 0,
                       num_layers: int | None = None) -> CausalLM:
    """A whole model of shape `name` with random weights, ready for a ModelRunner."""
    cfg = shape_config(name, bits, group_size, num_layers)
    device = torch.device(device)
    model = build_stage(cfg, None, device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            _fill_quant(mod, gen)
        elif isinstance(mod, Linear):
            mod.weight.normal_(0, mod.in_features ** -0.5, generator=gen)
            if mod.bias is not None:
                mod.bias.zero_()
        elif isinstance(mod, RMSNorm):
            mod.weight.fill_(1.0)
    model.model.embed_tokens.weight.normal_(0, 1.0, generator=gen)
    model.lm_head.weight.normal_(0, cfg.hidden_size ** -0.5, generator=gen)
    model.build_rope()
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            mod.prepare(dtype)
    return model


def _fill_quant(mod: QuantLinear, gen: torch.Generator) -> None:
    """Uniform random codes (uniform random words), zero at the middle code, scales around
    1 / (std(code - zero) * sqrt(in))."""
    bits = mod.bits
    mod.qweight.random_(-2**31, 2**31, generator=gen)
    field = (1 << (bits - 1)) - 1  # the stored zero - 1 (gptq convention)
    word = sum(field << (i * bits) for i in range(32 // bits))
    mod.qzeros.fill_(word - 2**32 if word >= 2**31 else word)
    code_std = math.sqrt(((1 << bits) ** 2 - 1) / 12)
    base = 1.0 / (code_std * math.sqrt(mod.in_features))
    mod.scales.uniform_(0.5 * base, 1.5 * base, generator=gen)
    mod.g_idx.copy_(torch.arange(mod.in_features, device=mod.g_idx.device, dtype=torch.int32)
                    // (mod.in_features if mod.group_size == -1 else mod.group_size))
    if mod.bias is not None:
        mod.bias.zero_()


def weight_bytes(model: CausalLM) -> int:
    """Bytes a decode step reads from the weights: every linear's kernel-side tensors (the GPTQ
    tensors where the kernel keeps no repacked layout), the lm_head and the norms; the embedding
    contributes one row per token and is left out."""
    total = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            layout = getattr(mod.kernel, "layout", None)  # the Triton kernel's repacked tensors
            parts = (layout.words, layout.scales, layout.zeros) if layout is not None else (mod.qweight, mod.scales)
            total += sum(t.numel() * t.element_size() for t in parts if t is not None)
        elif isinstance(mod, (Linear, RMSNorm)):
            total += sum(p.numel() * p.element_size() for p in mod.parameters())
    if model.lm_head is not None:
        total += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    return total
