"""The Llama-family decoder: Llama 2/3/3.1, Mistral, Qwen2, SmolLM.

Tokens are flattened: a batch of sequences is one [T] vector of token ids (or [T, hidden] of
hidden states for a later pipeline stage), with a [T] vector of positions. Attention goes through
an `AttentionBackend` that the caller supplies (a contiguous cache, a paged cache, or none), so
this file knows nothing of caches, devices or parallelism. Module names follow Hugging Face's,
so a checkpoint's tensor names are this model's state-dict keys.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .linear import make_linear
from .rope import RotaryEmbedding


@dataclass(frozen=True)
class Stage:
    """A half-open range of decoder layers [start, end) of a model with num_layers layers."""

    start: int
    end: int
    num_layers: int

    def __post_init__(self):
        if not 0 <= self.start < self.end <= self.num_layers:
            raise ValueError(f"bad stage [{self.start}, {self.end}) for a model of {self.num_layers} layers")

    @classmethod
    def whole(cls, num_layers: int) -> "Stage":
        return cls(0, num_layers, num_layers)

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.num_layers

    @property
    def layers(self) -> range:
        return range(self.start, self.end)


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (already rotated) -> [T, Hq, D]. Stores k/v as it likes."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # computed in fp32 for half inputs


class Attention(nn.Module):
    # merged linear -> the checkpoint projections it is made of, in output order
    MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        qkv_bias = cfg.attention_bias or cfg.qkv_bias
        self.qkv_proj = make_linear(cfg.hidden_size, [cfg.q_size, cfg.kv_size, cfg.kv_size], qkv_bias, cfg.quant)
        self.o_proj = make_linear(cfg.q_size, [cfg.hidden_size], cfg.attention_bias, cfg.quant)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        T = x.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        # q and k are adjacent in the merged output: rotate them in one go
        qk = RotaryEmbedding.apply(qkv[:, :self.q_size + self.kv_size].view(T, hq + hkv, d), cos, sin)
        v = qkv[:, self.q_size + self.kv_size:].view(T, hkv, d)  # [T, Hkv, D]
        out = attn.attend(self.layer, qk[:, :hq], qk[:, hq:], v)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, hq * d))


class MLP(nn.Module):
    MERGED = {"gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i, b, q = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.quant
        self.intermediate_size = i
        self.gate_up_proj = make_linear(h, [i, i], b, q)
        self.down_proj = make_linear(i, [h], b, q)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        return self.down_proj(F.silu(gate_up[:, :self.intermediate_size]) * gate_up[:, self.intermediate_size:])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, attn: AttentionBackend,
                rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. `rope_tables` (cos, sin) for `positions`, when the caller
        has gathered them once for all layers."""
        cos, sin = rope_tables if rope_tables is not None else rope.tables(positions, x.dtype)
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderStack(nn.Module):
    """`model.*` of a Hugging Face checkpoint, restricted to one stage."""

    def __init__(self, cfg: ModelConfig, stage: Stage):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if stage.is_first else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in stage.layers})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if stage.is_last else None


class CausalLM(nn.Module):
    """One pipeline stage of a Llama-family causal LM; the whole model is the one-stage case."""

    def __init__(self, cfg: ModelConfig, stage: Stage | None = None):
        super().__init__()
        self.config = cfg
        self.stage = stage or Stage.whole(cfg.num_hidden_layers)
        self.model = DecoderStack(cfg, self.stage)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if self.stage.is_last else None
        self.rope: RotaryEmbedding | None = None

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings and self.stage.is_first and self.stage.is_last:
            self.lm_head.weight = self.model.embed_tokens.weight

    def build_rope(self, max_positions: int | None = None) -> None:
        """Create the cos/sin tables on the model's device (call after weights are placed)."""
        cfg = self.config
        device = next(self.parameters()).device
        n = max_positions or cfg.max_model_len
        with torch.device(device):
            self.rope = RotaryEmbedding(cfg.head_dim, n, cfg.rope_theta, cfg.rope_scaling)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """x: token ids [T] on the first stage, else hidden states [T, hidden].
        Returns hidden states [T, hidden], final-normed on the last stage."""
        h = self.embed(x) if self.stage.is_first else x
        tables = self.rope.tables(positions, h.dtype)  # once per step, shared by the layers
        for layer in self.model.layers.values():
            h = layer(h, positions, self.rope, attn, tables)
        if self.stage.is_last:
            h = self.model.norm(h)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> fp32 logits [N, vocab]."""
        return self.lm_head(hidden).float()
