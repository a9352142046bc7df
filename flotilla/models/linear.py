"""The one factory that builds every linear of the decoder, plain or quantized.

Linears that share an input are merged (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`):
one matmul instead of three or two. Each merged linear knows its shards — the checkpoint
tensors it is made of (`q_proj`, `k_proj`, `v_proj`) — and loads each into its slice of the
output axis, so checkpoints keep Hugging Face's and GPTQ's per-projection names.

The model never sees packing: a `QuantLinear` owns the GPTQ tensors (qweight, qzeros, scales,
g_idx, bias) and asks the kernel registry for the fastest kernel for its device once its
weights are loaded; a kernel with its own form of the weight takes their place (`prepare`).

Nor does it see parallelism. It says which axis of a linear may be divided (`split="column"`:
the output axis, e.g. heads; `split="row"`: the input axis) and always passes whole sizes; while
a tensor-parallel group is current (flotilla.models.parallel_state), the factories build the
parallel layers of flotilla.models.parallel, which hold this rank's share, slice the checkpoint's
tensors at load and run the collectives. A linear's `out_sizes` are what this instance computes.
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.errors import FlotillaError
from flotilla.kernels import registry
from flotilla.kernels.gptq import GPTQWeight, default_g_idx, num_groups

from . import parallel_state
from .config import GGUFQuant, QuantConfig


class _Shards:
    """Output-axis slices of a (possibly merged) linear: shard i covers [offsets[i], offsets[i+1])."""

    def _init_shards(self, out_sizes: list[int]) -> None:
        self.out_sizes = list(out_sizes)
        self.offsets = [0]
        for n in out_sizes:
            self.offsets.append(self.offsets[-1] + n)

    def shard_slice(self, shard: int) -> slice:
        return slice(self.offsets[shard], self.offsets[shard + 1])


class Linear(nn.Linear, _Shards):
    """A plain (fp) linear, possibly merged from several checkpoint tensors."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool):
        nn.Linear.__init__(self, in_features, sum(out_sizes), bias=bias)
        self._init_shards(out_sizes)
        self.weight.requires_grad_(False)

    def tensor_suffixes(self) -> tuple[str, ...]:
        return ("weight", "bias") if self.bias is not None else ("weight",)

    def fn(self):
        """This linear as a plain callable x -> y (no module call); see CausalLM.freeze."""
        return functools.partial(F.linear, weight=self.weight, bias=self.bias)

    def load(self, suffix: str, shard: int, value: torch.Tensor) -> None:
        rows = self.shard_slice(shard)
        target = getattr(self, suffix)[rows]
        _check_shape(target, value)
        target.copy_(value.to(target.dtype))


