"""The Llama-family decoder: Llama 2/3/3.1, Mistral, Qwen2, Qwen3 (its q/k norms), Phi-3, SmolLM, and Gemma 2 / 3
(norms of 1 + weight, a norm after attention and after the MLP as well as before, gelu-tanh, the embedding scaled
by sqrt(hidden), sliding-window layers; Gemma 3's with their own rope base, Gemma 2's soft-capping).

Tokens are flattened: a batch of sequences is one [T] vector of token ids (or [T, hidden] of
hidden states for a later pipeline stage), with a [T] vector of positions. Attention goes through
an `AttentionBackend` that the caller supplies (a contiguous cache, a paged cache, or none), so
this file knows nothing of caches, devices or parallelism. Module names follow Hugging Face's,
so a checkpoint's tensor names are this model's state-dict keys.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.kernels.fused import add_rms_norm, embed_rms_norm, gelu_tanh_mul, rms_norm, silu_mul

from .config import ModelConfig
from .linear import QuantLinear, make_embedding, make_linear, make_lm_head
from .rope import RotaryEmbedding, for_layer, model_rope


@dataclass(frozen=True)
class Stage:
    """A half-open range of decoder layers [start, end) of a model with num_layers layers."""

    start: int
    end: int
    num_layers: int

    def __post_init__(self):
        if not 0 <= self.start < self.end <= self.num_layers:
            raise ValueError(f"bad stage [{self.start}, {self.end}) for a model of {self.num_layers} layers")

    @classmethod
    def whole(cls, num_layers: int) -> "Stage":
        return cls(0, num_layers, num_layers)

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.num_layers

    @property
    def layers(self) -> range:
        return range(self.start, self.end)


class AttentionBackend(Protocol):
    """A backend may also have `attend_qkv(layer, qkv, cos, sin, num_heads)`: the same from the unrotated
    projection qkv [T, (Hq + 2 Hkv) D] and the rope tables [T, 1, D], rotating itself (the runtime's
    paged backend rotates and stores in one kernel); attention_output uses it where present."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (already rotated) -> [T, Hq, D]. Stores k/v as it likes. A layer with a
        sliding window passes it (> 0): each query then sees only the last `window` keys up to its own; Gemma 2's
        layers pass `softcap` (> 0): each score s becomes softcap * tanh(s / softcap) before the softmax."""
        ...


class RMSNorm(nn.Module):
    """`offset` 1.0: Gemma's norm, x / rms(x) * (1 + weight), its checkpoints' weight kept as they store it."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if not offset else torch.zeros(dim), requires_grad=False)
        self.eps, self.offset = eps, offset

    def scale(self) -> torch.Tensor:
        """What x / rms(x) is multiplied by: the weight, or 1 + weight (in fp32, rounded to the weight's dtype)."""
        return self.weight if not self.offset else (self.weight.float() + self.offset).to(self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.scale(), self.eps)  # computed in fp32 for half inputs


