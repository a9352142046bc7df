"""Tensor-parallel layers: column- and row-parallel linears (plain and GPTQ), and the
vocab-parallel embedding and lm_head. The factories of flotilla.models.linear build them while a
TPGroup is current (flotilla.models.parallel_state); the model never names them.

Each holds this rank's share and slices the checkpoint's whole tensors as they load
(`load(suffix, shard, value)` receives what the file holds, as for the single-device layers):

  column-parallel (qkv_proj, gate_up_proj): every projection of a merged linear is divided along
      its output axis, so a rank computes whole heads (the q, k and v of its heads) or its share of
      the intermediate units, with no communication.
        plain: weight rows and bias.  GPTQ: qweight and scales columns, qzeros packed columns (a
        rank's share is whole int32 words: check_divisible), bias; g_idx (the input axis) whole.
  row-parallel (o_proj, down_proj): the input axis is divided; the partial products are summed
      by an all-reduce, and the bias is added by rank 0 alone (before the sum).
        plain: weight columns.  GPTQ: qweight rows (whole words) and g_idx rows; the scales and
        qzeros of the groups those rows use, [min, max] of the slice's g_idx, with g_idx rebased
        to the first kept group.

Act-order and group boundaries. Without act-order and with group boundaries on rank boundaries (a
partial last group, when the group size does not divide the input axis, is the last rank's),
a rank keeps exactly its own groups and its g_idx is again `i // group_size`: every kernel serves
it as it serves an unsplit linear. Otherwise — act-order, where one group's rows are spread over
the whole input axis, or a group that straddles two ranks — the slice's g_idx is an arbitrary map
into the kept groups (with act-order nearly all of them: scales and zeros are not divided). Such
a split is exact for the kernels that read g_idx row by row: reference, dense, and the compiled
CPU kernel (it sorts rows by group and skips empty groups). The Triton layout cannot express it:
it needs every group to be one run of exactly group_size rows after sorting, so on CUDA these
row-parallel linears fall back to the dense kernel (dequantized once at load, 4x the INT4 bytes).
What cannot be split at all is a packed axis whose per-rank share is not whole int32 words;
check_divisible rejects that before anything loads.

Vocab-parallel embedding and lm_head hold rows [rank * V / n, (rank + 1) * V / n) of the
vocabulary: the embedding looks up the ids in its range, zeroes the rest and all-reduces; the
lm_head computes its logit columns and gathers them on rank 0, the only rank that samples.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.errors import FlotillaError
from flotilla.kernels.gptq import default_g_idx, num_groups

from .config import GGUFQuant, QuantConfig
from .linear import Linear, LMHead, QuantLinear
from .parallel_state import TPGroup


def _take(value: torch.Tensor, dim: int, part: slice, full: int) -> torch.Tensor:
    """This rank's `part` of `value` along `dim`, which must hold the whole axis of `full`."""
    if value.dim() <= dim or value.shape[dim] != full:
        raise FlotillaError(f"shape {tuple(value.shape)}: expected {full} along axis {dim} "
                            f"(the whole tensor, which each tensor-parallel rank slices)")
    return value.narrow(dim, part.start, part.stop - part.start)


def _share(n: int, group: TPGroup) -> int:
    """This rank's share of an axis of n (a FlotillaError if n does not divide)."""
    part = group.part(n)
    return part.stop - part.start


# ----------------------------------------------------------------------------- plain linears

class ColumnParallelLinear(Linear):
    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, group: TPGroup):
        super().__init__(in_features, [_share(n, group) for n in out_sizes], bias)
        self.group, self.full_out_sizes = group, list(out_sizes)

    def load(self, suffix: str, shard: int, value: torch.Tensor) -> None:
        full = self.full_out_sizes[shard]
        super().load(suffix, shard, _take(value, 0, self.group.part(full), full))


class RowParallelLinear(Linear):
    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, group: TPGroup):
        super().__init__(_share(in_features, group), out_sizes, bias)
        self.group, self.full_in_features = group, in_features

    def load(self, suffix: str, shard: int, value: torch.Tensor) -> None:
        if suffix == "weight":
            value = _take(value, 1, self.group.part(self.full_in_features), self.full_in_features)
        super().load(suffix, shard, value)

    def fn(self):
        weight, bias, reduce = self.weight, self.bias if self.group.is_first else None, self.group.all_reduce

        def row_parallel(x: torch.Tensor) -> torch.Tensor:
            return reduce(F.linear(x, weight, bias))  # [T, out]: the sum of every rank's share
        return row_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn()(x)


# ------------------------------------------------------------------------------ GPTQ linears