class QuantLinear(nn.Module, _Shards):
    """A GPTQ-layout linear, possibly merged; see flotilla.kernels.gptq for the layout."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, quant: QuantConfig,
                 groups: int | None = None):
        """`groups`: rows of scales/zeros to hold, when not the whole input axis's (a row-parallel
        share of it). A group size that does not divide in_features leaves a partial last group."""
        super().__init__()
        self._init_shards(out_sizes)
        bits, gs = quant.bits, quant.group_size
        per_word = 32 // bits
        out_features = sum(out_sizes)
        if in_features % per_word or any(n % per_word for n in out_sizes):
            raise FlotillaError(f"a {bits}-bit linear needs in and out features divisible by {per_word}, "
                                f"got in={in_features}, out={out_sizes}")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, gs
        self.zero_offset = quant.zero_offset  # 1: zeros stored minus one (gptq), 0: as they are (gptq_v2)
        groups = num_groups(in_features, gs) if groups is None else groups
        self.register_buffer("qweight", torch.zeros(in_features // per_word, out_features, dtype=torch.int32))
        self.register_buffer("qzeros", torch.zeros(groups, out_features // per_word, dtype=torch.int32))
        self.register_buffer("scales", torch.zeros(groups, out_features, dtype=torch.float16))
        self.register_buffer("g_idx", torch.zeros(in_features, dtype=torch.int32))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.kernel = None
        self._kernel_dtype: torch.dtype | None = None
        self.released_bytes = 0  # the GPTQ tensors' bytes once the kernel's own form replaced them
        self._g_idx_loaded = False

    def tensor_suffixes(self) -> tuple[str, ...]:
        base = ("qweight", "qzeros", "scales", "g_idx")
        return base + ("bias",) if self.bias is not None else base

    def missing_g_idx(self) -> torch.Tensor:
        """The checkpoint's g_idx when the file has none (older GPTQ files without act-order)."""
        return default_g_idx(self.in_features, self.group_size)

    def load(self, suffix: str, shard: int, value: torch.Tensor) -> None:
        cols = self.shard_slice(shard)
        if suffix == "g_idx":
            if self._g_idx_loaded:
                if not torch.equal(self.g_idx, value.to(self.g_idx.device, torch.int32)):
                    raise FlotillaError("the merged projections (q/k/v, or gate/up) have different g_idx (act-order "
                                        "permutations), which one merged linear cannot hold, as vLLM's cannot: "
                                        "quantize them with one permutation (GPTQ's from their shared input, as "
                                        "AutoGPTQ and GPTQModel do)")
                return
            target = self.g_idx
            self._g_idx_loaded = True
        elif suffix == "bias":
            target = self.bias[cols]
        elif suffix == "qzeros":
            per_word = 32 // self.bits
            target = self.qzeros[:, cols.start // per_word:cols.stop // per_word]
        else:
            target = getattr(self, suffix)[:, cols]
        _check_shape(target, value)
        target.copy_(value.to(target.dtype))

    def gptq_weight(self) -> GPTQWeight:
        if self.released_bytes:
            raise RuntimeError("this linear's GPTQ tensors were released when its kernel was built "
                               "(load with keep_source=True to read them back)")
        return GPTQWeight(self.qweight, self.qzeros, self.scales, self.g_idx, self.bits, self.group_size,
                          self.zero_offset)

    def prepare(self, dtype: torch.dtype, keep_source: bool = False) -> None:
        """Pick and build the kernel for this device; call after the weights are loaded.

        A kernel that holds its own form of the weight (every one but the reference kernel: the
        Triton layout, the compiled CPU packing, a dequantized copy) makes the GPTQ tensors
        redundant, so they are released here unless `keep_source` (for code that reads them back),
        as GGUFLinear drops its parts: the weights are in memory once, not twice, and the load's
        peak is one linear above the model's size."""
        if self.kernel is not None and self.released_bytes:
            if dtype == self._kernel_dtype:
                return
            raise RuntimeError(f"this linear's GPTQ tensors were released when its kernel was built for "
                               f"{self._kernel_dtype}; it cannot be rebuilt for {dtype} (load the model again)")
        self.kernel = registry.select(self.gptq_weight(), self.qweight.device, dtype)
        self._kernel_dtype = dtype
        if not keep_source and not getattr(self.kernel, "keeps_source", False):
            self._release_source()

    def _release_source(self) -> None:
        names = ("qweight", "qzeros", "scales", "g_idx")
        self.released_bytes = sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in names)
        for n in names:
            setattr(self, n, getattr(self, n).new_empty(0))  # a registered buffer: replaced in place

    def weight_bytes(self) -> int:
        """The bytes of this linear's GPTQ tensors (and bias), also once they are released."""
        held = sum(t.numel() * t.element_size() for t in (self.qweight, self.qzeros, self.scales, self.g_idx))
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return (self.released_bytes or held) + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            self.prepare(x.dtype)
        return self.kernel(x, self.bias)

    def fn(self):
        """This linear as a plain callable x -> y (no module call); see CausalLM.freeze."""
        if self.kernel is None:
            raise RuntimeError("QuantLinear.fn() before prepare(): its kernel is not chosen yet")
        return functools.partial(self.kernel, bias=self.bias)

    def silu_mul_fn(self):
        """x -> silu(gate) * up of this [gate | up] linear as one callable where the kernel has its own
        (the Triton layout kernel: fused into the CUDA GEMV's epilogue at the batch sizes it serves);
        None: the caller applies kernels/fused.silu_mul to the product."""
        if self.kernel is None:
            raise RuntimeError("QuantLinear.silu_mul_fn() before prepare(): its kernel is not chosen yet")
        fn = getattr(self.kernel, "silu_mul", None)
        return None if fn is None else functools.partial(fn, bias=self.bias)

    def extra_repr(self) -> str:
        name = getattr(self.kernel, "name", None)
        return (f"in={self.in_features}, out={self.out_sizes}, bits={self.bits}, "
                f"group_size={self.group_size}, kernel={name}")


class LMHead(nn.Linear):
    """The output projection hidden -> vocabulary logits, unquantized (QuantLMHead: stored quantized)."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(hidden_size, vocab_size, bias=False)

    def with_kernel(self, kernel: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        """The logits function when `kernel` computes x @ weight.T in place of this module."""
        return kernel

    def logits_fn(self, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What a step computes the logits with in place of this module (every lm head has one):
        on the CPU, the compiled kernels (`plain_linear`): the weight's smallest exact form (int8 x
        block scale, e.g. a GGUF Q8_0 embedding tied to the head, or fp16), else fp32 in the
        kernels' layout; fewer bytes a step, and batch-invariant, unlike MKL. On a GPU, a half
        weight's product written as fp32 by the GEMM itself (`mm_fp32_out`: no conversion
        launch after it; the logits keep their fp32 accumulation). None (this module) for an fp32
        weight off the CPU, where the kernels are unavailable, or when FLOTILLA_KERNEL forces the
        dense or reference kernel (debugging: torch all the way)."""
        if os.environ.get(registry.ENV_KERNEL, "").strip() in ("dense", "reference"):
            return None
        if device.type == "cuda" and self.weight.dtype in (torch.float16, torch.bfloat16):
            kernel = mm_fp32_out(self.weight)  # through with_kernel: a vocab-parallel head gathers its columns
            return self.with_kernel(kernel) if kernel is not None else None
        if device.type != "cpu" or self.weight.dtype != torch.float32:
            return None
        try:
            from flotilla.kernels.cpu import available, plain_linear
        except ImportError:
            return None
        kernel = plain_linear(self.weight) if available() else None
        return self.with_kernel(kernel) if kernel is not None else None


