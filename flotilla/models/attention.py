"""Cache-free causal attention over equal-length sequences.

Used where there is no KV cache: checking logits against transformers and running calibration
batches through layers in `quantize`. The runtime's cached backends live in `flotilla.runtime`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class DenseCausalAttention:
    """The flattened tokens are `batch` sequences of `seq_len` tokens each, all starting at 0."""

    def __init__(self, batch: int, seq_len: int):
        self.batch, self.seq_len = batch, seq_len

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, L = self.batch, self.seq_len
        Hq, D = q.shape[1], q.shape[2]
        qb = q.view(B, L, Hq, D).transpose(1, 2)  # [B, Hq, L, D]
        kb = k.view(B, L, k.shape[1], D).transpose(1, 2)  # [B, Hkv, L, D]
        vb = v.view(B, L, v.shape[1], D).transpose(1, 2)
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=Hq != kb.shape[1])
        return out.transpose(1, 2).reshape(B * L, Hq, D)  # [T, Hq, D]