class ColumnParallelQuantLinear(QuantLinear):
    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, quant: QuantConfig, group: TPGroup):
        super().__init__(in_features, [_share(n, group) for n in out_sizes], bias, quant)
        self.group, self.full_out_sizes = group, list(out_sizes)

    def load(self, suffix: str, shard: int, value: torch.Tensor) -> None:
        full = self.full_out_sizes[shard]
        cols = self.group.part(full)
        if suffix in ("qweight", "scales"):
            value = _take(value, 1, cols, full)
        elif suffix == "qzeros":
            per_word = 32 // self.bits
            value = _take(value, 1, slice(cols.start // per_word, cols.stop // per_word), full // per_word)
        elif suffix == "bias":
            value = _take(value, 0, cols, full)
        super().load(suffix, shard, value)  # g_idx: the input axis, whole


class RowParallelQuantLinear(QuantLinear):
    """One checkpoint projection (o_proj, down_proj) divided along its input axis. Its scales,
    qzeros and g_idx are placed together once all three have arrived (see the module docstring)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, quant: QuantConfig, group: TPGroup):
        if len(out_sizes) != 1:
            raise ValueError(f"a row-parallel GPTQ linear is one projection, got output shards {out_sizes}")
        local = _share(in_features, group)
        super().__init__(local, out_sizes, bias, quant, groups=num_groups(local, quant.group_size))
        self.group, self.full_in_features, self.rows = group, in_features, group.part(in_features)
        self._pending: dict[str, torch.Tensor] = {}

    def missing_g_idx(self) -> torch.Tensor:
        return default_g_idx(self.full_in_features, self.group_size)

    def load(self, suffix: str, shard: int, value: torch.Tensor) -> None:
        if suffix == "qweight":
            per_word = 32 // self.bits
            words = slice(self.rows.start // per_word, self.rows.stop // per_word)
            super().load(suffix, shard, _take(value, 0, words, self.full_in_features // per_word))
        elif suffix == "bias":
            super().load(suffix, shard, value)
        else:
            self._pending[suffix] = value
            if len(self._pending) == 3:
                self._load_groups()

    def _load_groups(self) -> None:
        pending, self._pending = self._pending, {}
        g = _take(pending["g_idx"], 0, self.rows, self.full_in_features).to(torch.int64)
        lo, hi = int(g.min()), int(g.max()) + 1
        scales, qzeros = pending["scales"], pending["qzeros"]
        if lo < 0 or hi > scales.shape[0] or hi > qzeros.shape[0]:
            raise FlotillaError(f"g_idx names groups [{lo}, {hi}) but scales/qzeros hold "
                                f"{scales.shape[0]}/{qzeros.shape[0]} groups")
        if hi - lo != self.scales.shape[0]:  # act-order, or groups straddling ranks: keep what the rows use
            self.scales = torch.empty(hi - lo, self.scales.shape[1], dtype=self.scales.dtype, device=self.scales.device)
            self.qzeros = torch.empty(hi - lo, self.qzeros.shape[1], dtype=self.qzeros.dtype, device=self.qzeros.device)
        super().load("scales", 0, scales[lo:hi])
        super().load("qzeros", 0, qzeros[lo:hi])
        super().load("g_idx", 0, (g - lo).to(torch.int32))

    def fn(self):
        if self.kernel is None:
            raise RuntimeError("RowParallelQuantLinear.fn() before prepare(): its kernel is not chosen yet")
        kernel, bias, reduce = self.kernel, self.bias if self.group.is_first else None, self.group.all_reduce

        def row_parallel(x: torch.Tensor) -> torch.Tensor:
            return reduce(kernel(x, bias))  # [T, out]: the sum of every rank's share
        return row_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            self.prepare(x.dtype)
        return self.fn()(x)


_LINEARS = {("column", False): ColumnParallelLinear, ("row", False): RowParallelLinear,
            ("column", True): ColumnParallelQuantLinear, ("row", True): RowParallelQuantLinear}


def parallel_linear(in_features: int, out_sizes: list[int], bias: bool, quant: QuantConfig | GGUFQuant | None, split: str,
                    group: TPGroup) -> nn.Module:
    if split not in ("column", "row"):
        raise ValueError(f"split {split!r}: expected 'column', 'row' or None")
    if isinstance(quant, GGUFQuant):
        from .gguf_parallel import parallel_gguf_linear

        return parallel_gguf_linear(in_features, out_sizes, bias, split, group)
    cls = _LINEARS[(split, quant is not None)]
    return cls(in_features, out_sizes, bias, quant, group) if quant is not None else cls(in_features, out_sizes, bias, group)


# -------------------------------------------------------------------------------- vocabulary

class VocabParallel:
    """Holds rows [vocab_start, vocab_start + local) of a [vocab, hidden] weight."""

    group: TPGroup
    full_vocab: int
    weight: nn.Parameter

    def load(self, suffix: str, shard: int, value: torch.Tensor) -> None:
        part = self.group.part(self.full_vocab)
        value = _take(value, 0, part, self.full_vocab)
        if tuple(value.shape) != tuple(self.weight.shape):
            raise FlotillaError(f"shape {tuple(value.shape)} where {tuple(self.weight.shape)} was expected")
        self.weight.copy_(value.to(self.weight.dtype))


class VocabParallelEmbedding(VocabParallel, nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup):
        nn.Embedding.__init__(self, _share(vocab_size, group), hidden_size)
        self.group, self.full_vocab, self.vocab_start = group, vocab_size, group.part(vocab_size).start
        self.weight.requires_grad_(False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        local = token_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)  # [T]: ids another rank holds
        h = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        return self.group.all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallel, LMHead):
    def __init__(self, hidden_size: int, vocab_size: int, group: TPGroup):
        LMHead.__init__(self, hidden_size, _share(vocab_size, group))
        self.group, self.full_vocab = group, vocab_size
        self.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.gather_columns(F.linear(x, self.weight))

    def with_kernel(self, kernel: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        gather = self.group.gather_columns

        def parallel_logits(x: torch.Tensor) -> torch.Tensor:
            return gather(kernel(x))  # [N, vocab] on rank 0, [N, 0] elsewhere
        return parallel_logits