def mm_fp32_out(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """x [N, in] -> x @ weight.T in fp32, the GEMM writing fp32 (torch.mm's out_dtype), or None
    where this torch cannot (then the module's half product is converted)."""
    w = weight.t()  # [in, out]: a view
    try:
        torch.mm(weight[:1], w[:, :1], out_dtype=torch.float32)  # [1, 1]: is the overload there
    except (RuntimeError, TypeError):  # NotImplementedError (no kernel for the device) is a RuntimeError
        return None
    return lambda x: torch.mm(x, w, out_dtype=torch.float32)


def make_linear(in_features: int, out_sizes: list[int], bias: bool, quant: QuantConfig | GGUFQuant | None,
                split: str | None = None) -> nn.Module:
    """A linear in_features -> sum(out_sizes) made of `len(out_sizes)` checkpoint projections.
    `split`: "column" (the output axis may be divided), "row" (the input axis), or None."""
    group = parallel_state.current()
    if group is not None and split is not None:
        from .parallel import parallel_linear

        return parallel_linear(in_features, out_sizes, bias, quant, split, group)
    if quant is None:
        return Linear(in_features, out_sizes, bias)
    if isinstance(quant, GGUFQuant):
        from .gguf_linear import GGUFLinear

        return GGUFLinear(in_features, out_sizes, bias)
    return QuantLinear(in_features, out_sizes, bias, quant)


def make_embedding(vocab_size: int, hidden_size: int, quant: QuantConfig | GGUFQuant | None = None) -> nn.Module:
    """The token embedding (GPTQ checkpoints keep it unquantized; a GGUF one stays in its blocks)."""
    group = parallel_state.current()
    if group is not None and isinstance(quant, GGUFQuant):
        from .gguf_parallel import VocabParallelGGUFEmbedding

        return VocabParallelGGUFEmbedding(vocab_size, hidden_size, group)
    if group is not None:
        from .parallel import VocabParallelEmbedding

        return VocabParallelEmbedding(vocab_size, hidden_size, group)
    if isinstance(quant, GGUFQuant):
        from .gguf_linear import GGUFEmbedding

        return GGUFEmbedding(vocab_size, hidden_size)
    return nn.Embedding(vocab_size, hidden_size)


class QuantLMHead(QuantLinear):
    """The output projection stored in the GPTQ layout: a checkpoint whose quantization_config says
    `lm_head: true` (GPTQModel writes it; vLLM reads it), e.g. `quantize --lm-head-bits 8`. It runs
    through the registry's kernel like any other linear, so a step reads its bytes once."""

    def __init__(self, hidden_size: int, vocab_size: int, quant: QuantConfig):
        super().__init__(hidden_size, [vocab_size], False, quant)

    def logits_fn(self, device: torch.device) -> None:
        """The module itself computes the logits (its kernel is already the registry's)."""
        return None


def make_lm_head(hidden_size: int, vocab_size: int, quant: QuantConfig | GGUFQuant | None = None) -> nn.Module:
    group = parallel_state.current()
    head_quant = quant.head_quant() if isinstance(quant, QuantConfig) else None
    if head_quant is not None:
        if group is not None:
            raise FlotillaError("this checkpoint's lm_head is quantized (quantization_config.lm_head), which "
                                "tensor parallelism (--tp) does not split yet; run it with --pp, or re-quantize "
                                "without --lm-head-bits")
        return QuantLMHead(hidden_size, vocab_size, head_quant)
    if group is not None and isinstance(quant, GGUFQuant):
        from .gguf_parallel import ParallelGGUFLMHead

        return ParallelGGUFLMHead(hidden_size, vocab_size, group)
    if group is not None:
        from .parallel import ParallelLMHead

        return ParallelLMHead(hidden_size, vocab_size, group)
    if isinstance(quant, GGUFQuant):
        from .gguf_linear import GGUFLMHead

        return GGUFLMHead(hidden_size, vocab_size)
    return LMHead(hidden_size, vocab_size)


def _check_shape(target: torch.Tensor, value: torch.Tensor) -> None:
    if tuple(target.shape) != tuple(value.shape):
        raise FlotillaError(f"shape {tuple(value.shape)} where {tuple(target.shape)} was expected")