class NormMatrix(nn.Module):
    """The final norm's weight as a [hidden, hidden] matrix M, applied to the normed states (the
    norm's own weight then ones): x -> x Mᵀ. `quantize --rotate-tied-head` writes M = Qᵀ diag(w) Q,
    so that a model rotated by Q keeps its lm_head tied to the rotated embedding (quantize/rotate.py);
    the config says so (ModelConfig.final_norm_matrix). Identity until loaded."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.eye(dim), requires_grad=False)  # CausalLM.final_matrix applies it


class Attention(nn.Module):
    # merged linear -> the checkpoint projections it is made of, in output order
    MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        qkv_bias = cfg.attention_bias or cfg.qkv_bias
        prefix = f"model.layers.{layer}.self_attn."  # the checkpoint's names, for per-module quantization
        self.qkv_proj = make_linear(cfg.hidden_size, [cfg.q_size, cfg.kv_size, cfg.kv_size], qkv_bias,
                                    cfg.linear_quant(prefix, self.MERGED["qkv_proj"]), split="column")
        self.o_proj = make_linear(cfg.q_size, [cfg.hidden_size], cfg.attention_bias, cfg.linear_quant(prefix, ("o_proj",)),
                                  split="row")
        # the heads this instance computes are those its qkv_proj produces (the factory may divide them)
        self.q_size, self.kv_size = self.qkv_proj.out_sizes[0], self.qkv_proj.out_sizes[1]
        self.head_dim = cfg.head_dim
        self.num_heads, self.num_kv_heads = self.q_size // cfg.head_dim, self.kv_size // cfg.head_dim
        self.window = cfg.layer_window(layer)  # a sliding window (0: the whole context)
        self.softcap = cfg.attn_softcap or 0.0  # Gemma 2's soft-capping of the scores
        self.rope_index = 1 if cfg.layer_rope_local(layer) else 0  # Gemma 3's sliding layers: the second rope
        # the attention's scale is the backends' head_dim ** -0.5; Gemma's query_pre_attn_scalar ** -0.5 is
        # had by scaling q (through its norm's weight, frozen into LayerOps)
        self.q_scale = (cfg.head_dim / cfg.query_pre_attn_scalar) ** 0.5 if cfg.query_pre_attn_scalar else 1.0
        if cfg.qk_norm:  # Qwen3, Gemma 3: each q and k head normed before rope (the same weight for every head)
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset)


class MLP(nn.Module):
    MERGED = {"gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        h, i, b, prefix = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, f"model.layers.{layer}.mlp."
        self.gate_up_proj = make_linear(h, [i, i], b, cfg.linear_quant(prefix, self.MERGED["gate_up_proj"]),
                                        split="column")
        self.down_proj = make_linear(i, [h], b, cfg.linear_quant(prefix, ("down_proj",)), split="row")
        self.intermediate_size = self.gate_up_proj.out_sizes[0]  # the units this instance computes
        self.act = cfg.hidden_act  # "silu" (silu(gate) * up) or Gemma's "gelu_pytorch_tanh"


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        off = cfg.norm_offset
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, off)
        self.self_attn = Attention(cfg, layer)
        # Llama's norm before the MLP; Gemma's norm of the attention's output (its pre_feedforward_layernorm is
        # the norm before the MLP, and post_feedforward_layernorm that of the MLP's output)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, off)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, off)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, off)
        self.mlp = MLP(cfg, layer)

    @property
    def mlp_norm(self) -> RMSNorm:
        """The norm whose output the MLP takes."""
        return getattr(self, "pre_feedforward_layernorm", self.post_attention_layernorm)

    def ops(self, frozen: bool = False) -> "LayerOps":
        """This layer's weights and linears. Live modules (their hooks run: quantize's calibration
        uses them) or, `frozen`, plain callables looked up once for the runtime's hot loop."""
        a, m = self.self_attn, self.mlp
        linear = (lambda mod: mod.fn()) if frozen else (lambda mod: mod)
        gate_up = linear(m.gate_up_proj)
        if m.act == "silu":
            fused = m.gate_up_proj.silu_mul_fn() if frozen and hasattr(m.gate_up_proj, "silu_mul_fn") else None
            act = fused or (lambda h: silu_mul(gate_up(h)))
        else:
            act = lambda h: gelu_tanh_mul(gate_up(h))  # noqa: E731
        qk_norm = None
        if hasattr(a, "q_norm"):
            q = a.q_norm.scale()
            qk_norm = (q if a.q_scale == 1.0 else (q.float() * a.q_scale).to(q.dtype), a.k_norm.scale())
        out_norms = None
        if hasattr(self, "post_feedforward_layernorm"):
            out_norms = (self.post_attention_layernorm.scale(), self.post_feedforward_layernorm.scale())
        return LayerOps(a.layer, self.input_layernorm.scale(), self.mlp_norm.scale(),
                        self.input_layernorm.eps, linear(a.qkv_proj), linear(a.o_proj), gate_up,
                        linear(m.down_proj), a.num_heads, a.num_kv_heads, a.head_dim, m.intermediate_size,
                        act, qk_norm, a.window, a.rope_index, out_norms, a.softcap,
                        a.q_scale if qk_norm is None else 1.0)  # (with q norms: folded into q's)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, attn: AttentionBackend,
                rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. `rope_tables` (cos, sin) for `positions`, when the caller
        has gathered them once for all layers."""
        cos, sin = rope_tables if rope_tables is not None else rope.tables(positions, x.dtype)
        return layer_step(self.ops(), x, cos, sin, attn)


@dataclass(frozen=True, slots=True)
class LayerOps:
    """What one decoder layer's step uses."""

    layer: int
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: Callable[[torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    # h -> silu(gate) * up of gate_up(h) [T, intermediate]: the linear's kernel's own where it has one
    # (frozen ops on the CUDA GEMV, or on the Triton tiles up to 16 rows: one launch), else kernels/fused.silu_mul
    # of the product
    gate_up_act: Callable[[torch.Tensor], torch.Tensor]
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None  # Qwen3: the q and k heads' RMSNorm weights [D]
    window: int = 0  # a sliding window this layer attends within (0: the whole context)
    rope_index: int = 0  # which of the model's rope tables this layer takes (rope.for_layer)
    # Gemma's norms of the attention's and the MLP's outputs (before each residual add), their scales [hidden]
    out_norms: tuple[torch.Tensor, torch.Tensor] | None = None
    softcap: float = 0.0  # Gemma 2: each attention score s -> softcap * tanh(s / softcap)
    q_scale: float = 1.0  # q times this before attention (Gemma 2's query_pre_attn_scalar, with no q norm to fold into)


def layer_step(ops: LayerOps, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               attn: AttentionBackend) -> torch.Tensor:
    """One decoder layer over flattened tokens x [T, hidden] (the only implementation of its math;
    quantize's calibration pass, flotilla.quantize.activations, runs the same steps in stages)."""
    x, delta = layer_residual(ops, x, None, cos, sin, attn)
    return x + delta


def layer_residual(ops: LayerOps, x: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor,
                   sin: torch.Tensor, attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
    """layer_step on the input x + delta (delta None: x), its output returned as (residual, delta)
    with the last residual add left to the caller: the next layer's input norm (or the final norm)
    adds it in its own kernel (add_rms_norm rounds the sum as torch's add: the same values)."""
    if delta is None:
        h = rms_norm(x, ops.input_norm, ops.eps)
    else:
        x, h = add_rms_norm(x, delta, ops.input_norm, ops.eps)
    return layer_normed(ops, x, h, cos, sin, attn)


def layer_normed(ops: LayerOps, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
    """layer_residual on the input x whose input norm h is computed already."""
    out = attend_normed(ops, h, cos, sin, attn)
    if ops.out_norms is None:
        x, h = add_rms_norm(x, ops.o(out), ops.post_norm, ops.eps)  # x + o(out), and its norm
        return x, ops.down(ops.gate_up_act(h))  # silu(gate) * up of gate_up(h) [T, 2 * intermediate]
    x, h = add_rms_norm(x, rms_norm(ops.o(out), ops.out_norms[0], ops.eps), ops.post_norm, ops.eps)
    return x, rms_norm(ops.down(ops.gate_up_act(h)), ops.out_norms[1], ops.eps)


def attention_output(ops: LayerOps, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     attn: AttentionBackend) -> torch.Tensor:
    """The first half of layer_step: x [T, hidden] -> the attention's output [T, Hq * D], o_proj's input."""
    return attend_normed(ops, rms_norm(x, ops.input_norm, ops.eps), cos, sin, attn)


def attend_normed(ops: LayerOps, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attn: AttentionBackend) -> torch.Tensor:
    """The attention of the normed input h [T, hidden] -> its output [T, Hq * D], o_proj's input."""
    return attend_projected(ops, ops.qkv(h), cos, sin, attn)


def attend_projected(ops: LayerOps, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     attn: AttentionBackend) -> torch.Tensor:
    """The attention of the projected q, k, v [T, (Hq + 2 Hkv) D] -> its output [T, Hq * D]."""
    T = qkv.shape[0]
    hq, hkv, d = ops.num_heads, ops.num_kv_heads, ops.head_dim
    qk_size = (hq + hkv) * d
    cos, sin = for_layer(cos, sin, ops.rope_index)
    if ops.qk_norm is not None:
        qkv = _qk_normed(qkv, ops.qk_norm, hq * d, qk_size, d, ops.eps)
    elif ops.q_scale != 1.0:  # (the projection's own output: scaled in place)
        qkv[:, :hq * d] *= ops.q_scale
    attend_qkv = getattr(attn, "attend_qkv", None)
    if attend_qkv is not None:  # rope inside the backend (AttentionBackend)
        return attend_qkv(ops.layer, qkv, cos, sin, hq, ops.window, ops.softcap).reshape(T, hq * d)
    qk = RotaryEmbedding.apply(qkv[:, :qk_size].view(T, hq + hkv, d), cos, sin)  # q and k are adjacent: rotate both
    out = attn.attend(ops.layer, qk[:, :hq], qk[:, hq:], qkv[:, qk_size:].view(T, hkv, d), ops.window,
                      ops.softcap)  # [T, Hq, D]
    return out.reshape(T, hq * d)


def _qk_normed(qkv: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor], q_size: int, qk_size: int, d: int,
               eps: float) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) D] (the projection's own output: written in place) with each q and k head
    RMS-normed by its weight [D] (Qwen3's q_norm, k_norm); v as it is."""
    T = qkv.shape[0]
    qkv[:, :q_size] = rms_norm(qkv[:, :q_size].reshape(-1, d), weights[0], eps).view(T, q_size)
    qkv[:, q_size:qk_size] = rms_norm(qkv[:, q_size:qk_size].reshape(-1, d), weights[1], eps).view(T, -1)
    return qkv


@dataclass(frozen=True, slots=True)
class NormFusion:
    """One layer's residual adds and RMSNorms folded into its GEMVs (kernels/cuda/gemv.py
    NormedResidual): o_proj adds the residual and hands on the post-attention norm, which gate_up
    applies; down_proj adds the residual and hands on the next layer's input norm, which that
    layer's qkv applies. No norm kernel runs between them. Built by CausalLM.freeze where the
    layer's four linears run on the Triton layout kernel (fp16), used at up to NORM_FUSION_ROWS
    rows where the CUDA GEMV's tensor-core plan serves all four (`serves`); FLOTILLA_NORM_FUSION=0
    / 1 turns it off / on (default: NORM_FUSION_DEFAULT)."""

    qkv: object  # the kernels (kernels/triton_linear.TritonLayoutKernel)
    o: object
    gate_up: object
    down: object
    qkv_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    post: object  # kernels/cuda/gemv.NormWeight of the post-attention norm
    next_input: object | None  # that of the next layer's input norm (None: the stage's last layer)

    def serves(self, m: int) -> bool:
        return m <= NORM_FUSION_ROWS and all(k.fuses_norm(m) for k in (self.qkv, self.o, self.gate_up, self.down))

    @staticmethod
    def build(layers: list["DecoderLayer"]) -> list["NormFusion"] | None:
        """The fusion of every layer of a stage, or None where any layer's linears or norms do not allow it."""
        if not norm_fusion_enabled() or not layers:
            return None
        mods = []
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            lin = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
            if any(type(x) is not QuantLinear or not hasattr(x.kernel, "fuses_norm") for x in lin) \
                    or m.gate_up_proj.bias is not None or any(x.kernel.dtype != torch.float16 for x in lin) \
                    or m.act != "silu" or layer.input_layernorm.offset or hasattr(layer, "pre_feedforward_layernorm"):
                return None  # (Gemma's layers: another activation, norms of 1 + weight and of the outputs)
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(w.dtype != torch.float16 or w.device.type != "cuda" for w in norms):
                return None
            mods.append(lin)
        from flotilla.kernels.cuda.gemv import NormWeight

        def weight(norm: "RMSNorm") -> object:
            return NormWeight.of(norm.weight, norm.eps)
        return [NormFusion(qkv.kernel, o.kernel, gu.kernel, down.kernel, qkv.bias, o.bias, down.bias,
                           weight(layer.post_attention_layernorm),
                           weight(layers[i + 1].input_layernorm) if i + 1 < len(layers) else None)
                for i, (layer, (qkv, o, gu, down)) in enumerate(zip(layers, mods))]


NORM_FUSION_ENV = "FLOTILLA_NORM_FUSION"
NORM_FUSION_DEFAULT = True
# the most rows it serves: faster at 1-2 rows, slower at 3-4 (an H100, llama-3-8b INT4: 423 / 843 / 1139 / 1514
# tok/s fused against 410 / 778 / 1165 / 1553 with norm kernels; bench/NOTES-kernels.md, round 6)
NORM_FUSION_ROWS = 2


def norm_fusion_enabled() -> bool:
    """Whether CausalLM.freeze builds the NormFusion: FLOTILLA_NORM_FUSION=0 off, any other value on
    (as FLOTILLA_PDL), unset or empty the default."""
    value = os.environ.get(NORM_FUSION_ENV, "").strip()
    return NORM_FUSION_DEFAULT if value == "" else value != "0"


class DecoderStack(nn.Module):
    """`model.*` of a Hugging Face checkpoint, restricted to one stage."""

    def __init__(self, cfg: ModelConfig, stage: Stage):
        super().__init__()
        self.embed_tokens = make_embedding(cfg.vocab_size, cfg.hidden_size, cfg.quant) if stage.is_first else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in stage.layers})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset) if stage.is_last else None
        self.norm_matrix = NormMatrix(cfg.hidden_size) if stage.is_last and cfg.final_norm_matrix else None


