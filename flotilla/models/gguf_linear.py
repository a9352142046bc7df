"""Linears, embedding and lm_head whose weights stay in a GGUF file's blocks.

Built by the factories of flotilla.models.linear when the config's quant is GGUFQuant (a GGUF
source opened natively). The types of a file are only known tensor by tensor (a Q4_K_M file
mixes Q4_K, Q6_K, Q5_0 and Q8_0, even inside one merged q/k/v), so these layers take whatever
each projection brings — a flotilla.kernels.ggml.GGMLWeight, or fp32 for unquantized tensors and
types without a kernel — and only pick their kernel once loaded (`prepare`), through
flotilla.kernels.ggml_kernels.

The embedding and the lm_head share one `GGUFTable` (`weight`) when the embeddings are tied: the
lm_head's kernel is the largest matmul of a small model, and the embedding looks up only the
rows a step needs from the same form.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from flotilla.errors import FlotillaError
from flotilla.kernels.ggml import GGMLWeight
from flotilla.kernels.ggml_kernels import Part, ggml_linear, part_rows

from .linear import _Shards


def check_part(value: Part, rows: int, cols: int) -> Part:
    shape = tuple(value.shape)
    if shape != (rows, cols):
        raise FlotillaError(f"shape {shape} where {(rows, cols)} was expected")
    if not isinstance(value, GGMLWeight):
        value = value.to(torch.float32)
    return value


class GGUFLinear(nn.Module, _Shards):
    """A (possibly merged) linear over GGUF parts: shard i is one checkpoint projection."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool):
        super().__init__()
        self._init_shards(out_sizes)
        self.in_features, self.out_features = in_features, sum(out_sizes)
        self.parts: list[Part | None] = [None] * len(out_sizes)
        self.bias = nn.Parameter(torch.zeros(self.out_features), requires_grad=False) if bias else None
        self.kernel = None

    def tensor_suffixes(self) -> tuple[str, ...]:
        return ("weight", "bias") if self.bias is not None else ("weight",)

    def load(self, suffix: str, shard: int, value: Part) -> None:
        if suffix == "bias":
            target = self.bias[self.shard_slice(shard)]
            if tuple(target.shape) != tuple(value.shape):
                raise FlotillaError(f"shape {tuple(value.shape)} where {tuple(target.shape)} was expected")
            target.copy_(value)
            return
        self.parts[shard] = check_part(value, self.out_sizes[shard], self.in_features)

    @property
    def prepared(self) -> bool:
        return self.kernel is not None

    def prepare(self, dtype: torch.dtype, device: torch.device | str) -> None:
        """Build the kernel for `device` (call once the parts are loaded); the parts are dropped."""
        if any(p is None for p in self.parts):
            raise RuntimeError("GGUFLinear.prepare() before every projection was loaded")
        self.kernel = ggml_linear(self.parts, device, dtype)
        self.parts = [None] * len(self.parts)

    def part_form(self, shard: int) -> str:
        """The form projection `shard` runs in (after prepare)."""
        return self.kernel.part_forms[shard]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.bias)

    def fn(self):
        """This linear as a plain callable x -> y (no module call); see CausalLM.freeze."""
        if self.kernel is None:
            raise RuntimeError("GGUFLinear.fn() before prepare(): its kernel is not built yet")
        return functools.partial(self.kernel, bias=self.bias)

    def silu_mul_fn(self):
        """x -> silu(gate) * up of this [gate | up] linear as one callable where the kernel has its own (the
        Triton forms: one launch where gate and up are one GGUF form); None: the caller applies
        kernels/fused.silu_mul to the product."""
        if self.kernel is None:
            raise RuntimeError("GGUFLinear.silu_mul_fn() before prepare(): its kernel is not built yet")
        fn = getattr(self.kernel, "silu_mul", None)
        return None if fn is None else functools.partial(fn, bias=self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_sizes}, kernel={getattr(self.kernel, 'name', None)}"


class GGUFTable:
    """A [vocab, hidden] GGUF weight: the embedding's rows and, tied, the lm_head's kernel.

    A plain object, not a tensor, so that CausalLM.tie_weights' `lm_head.weight = embed.weight`
    shares it between the two modules."""

    def __init__(self, rows: int, cols: int):
        self.shape = (rows, cols)
        self.value: Part | None = None
        self.kernel = None
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None

    def load(self, value: Part) -> None:
        self.value = check_part(value, *self.shape)

    def prepare(self, dtype: torch.dtype, device: torch.device | str) -> None:
        if self.kernel is not None:
            return  # tied: the other module prepared it
        if self.value is None:
            raise RuntimeError("a GGUF embedding or lm_head was prepared before its weight was loaded")
        self.kernel = ggml_linear([self.value], device, dtype)
        self.dtype, self.device = dtype, torch.device(device)
        if hasattr(self.kernel, "rows"):
            self.value = None  # the kernel's own form serves the lookups too

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] dequantized: [T, hidden] in the activation dtype."""
        if self.value is None:
            return self.kernel.rows(ids)
        return part_rows(self.value, ids, self.dtype).to(self.device)

    @property
    def nbytes(self) -> int:
        return getattr(self.kernel, "nbytes", 0)


class _TableModule(nn.Module):
    """A module over one GGUFTable `weight` (shared between the two when tied)."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = GGUFTable(vocab_size, hidden_size)

    def load(self, suffix: str, shard: int, value: Part) -> None:
        self.weight.load(value)

    @property
    def prepared(self) -> bool:
        return self.weight.kernel is not None

    def prepare(self, dtype: torch.dtype, device: torch.device | str) -> None:
        self.weight.prepare(dtype, device)

    def part_form(self, shard: int) -> str:
        return self.weight.kernel.part_forms[0]


class GGUFEmbedding(_TableModule):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__(vocab_size, hidden_size)
        self.num_embeddings, self.embedding_dim = vocab_size, hidden_size

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(token_ids)


class GGUFLMHead(_TableModule):
    """hidden -> vocabulary logits through the GGUF weight's kernel."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(vocab_size, hidden_size)
        self.in_features, self.out_features = hidden_size, vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.kernel(x)

    def fn(self):
        return self.weight.kernel

    def logits_fn(self, device: torch.device):
        """What a step computes the logits with (see LMHead.logits_fn): the blocks' own kernel, on
        any device."""
        return self.fn()
