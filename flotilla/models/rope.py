"""Rotary position embeddings (Hugging Face's rotate-half convention), with llama3 and linear
scaling."""
from __future__ import annotations

import math

import torch

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
    """cos/sin tables for every position up to max_positions, applied by position index."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None):
        super().__init__()
        inv = scaled_inv_frequencies(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv)  # [P, D/2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q [T, Hq, D], k [T, Hkv, D], positions [T]
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
