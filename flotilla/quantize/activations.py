"""The calibration hidden states entering the current decoder layer, and running a layer on them.

Holds [samples, seq_len, hidden] fp32 on the quantization device and runs a layer over them in
chunks of samples (about CHUNK_TOKENS tokens each), so a layer's intermediate activations never
exist for all samples at once.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from flotilla.models.attention import DenseCausalAttention
from flotilla.models.config import ModelConfig
from flotilla.models.rope import RotaryEmbedding

CHUNK_TOKENS = 4096


class _Stop(Exception):
    """Raised from a forward pre-hook once the input of interest has been seen."""


class CalibrationActivations:
    def __init__(self, hidden: torch.Tensor, config: ModelConfig):
        self.hidden = hidden  # [N, L, hidden] fp32
        N, L, _ = hidden.shape
        self.chunk = max(1, CHUNK_TOKENS // L)
        with torch.device(hidden.device):
            self.rope = RotaryEmbedding(config.head_dim, L, config.rope_theta, config.rope_scaling)
        self.positions = torch.arange(L, device=hidden.device)

    @property
    def num_tokens(self) -> int:
        return self.hidden.shape[0] * self.hidden.shape[1]

    def _chunks(self):
        N, L, H = self.hidden.shape
        for s in range(0, N, self.chunk):
            x = self.hidden[s:s + self.chunk]
            B = x.shape[0]
            yield s, x.reshape(B * L, H), self.positions.repeat(B), DenseCausalAttention(B, L)

    def call_order(self, layer: nn.Module, modules: list[nn.Module]) -> list[nn.Module]:
        """The order in which `layer`'s forward first calls each of `modules` (one sample)."""
        seen: list[nn.Module] = []
        hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append(mod) if mod not in seen else None)
                 for m in modules]
        try:
            L, H = self.hidden.shape[1:]
            with torch.no_grad():
                layer(self.hidden[:1].reshape(L, H), self.positions, self.rope, DenseCausalAttention(1, L))
        finally:
            for h in hooks:
                h.remove()
        return seen

    def feed(self, layer: nn.Module, target: nn.Module, on_input: Callable[[torch.Tensor], None]) -> None:
        """Run every sample through `layer` up to `target`, handing `target`'s inputs to on_input."""
        def hook(mod, args):
            on_input(args[0])
            raise _Stop

        handle = target.register_forward_pre_hook(hook)
        try:
            with torch.no_grad():
                for _, x, positions, attn in self._chunks():
                    try:
                        layer(x, positions, self.rope, attn)
                    except _Stop:
                        pass
        finally:
            handle.remove()

    def advance(self, layer: nn.Module) -> None:
        """Replace the hidden states by `layer`'s outputs (the next layer's inputs)."""
        N, L, H = self.hidden.shape
        with torch.no_grad():
            for s, x, positions, attn in self._chunks():
                self.hidden[s:s + self.chunk] = layer(x, positions, self.rope, attn).view(-1, L, H)