class CausalLM(nn.Module):
    """One pipeline stage of a Llama-family causal LM; the whole model is the one-stage case."""

    def __init__(self, cfg: ModelConfig, stage: Stage | None = None):
        super().__init__()
        self.config = cfg
        self.stage = stage or Stage.whole(cfg.num_hidden_layers)
        self.model = DecoderStack(cfg, self.stage)
        self.lm_head = make_lm_head(cfg.hidden_size, cfg.vocab_size, cfg.quant) if self.stage.is_last else None
        self.rope: RotaryEmbedding | None = None  # or rope.DualRotaryEmbedding (Gemma 3)
        self._frozen: list[LayerOps] | None = None
        self._final_scale: torch.Tensor | None = None  # with frozen ops: the final norm's scale, computed once
        self._fusion: list[NormFusion] | None = None  # with frozen ops: the residual and norm fusion
        self._fusion_rows: dict[int, bool] = {}  # rows -> whether every layer's fusion serves them
        self._logits: Callable[[torch.Tensor], torch.Tensor] | None = None

    def freeze(self, logits: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Look every layer's weights and kernels up once, so that forward runs a flat loop of
        tensor ops (no module calls, no attribute chains). Call once the weights and kernels are
        final (the runtime does, after loading); forward hooks on the linears no longer run.
        `logits`, if given, computes the logits in place of the lm_head module (a faster kernel
        for the same weights: the lm head's `logits_fn`)."""
        self._frozen = [layer.ops(frozen=True) for layer in self.model.layers.values()]
        self._final_scale = self.model.norm.scale() if self.model.norm is not None else None  # (Gemma's: 1 + w)
        self._logits = logits
        self._fusion = NormFusion.build(list(self.model.layers.values()))
        self._fusion_rows = {}

    @property
    def num_kv_heads(self) -> int:
        """KV heads each layer of this instance attends with and caches."""
        return next(iter(self.model.layers.values())).self_attn.num_kv_heads

    def tie_weights(self) -> None:
        if (self.config.tie_word_embeddings and self.stage.is_first and self.stage.is_last
                and not isinstance(self.lm_head, QuantLinear)):  # a GPTQ-quantized head is stored on its own
            self.lm_head.weight = self.model.embed_tokens.weight

    def build_rope(self, max_positions: int | None = None) -> None:
        """Create the cos/sin tables on the model's device (call after weights are placed)."""
        cfg = self.config
        device = next(self.parameters()).device
        n = max_positions or cfg.max_model_len
        with torch.device(device):
            self.rope = model_rope(cfg, n)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(token_ids)
        if self.config.embed_scale is not None:  # Gemma: times sqrt(hidden), rounded to the states' dtype first
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        return x

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                sampled: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x: token ids [T] on the first stage, else hidden states [T, hidden]. `sampled` = (ids,
        rows), first stage: row t's token is x[t] + ids[rows[t]] (ids a step before sampled, still
        on the device). Returns hidden states [T, hidden], final-normed on the last stage
        (final_matrix too)."""
        layers = self._frozen or [layer.ops() for layer in self.model.layers.values()]
        delta = None  # each layer's last residual add, done by the next norm's kernel
        h, normed = self._embed_normed(x, layers[0] if layers else None, sampled) if self.stage.is_first else (x, None)
        cos, sin = self.rope.tables(positions, h.dtype)  # once per step, shared by the layers
        if self._fusion is not None and layers and self._fused_rows(h.shape[0]):
            return self._forward_fused(layers, h, normed, cos, sin, attn)
        if normed is not None:  # the first layer's input norm came with the embedding
            h, delta = layer_normed(layers[0], h, normed, cos, sin, attn)
            layers = layers[1:]
        for ops in layers:
            h, delta = layer_residual(ops, h, delta, cos, sin, attn)
        if self.stage.is_last:
            norm = self.model.norm
            if delta is None:
                return self.final_matrix(norm(h))
            scale = norm.scale() if self._frozen is None else self._final_scale
            return self.final_matrix(add_rms_norm(h, delta, scale, norm.eps)[1])
        return h if delta is None else h + delta

    def _fused_rows(self, rows: int) -> bool:
        ok = self._fusion_rows.get(rows)
        if ok is None:
            ok = self._fusion_rows[rows] = all(f.serves(rows) for f in self._fusion)
        return ok

    def _forward_fused(self, layers: list[LayerOps], h: torch.Tensor, normed: torch.Tensor | None,
                       cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """forward's layers with their residual adds and norms in the GEMVs (NormFusion): the first
        layer's qkv takes its plain input norm, the last layer's down_proj hands back its delta."""
        if normed is None:
            normed = rms_norm(h, layers[0].input_norm, layers[0].eps)
        nr, delta = None, None
        for ops, f in zip(layers, self._fusion):
            qkv = ops.qkv(normed) if nr is None else f.qkv.normed(nr, f.qkv_bias)
            out = attend_projected(ops, qkv, cos, sin, attn)
            mid = f.o.add_norm(out, h, f.post, f.o_bias)  # h + o(out), and the post-attention norm
            act = f.gate_up.silu_mul_normed(mid)
            if f.next_input is None:
                h, delta = mid.resid, ops.down(act)
            else:
                nr = f.down.add_norm(act, mid.resid, f.next_input, f.down_bias)
                h = nr.resid
        if self.stage.is_last:
            norm = self.model.norm
            return self.final_matrix(add_rms_norm(h, delta, self._final_scale, norm.eps)[1])
        return h + delta

    def _embed_normed(self, token_ids: torch.Tensor, first: LayerOps | None,
                      sampled: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The embedded tokens [T, hidden] and their input norm for the `first` layer (None: a stage
        of no layers): one kernel for a plain embedding table (kernels/fused.embed_rms_norm), else
        the embedding module's own."""
        table = self.model.embed_tokens
        ids, rows = sampled if sampled is not None else (None, None)
        if type(table) is nn.Embedding and first is not None and self.config.embed_scale is None:
            return embed_rms_norm(table.weight, token_ids, first.input_norm, first.eps, ids, rows)
        x = self.embed(token_ids if rows is None else token_ids + ids.index_select(0, rows))
        return x, rms_norm(x, first.input_norm, first.eps) if first is not None else None

    def final_matrix(self, normed: torch.Tensor) -> torch.Tensor:
        """The final norm's output [T, hidden] times its matrix where the checkpoint has one
        (NormMatrix); applied here, in forward, so every path to the logits (eager, captured,
        pipeline's last stage, tensor-parallel, eval-ppl) sees it."""
        m = self.model.norm_matrix
        return normed if m is None else F.linear(normed, m.weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> fp32 logits [N, vocab] (Gemma 2's soft-capped: cap * tanh(logit / cap))."""
        logits = (self._logits or self.lm_head)(hidden).float()
        cap = self.config.final_softcap
        return logits if not cap else torch.tanh(logits / cap).mul_(cap)
