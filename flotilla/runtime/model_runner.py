"""Turns one scheduled step into tensors and runs a model stage over the paged KV cache.

`StepInput` is plain lists, so the head can build it and send it to a remote stage unchanged
(issue: pipeline parallel); the runner works for any stage: the first embeds `token_ids`, later
ones take the previous stage's hidden states, and the last computes logits for the sampling
rows and samples them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flotilla.kernels.attention import PagedAttentionMetadata
from flotilla.models.llama import CausalLM

from .kv_cache import KVCache, PagedAttentionBackend
from .sampler import Sampler, SamplerOutput, SamplingBatch


@dataclass(frozen=True)
class StepInput:
    """One step's batch: B sequences, decodes (one new token) first."""

    request_ids: list[str]
    token_ids: list[int]  # the T new tokens, flattened in batch order
    starts: list[int]  # position of each sequence's first new token (= tokens already computed)
    query_lens: list[int]  # new tokens per sequence
    block_tables: list[list[int]]  # logical -> physical block ids, covering start + query_len tokens
    num_decodes: int
    sample: list[bool]  # whether each sequence samples a token this step (reaches its end)
    sampling: SamplingBatch | None = None  # one row per sampling sequence, in batch order

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.starts)


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, sampler: Sampler | None = None):
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.block_size = cache.spec.block_size
        self.scale = model.config.head_dim ** -0.5
        self.sampler = sampler or (Sampler(model.config.vocab_size) if model.stage.is_last else None)

    @torch.inference_mode()
    def execute(self, step: StepInput, hidden: torch.Tensor | None = None) -> SamplerOutput | torch.Tensor:
        """Run the stage: returns sampled tokens on the last stage, else hidden states [T, H]."""
        positions, meta = self.prepare(step)
        x = torch.tensor(step.token_ids, dtype=torch.long, device=self.device) if self.model.stage.is_first else hidden
        h = self.model(x, positions, PagedAttentionBackend(self.cache, meta, self.scale))
        if not self.model.stage.is_last:
            return h
        return self.sampler(self.compute_logits(step, h), step.sampling)

    def compute_logits(self, step: StepInput, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, vocab] of the last new token of each sampling sequence."""
        ends, end = [], 0
        for qlen, samples in zip(step.query_lens, step.sample):
            end += qlen
            if samples:
                ends.append(end - 1)
        if len(ends) < hidden.shape[0]:
            hidden = hidden.index_select(0, torch.tensor(ends, device=hidden.device))
        return self.model.compute_logits(hidden)

    def prepare(self, step: StepInput) -> tuple[torch.Tensor, PagedAttentionMetadata]:
        """Positions [T] and the attention metadata of a step (built on the host from lists, then
        moved to the device in one go)."""
        bs, nd = self.block_size, step.num_decodes
        starts = torch.tensor(step.starts, dtype=torch.long)
        qlens = torch.tensor(step.query_lens, dtype=torch.long)
        seq_lens = starts + qlens
        width = max(len(t) for t in step.block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in step.block_tables], dtype=torch.long)
        T = step.num_tokens
        seq_of_token = torch.repeat_interleave(torch.arange(step.num_seqs), qlens, output_size=T)
        first_row = torch.cumsum(qlens, 0) - qlens
        positions = starts[seq_of_token] + torch.arange(T) - first_row[seq_of_token]
        slots = tables[seq_of_token, positions // bs] * bs + positions % bs
        dev = self.device
        seq_list = [s + q for s, q in zip(step.starts, step.query_lens)]
        meta = PagedAttentionMetadata(
            slot_mapping=slots.to(dev),
            block_tables=tables.to(dev),
            seq_lens=seq_lens.to(dev),
            query_lens=qlens.to(dev),
            block_size=bs,
            num_decodes=nd,
            max_decode_seq_len=max(seq_list[:nd], default=0),
            max_prefill_query_len=max(step.query_lens[nd:], default=0),
            max_prefill_seq_len=max(seq_list[nd:], default=0),
        )
        return positions.to(dev), meta
