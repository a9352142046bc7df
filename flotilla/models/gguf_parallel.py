"""Tensor-parallel GGUF layers: each rank keeps its share of every tensor in the file's own blocks.

  column-parallel (qkv_proj, gate_up_proj): each projection's rows (outputs) divided; whole rows
      of blocks, so any type slices natively.
  row-parallel (o_proj, down_proj): each rank takes a run of inputs, i.e. of every row's blocks.
      Native when the run is whole scale groups of the type (32 inputs, 16 for Q6_K); otherwise
      that projection is dequantized and its fp32 columns sliced, which the load report shows
      ("fp32: a rank's share is not whole Q… groups"). The output is all-reduced; the bias is
      added by rank 0 alone.
  vocab-parallel embedding and lm_head: each rank holds rows of the vocabulary (masked lookup +
      all-reduce; logit columns gathered on rank 0), as flotilla.models.parallel does for fp32.
"""
from __future__ import annotations

import torch
from torch import nn

from flotilla.errors import FlotillaError
from flotilla.kernels.ggml import GGMLWeight
from flotilla.kernels.ggml_kernels import Part

from .gguf_linear import GGUFEmbedding, GGUFLinear, GGUFLMHead
from .parallel import _share, _take
from .parallel_state import TPGroup


def _narrow(value: Part, dim: int, part: slice, full: int) -> Part:
    """This rank's `part` of a GGUF part along `dim` (0: outputs, 1: inputs), which must be whole."""
    if not isinstance(value, GGMLWeight):
        return _take(value, dim, part, full)
    if value.shape[dim] != full:
        raise FlotillaError(f"shape {value.shape}: expected {full} along axis {dim} (the whole tensor, which each "
                            "tensor-parallel rank slices)")
    return value.narrow(dim, part.start, part.stop - part.start)


class ColumnParallelGGUFLinear(GGUFLinear):
    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, group: TPGroup):
        super().__init__(in_features, [_share(n, group) for n in out_sizes], bias)
        self.group, self.full_out_sizes = group, list(out_sizes)

    def load(self, suffix: str, shard: int, value: Part) -> None:
        full = self.full_out_sizes[shard]
        super().load(suffix, shard, _narrow(value, 0, self.group.part(full), full))


class RowParallelGGUFLinear(GGUFLinear):
    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, group: TPGroup):
        super().__init__(_share(in_features, group), out_sizes, bias)
        self.group, self.full_in_features = group, in_features
        self.fallbacks: dict[int, str] = {}  # shard -> why it runs in fp32

    def load(self, suffix: str, shard: int, value: Part) -> None:
        if suffix == "weight":
            cols = self.group.part(self.full_in_features)
            if isinstance(value, GGMLWeight) and (cols.start % value.format.group or cols.stop % value.format.group):
                self.fallbacks[shard] = (f"fp32: a rank's share of {self.full_in_features} inputs is not whole "
                                         f"{value.qtype} groups of {value.format.group}")
                value = value.dequantize()
            value = _narrow(value, 1, cols, self.full_in_features)
        super().load(suffix, shard, value)

    def part_form(self, shard: int) -> str:
        return self.fallbacks.get(shard) or super().part_form(shard)

    def fn(self):
        kernel, reduce = self.kernel, self.group.all_reduce
        bias = self.bias if self.group.is_first else None

        def row_parallel(x: torch.Tensor) -> torch.Tensor:
            return reduce(kernel(x, bias))  # [T, out]: the sum of every rank's share
        return row_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn()(x)


class _VocabShare:
    """Holds rows [vocab_start, vocab_start + local) of the [vocab, hidden] table."""

    group: TPGroup
    full_vocab: int
    weight: object

    def load(self, suffix: str, shard: int, value: Part) -> None:
        self.weight.load(_narrow(value, 0, self.group.part(self.full_vocab), self.full_vocab))


class VocabParallelGGUFEmbedding(_VocabShare, GGUFEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup):
        GGUFEmbedding.__init__(self, _share(vocab_size, group), hidden_size)
        self.group, self.full_vocab, self.vocab_start = group, vocab_size, group.part(vocab_size).start

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        local = token_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)  # [T]: ids another rank holds
        h = self.weight.rows(local.masked_fill(outside, 0))  # [T, hidden]
        return self.group.all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelGGUFLMHead(_VocabShare, GGUFLMHead):
    def __init__(self, hidden_size: int, vocab_size: int, group: TPGroup):
        GGUFLMHead.__init__(self, hidden_size, _share(vocab_size, group))
        self.group, self.full_vocab = group, vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.gather_columns(self.weight.kernel(x))

    def fn(self):
        kernel, gather = self.weight.kernel, self.group.gather_columns

        def parallel_logits(x: torch.Tensor) -> torch.Tensor:
            return gather(kernel(x))  # [N, vocab] on rank 0, [N, 0] elsewhere
        return parallel_logits


def parallel_gguf_linear(in_features: int, out_sizes: list[int], bias: bool, split: str, group: TPGroup) -> nn.Module:
    cls = ColumnParallelGGUFLinear if split == "column" else RowParallelGGUFLinear
    return cls(in_features, out_sizes, bias, group)
