"""The staged calibration pass: each linear's inputs and the layer's outputs are those of the layer's
own forward, bit for bit, and a linear changed between stages is seen changed by every later stage."""
from __future__ import annotations

import torch

from flotilla.models.attention import DenseCausalAttention
from flotilla.models.linear import Linear
from flotilla.models.sources import open_source
from flotilla.models.weights import load_layer
from flotilla.quantize.activations import CHUNK_TOKENS, CalibrationActivations

from quantize_helpers import tiny_model_dir

N, L = 5, 16


def forward_inputs(layer, hidden, acts):
    """Each linear's inputs (hooked) and the outputs of the layer's forward, chunk by chunk as the
    staged pass takes them."""
    seen = {m: [] for m in layer.modules() if isinstance(m, Linear)}
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen[mod].append(args[0].clone())) for m in seen]
    outs = []
    with torch.no_grad():
        for s in range(0, N, acts.chunk):
            x = hidden[s:s + acts.chunk]
            B = x.shape[0]
            outs.append(layer(x.reshape(B * L, -1), acts.positions.repeat(B), acts.rope, DenseCausalAttention(B, L)))
    for h in hooks:
        h.remove()
    return {m: torch.cat(v) for m, v in seen.items()}, torch.cat(outs).view(N, L, -1)


def test_staged_pass_is_the_layers_forward(tmp_path, monkeypatch):
    monkeypatch.setattr("flotilla.quantize.activations.CHUNK_TOKENS", 2 * L)  # chunks of 2, 2 and 1 samples
    source = open_source(tiny_model_dir(tmp_path / "m", seed=3, tokenizer=False))
    layer = load_layer(source, 0)
    hidden = torch.randn(N, L, source.config.hidden_size, generator=torch.Generator().manual_seed(0))
    acts = CalibrationActivations(hidden.clone(), source.config)
    assert acts.chunk == 2 and CHUNK_TOKENS != acts.chunk * L

    # no change between stages, states left alone: the inputs of one forward
    want, _ = forward_inputs(layer, hidden, acts)
    order = []
    for mod, inputs in acts.linear_inputs(layer, advance=False):
        order.append(mod)
        assert torch.equal(torch.cat(list(inputs)), want[mod])
    a, m = layer.self_attn, layer.mlp
    assert order == [a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj]
    assert torch.equal(acts.hidden, hidden)

    # each linear changed before the next stage (as GPTQ does): later inputs and the outputs follow it
    gen = torch.Generator().manual_seed(1)
    for mod, inputs in acts.linear_inputs(layer):
        got = torch.cat(list(inputs)) if mod is not a.o_proj else None  # o_proj's inputs left unread
        if got is not None:
            assert torch.equal(got, forward_inputs(layer, hidden, acts)[0][mod])
        with torch.no_grad():
            mod.weight.add_(torch.randn(mod.weight.shape, generator=gen) * 0.01)
    _, out = forward_inputs(layer, hidden, acts)
    assert torch.equal(acts.hidden, out)
