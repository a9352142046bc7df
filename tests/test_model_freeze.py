"""CausalLM.freeze (the runtime's flat layer loop) computes exactly what the module path does,
and the module path still runs the linears' hooks (quantize's calibration relies on them)."""
from __future__ import annotations

import torch

from flotilla.models.attention import DenseCausalAttention
from flotilla.models.linear import Linear
from flotilla.models.sources import open_source
from flotilla.models.weights import load_stage

from conftest import make_hf_model, save_hf_model, tiny_config


def test_frozen_forward_is_bit_identical_and_hooks_run_unfrozen(tmp_path):
    path = save_hf_model(make_hf_model(tiny_config("qwen2", tie_word_embeddings=False), seed=3), tmp_path / "m")
    model = load_stage(open_source(path))
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(24).repeat(2)
    calls = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: calls.append(mod)) for m in model.modules()
             if isinstance(m, Linear)]
    with torch.no_grad():
        live = model(ids.flatten(), positions, DenseCausalAttention(2, 24))
        assert len(calls) == 4 * 3  # 4 linears x 3 layers
        model.freeze()
        frozen = model(ids.flatten(), positions, DenseCausalAttention(2, 24))
    assert len(calls) == 12  # the frozen loop calls kernels, not modules
    assert torch.equal(live, frozen)
    for h in hooks:
        h.remove()
