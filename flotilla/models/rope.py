"""Rotary position embeddings (Hugging Face's rotate-half convention), with llama3, linear and longrope
(Phi-3) scaling."""
from __future__ import annotations

import math

import torch

from flotilla.kernels.fused import rope

from .config import RopeScaling


def inv_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def llama3_freq_factors(head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """Per-frequency divisors of Llama 3.1's scaling (what llama.cpp stores as rope_freqs)."""
    inv = inv_frequencies(head_dim, theta)
    wavelen = 2 * math.pi / inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    mid = 1.0 / ((1 - smooth) / s.factor + smooth)
    factors = torch.where(wavelen > low_wavelen, torch.full_like(inv, s.factor), mid)
    factors = torch.where(wavelen < high_wavelen, torch.ones_like(inv), factors)
    return factors.float()


def longrope_inv_frequencies(head_dim: int, theta: float, factors: tuple[float, ...]) -> torch.Tensor:
    """Phi-3's longrope with one set of factors, in fp32 as transformers computes it: 1 / (f_i theta^(2i / d))."""
    if len(factors) != head_dim // 2:
        raise ValueError(f"longrope has {len(factors)} factors for a head of {head_dim} ({head_dim // 2} frequencies)")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** exponent)


def longrope_frequencies(head_dim: int, max_positions: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """The angles [P, D/2] of longrope: the short factors at positions within the original context, the long ones
    past it. A sequence within the original context is what transformers computes for it (short factors; it picks
    by the sequence's length); past it, a token's q and k take the long factors while the cached ones keep theirs,
    as vLLM's decode does (it picks by the batch's positions)."""
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, longrope_inv_frequencies(head_dim, theta, s.short_factor))
    k = s.original_max_position_embeddings
    if max_positions > k:
        freqs[k:] = torch.outer(t[k:], longrope_inv_frequencies(head_dim, theta, s.long_factor))
    return freqs


def scaled_inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv = inv_frequencies(head_dim, theta)
    if scaling is None:
        return inv.float()
    if scaling.rope_type == "linear":
        return (inv / scaling.factor).float()
    if scaling.rope_type == "llama3":
        return (inv / llama3_freq_factors(head_dim, theta, scaling).double()).float()
    raise ValueError(f"unsupported rope type {scaling.rope_type!r}")


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for every position up to max_positions, applied by position index.

    The tables are kept full width with the rotate-half sign folded into sin, so that applying
    them is x * cos + roll(x, D/2) * sin: three element-wise ops for q and k together."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None):
        super().__init__()
        if scaling is not None and scaling.rope_type == "longrope":
            freqs = longrope_frequencies(head_dim, max_positions, theta, scaling)
        else:
            t = torch.arange(max_positions, dtype=torch.float32)
            freqs = torch.outer(t, scaled_inv_frequencies(head_dim, theta, scaling))  # [P, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        if scaling is not None and scaling.attention_factor != 1.0:  # longrope scales both tables
            cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)  # [P, D]
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1), persistent=False)  # [P, D], signed
        self._joint: dict[torch.dtype, torch.Tensor] = {}  # [P, 2, D] cos and sin rounded to a dtype

    def tables(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, 1, D] for the positions [T]: gathered once per step, used by every layer.
        In another dtype than the tables' (fp16 / bf16 on a GPU), one gather from a joint table
        rounded once beforehand (the same values as rounding what was gathered): one kernel, where
        two gathers and two casts were four, each its own launch in the decode step's graph."""
        if dtype == self.cos.dtype:
            return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        joint = self._joint.get(dtype)
        if joint is None or joint.device != self.cos.device:
            if self.cos.is_cuda and torch.cuda.is_current_stream_capturing():  # not built inside a graph
                return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)
            joint = self._joint[dtype] = torch.stack((self.cos, self.sin), dim=1).to(dtype)
        both = joint[positions]  # [T, 2, D]
        return both[:, 0:1], both[:, 1:2]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, H, D] (rotate-half convention): [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin],
        i.e. x * cos + roll(x, D/2) * sin (one Triton kernel on CUDA)."""
        return rope(x, cos, sin)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q [T, Hq, D], k [T, Hkv, D], positions [T]
        cos, sin = self.tables(positions, q.dtype)
        return self.apply(q, cos, sin), self.apply(k, cos, sin)


class DualRotaryEmbedding(torch.nn.Module):
    """Two rotaries for one model (Gemma 3): the global layers' (index 0: rope_theta, with the model's scaling)
    and the sliding-window layers' (index 1: their own base, unscaled). `tables` stacks both: cos and sin
    [2, T, 1, D]; each layer takes its own (`for_layer`)."""

    def __init__(self, glob: RotaryEmbedding, local: RotaryEmbedding):
        super().__init__()
        self.glob, self.local = glob, local

    def tables(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        c0, s0 = self.glob.tables(positions, dtype)
        c1, s1 = self.local.tables(positions, dtype)
        return torch.stack((c0, c1)), torch.stack((s0, s1))


def for_layer(cos: torch.Tensor, sin: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's (cos, sin) [T, 1, D] from a model's tables: DualRotaryEmbedding's [2, T, 1, D] hold one per index."""
    return (cos[index], sin[index]) if cos.dim() == 4 else (cos, sin)


def model_rope(cfg, max_positions: int) -> torch.nn.Module:
    """The rotary of a model config (models.config.ModelConfig): one table, or Gemma 3's two."""
    glob = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
    if cfg.rope_local_theta is None:
        return glob
    return DualRotaryEmbedding(glob, RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_local_theta, None))
