"""The calibration hidden states entering the current decoder layer, and running a layer on them.

Holds [samples, seq_len, hidden] fp32 on the quantization device. `linear_inputs(layer)` runs the
layer over all of them stage by stage, the steps of models.llama.layer_step taken apart:

    qkv_proj      <- rms_norm(x)
    o_proj        <- attention(x)                           (kept: [T, q_size])
    gate_up_proj  <- h = norm(x + o_proj(attention))        (kept: h, and x + o_proj(...) in place of x)
    down_proj     <- a = silu(gate) * up of gate_up_proj(h)  (kept: a)
    next layer    <- x + o_proj(...) + down_proj(a)          (replaces the hidden states)

(Gemma 3: o_proj's and down_proj's outputs are normed before each add, and a = gelu(gate) * up.)

and hands out each linear with its inputs. The caller may change a linear (quantize it) before
asking for the next one: every later stage computes through it as changed, which is GPTQ's
true-sequential order, yet each linear and the attention run once per token (not once per later
linear, as re-running the layer up to each linear would). The kept results cost T x (q_size +
hidden) floats at most until gate_up_proj, then T x (hidden + intermediate).

Every stage works in chunks of samples (about CHUNK_TOKENS tokens each), the same chunks for all,
so a result is what layer_step computes on that chunk, bit for bit.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from flotilla.kernels.fused import add_rms_norm, rms_norm
from flotilla.models.attention import DenseCausalAttention
from flotilla.models.config import ModelConfig
from flotilla.models.llama import DecoderLayer, attention_output
from flotilla.models.rope import model_rope

CHUNK_TOKENS = 4096


class CalibrationActivations:
    def __init__(self, hidden: torch.Tensor, config: ModelConfig):
        self.hidden = hidden  # [N, L, hidden] fp32
        N, L, _ = hidden.shape
        self.chunk = max(1, CHUNK_TOKENS // L)
        with torch.device(hidden.device):
            self.rope = model_rope(config, L)
        self.positions = torch.arange(L, device=hidden.device)

    @property
    def num_tokens(self) -> int:
        return self.hidden.shape[0] * self.hidden.shape[1]

    def _chunks(self):
        """(token rows a:b of the flattened states, cos, sin, attention) per chunk of samples."""
        N, L, _ = self.hidden.shape
        for s in range(0, N, self.chunk):
            B = min(self.chunk, N - s)
            cos, sin = self.rope.tables(self.positions.repeat(B))
            yield slice(s * L, (s + B) * L), cos, sin, DenseCausalAttention(B, L)

    def linear_inputs(self, layer: DecoderLayer, advance: bool = True) -> Iterator[tuple[nn.Module, Iterator[torch.Tensor]]]:
        """(linear, its input chunks [t, in]) for qkv_proj, o_proj, gate_up_proj, down_proj in turn
        (module docstring). A stage's inputs not read by the caller are computed anyway when it asks
        for the next linear. With `advance`, the hidden states become the layer's outputs once the
        iteration ends; without, they are left as they were."""
        a, m = layer.self_attn, layer.mlp
        ops = layer.ops()
        x = self.hidden.view(-1, self.hidden.shape[-1])  # [T, hidden], a view: the stages write into it
        T = x.shape[0]
        with torch.no_grad():
            yield from _drained(a.qkv_proj, (rms_norm(x[r], ops.input_norm, ops.eps) for r, *_ in self._chunks()))

            attn_out = torch.empty(T, a.o_proj.in_features, device=x.device)

            def attention():
                for r, cos, sin, attn in self._chunks():
                    attn_out[r] = attention_output(ops, x[r], cos, sin, attn)
                    yield attn_out[r]
            yield from _drained(a.o_proj, attention())

            normed = torch.empty_like(x)

            def post_attention():
                for r, *_ in self._chunks():
                    o = ops.o(attn_out[r])
                    if ops.out_norms is not None:
                        o = rms_norm(o, ops.out_norms[0], ops.eps)
                    total, normed[r] = add_rms_norm(x[r], o, ops.post_norm, ops.eps)
                    if advance:
                        x[r] = total
                    yield normed[r]
            yield from _drained(m.gate_up_proj, post_attention())
            del attn_out

            act = torch.empty(T, m.down_proj.in_features, device=x.device) if advance else None

            def mlp():
                for r, *_ in self._chunks():
                    a_r = ops.gate_up_act(normed[r])  # silu(gate) * up (Gemma: gelu)
                    if act is not None:
                        act[r] = a_r
                    yield a_r
            yield from _drained(m.down_proj, mlp())
            del normed

            if advance:
                for r, *_ in self._chunks():
                    d = ops.down(act[r])
                    x[r] = x[r] + (d if ops.out_norms is None else rms_norm(d, ops.out_norms[1], ops.eps))


def _drained(linear: nn.Module, inputs: Iterator[torch.Tensor]) -> Iterator[tuple[nn.Module, Iterator[torch.Tensor]]]:
    """Hand out (linear, inputs), then compute whatever of `inputs` the caller left unread."""
    yield linear, inputs
    for _ in inputs:
        pass
