"""Attention backends for equal-length batches, used outside the runtime's engine.

`DenseCausalAttention` is cache-free: checking logits against transformers, running calibration
batches through layers in `quantize`, perplexity windows. `LockstepKVCache` is the smallest cache
that lets `quantize` sample calibration text from a model, many sequences at once. The runtime's
paged backends live in `flotilla.runtime`.
"""
from __future__ import annotations

import torch

from flotilla.kernels.attention import sdpa


def causal_mask(queries: int, keys: int, start: int, window: int, device) -> torch.Tensor | None:
    """[queries, keys] bool: query i (at position start + i) sees key j iff j <= start + i, and, with a sliding
    `window` > 0, j > start + i - window; None where plain causal attention of a lone query needs no mask."""
    if queries == 1 and (not window or keys <= window):
        return None
    pos = torch.arange(queries, device=device)[:, None] + start
    j = torch.arange(keys, device=device)[None, :]
    visible = j <= pos
    return visible & (j > pos - window) if window else visible


class DenseCausalAttention:
    """The flattened tokens are `batch` sequences of `seq_len` tokens each, all starting at 0."""

    def __init__(self, batch: int, seq_len: int):
        self.batch, self.seq_len = batch, seq_len

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor:
        B, L = self.batch, self.seq_len
        Hq, D = q.shape[1], q.shape[2]
        qb = q.view(B, L, Hq, D).transpose(1, 2)  # [B, Hq, L, D]
        kb = k.view(B, L, k.shape[1], D).transpose(1, 2)  # [B, Hkv, L, D]
        vb = v.view(B, L, v.shape[1], D).transpose(1, 2)
        mask = causal_mask(L, L, 0, window, q.device) if window and window < L else None
        out = sdpa(qb, kb, vb, attn_mask=mask, is_causal=mask is None, enable_gqa=Hq != kb.shape[1], softcap=softcap)
        return out.transpose(1, 2).reshape(B * L, Hq, D)  # [T, Hq, D]


class LockstepKVCache:
    """A KV cache for `batch` sequences that all advance together (equal lengths, all starting
    at position 0), as in batched sampling of calibration text.

    Each step feeds `n` new tokens per sequence, flattened sequence-major ([B * n] tokens);
    after the model call, `advance(n)` commits them. Storage: per layer k and v [B, max_len, Hkv, D].
    """

    def __init__(self, layers, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (batch, max_len, num_kv_heads, head_dim)
        self.k = {i: torch.empty(shape, dtype=dtype, device=device) for i in layers}
        self.v = {i: torch.empty(shape, dtype=dtype, device=device) for i in layers}
        self.batch, self.max_len = batch, max_len
        self.length = 0  # tokens per sequence stored before the current step

    def advance(self, n: int) -> None:
        self.length += n

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor:
        B, start = self.batch, self.length
        n = q.shape[0] // B
        end = start + n
        if end > self.max_len:
            raise ValueError(f"lockstep cache holds {self.max_len} tokens per sequence; step would reach {end}")
        self.k[layer][:, start:end] = k.view(B, n, *k.shape[1:])
        self.v[layer][:, start:end] = v.view(B, n, *v.shape[1:])
        keys = self.k[layer][:, :end].transpose(1, 2)  # [B, Hkv, S, D]
        vals = self.v[layer][:, :end].transpose(1, 2)
        qb = q.view(B, n, *q.shape[1:]).transpose(1, 2)  # [B, Hq, n, D]
        mask = causal_mask(n, end, start, window, q.device)  # query i of the step sees keys up to start + i
        out = sdpa(qb, keys, vals, attn_mask=mask, enable_gqa=qb.shape[1] != keys.shape[1], softcap=softcap)
        return out.transpose(1, 2).reshape(B * n, *q.shape[1:])  # [T, Hq, D]
