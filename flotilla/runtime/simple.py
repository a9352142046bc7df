"""Single-sequence generation over a contiguous KV cache.

The small, obviously-correct path: one request, no batching, no paging. It is the reference
that the batched engine is checked against (tests/test_engine.py).
"""
from __future__ import annotations

from typing import Iterator

import torch

from flotilla.kernels.attention import sdpa
from flotilla.models.attention import causal_mask
from flotilla.models.llama import CausalLM

from .sampling import SamplingParams


class ContiguousKVCache:
    """k/v for one sequence: [layers][max_len, Hkv, D]; tokens are appended at `length`."""

    def __init__(self, model: CausalLM, max_len: int):
        cfg = model.config
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        shape = (max_len, cfg.num_key_value_heads, cfg.head_dim)
        self.k = {i: torch.empty(shape, dtype=dtype, device=device) for i in model.stage.layers}
        self.v = {i: torch.empty(shape, dtype=dtype, device=device) for i in model.stage.layers}
        self.length = 0  # tokens stored before the current step
        self.step_len = 0

    def begin(self, n: int) -> None:
        self.step_len = n

    def end(self) -> None:
        self.length += self.step_len

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor:
        start, end = self.length, self.length + q.shape[0]
        self.k[layer][start:end] = k
        self.v[layer][start:end] = v
        keys = self.k[layer][:end].transpose(0, 1)  # [Hkv, S, D]
        vals = self.v[layer][:end].transpose(0, 1)
        qh = q.transpose(0, 1)  # [Hq, T, D]
        T, S = q.shape[0], end
        mask = causal_mask(T, S, start, window, q.device)  # query i sees keys up to start + i
        out = sdpa(qh, keys, vals, attn_mask=mask, enable_gqa=qh.shape[0] != keys.shape[0], softcap=softcap)
        return out.transpose(0, 1)  # [T, Hq, D]


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [vocab] (fp32) -> one token id."""
    if params.greedy:
        return int(logits.argmax())
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        drop = sorted_p.cumsum(0) - sorted_p > params.top_p
        probs = probs.scatter(0, idx, sorted_p.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.inference_mode()
def generate_tokens(model: CausalLM, prompt_ids: list[int], params: SamplingParams,
                    eos_token_ids: tuple[int, ...] = ()) -> Iterator[int]:
    """Yield generated token ids one at a time (the stop token included, then stop)."""
    device = next(model.parameters()).device
    max_len = min(model.config.max_model_len, len(prompt_ids) + params.max_tokens)
    cache = ContiguousKVCache(model, max_len)
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device).manual_seed(params.seed)
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    tokens = torch.tensor(prompt_ids, device=device)
    for _ in range(min(params.max_tokens, max_len - len(prompt_ids))):
        positions = torch.arange(cache.length, cache.length + tokens.shape[0], device=device)
        cache.begin(tokens.shape[0])
        hidden = model(tokens, positions, cache)
        cache.end()
        next_id = sample_next(model.compute_logits(hidden[-1:])[0], params, generator)
        yield next_id
        if next_id in stops:
            return
        tokens = torch.tensor([next_id], device=device)
