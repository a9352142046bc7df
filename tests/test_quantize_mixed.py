"""Mixed precision: --keep and --sensitive choose per-linear bits, written as GPTQModel's `dynamic`
overrides, read back by the runtime per linear."""
from __future__ import annotations

import json
import re

import pytest
import torch

from flotilla.errors import FlotillaError
from flotilla.kernels.reference import dequantize
from flotilla.models.config import ModelConfig, QuantConfig
from flotilla.models.linear import Linear, QuantLinear
from flotilla.models.sources import open_source
from flotilla.models.weights import load_stage
from flotilla.quantize import QuantizeOptions, quantize_model
from flotilla.quantize.mixed import dynamic_entries, keep_choice, units

from quantize_helpers import tiny_model_dir

CALIB = dict(calib_samples=4, calib_seq_len=32)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("src") / "tiny", seed=6)


def test_dynamic_is_resolved_like_gptqmodel_and_vllm():
    """First matching pattern wins, with re.match; "-:" leaves the module unquantized."""
    q = QuantConfig.from_hf({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {
        "-:.*lm_head": {},
        r"+:model\.layers\.1\..*": {"bits": 8, "group_size": 32},
        r"model\.layers\.1\.mlp\..*": {"bits": 4},  # never reached for layer 1: the entry above wins
        r"-:model\.layers\.2\.mlp\.down_proj": {},
    }})
    assert q.to_hf()["dynamic"][r"+:model\.layers\.1\..*"] == {"bits": 8, "group_size": 32}
    one = q.for_module(["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"])
    assert (one.bits, one.group_size, one.dynamic) == (8, 32, ())
    assert q.for_module(["model.layers.2.mlp.down_proj"]) is None
    assert q.for_module(["model.layers.0.mlp.down_proj"]).bits == 4
    with pytest.raises(FlotillaError, match="merges these projections"):
        QuantConfig(4, 128, dynamic=((r"+:.*q_proj", (("bits", 8),)),)).for_module(
            ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"])
    with pytest.raises(FlotillaError, match="overrides adapter"):
        QuantConfig.from_hf({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {".*": {"adapter": 1}}})


def test_unit_patterns_match_checkpoint_and_merged_names():
    cfg = ModelConfig.from_hf_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=320, hidden_size=128,
                                        intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2))
    qkv = next(u for u in units(cfg) if u.layer == 1 and u.merged == "qkv_proj")
    for name in ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj",
                 "model.layers.1.self_attn.qkv_proj"):  # GPTQModel's names, and vLLM's merged one
        assert re.match(qkv.pattern(), name)
    assert not re.match(qkv.pattern(), "model.layers.11.self_attn.q_proj")
    assert not re.match(qkv.pattern(), "model.layers.1.self_attn.o_proj")
    with pytest.raises(FlotillaError, match="matches q_proj but not k_proj, v_proj of layer 0"):
        keep_choice(cfg, ((8, r".*\.q_proj"),))
    with pytest.raises(FlotillaError, match="matches no linear"):
        keep_choice(cfg, ((8, r".*\.q_projection"),))
    chosen = keep_choice(cfg, ((16, r"model\.layers\.0\.mlp\.down"), (8, r".*down_proj")))
    assert sorted((u.label, b) for u, b in chosen.items()) == [("0.down_proj", 16), ("1.down_proj", 8)]
    assert [p[:2] for p, _ in dynamic_entries(chosen)] == ["-:", "+:"]


def test_mixed_checkpoint_round_trips_and_loads_per_linear(src, tmp_path):
    out = tmp_path / "q"
    memory = {}

    def on_layer(index, layer, result):
        for name, mod in layer.named_modules():
            if isinstance(mod, Linear):
                memory[f"{index}.{name}"] = (result.weights[mod].dequantize() if mod in result.weights
                                             else mod.weight.half().float())

    options = QuantizeOptions(method="rtn", keep=((8, r".*\.mlp\.down_proj"), (16, r"model\.layers\.0\.self_attn\.o")),
                              sensitive=1, **CALIB)
    report = quantize_model(src, out, options, progress=False, on_layer=on_layer)
    assert len(report.kept) == 4 and "0.o_proj:16" in report.kept
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert len(config["dynamic"]) == 4
    model = load_stage(open_source(out), keep_source=True)
    bits, stored, weights = {}, 0, 0
    for name, mod in model.named_modules():
        if isinstance(mod, (Linear, QuantLinear)):
            key = name.removeprefix("model.layers.")
            bits[key] = mod.bits if isinstance(mod, QuantLinear) else 16
            w = dequantize(mod.gptq_weight()).t() if isinstance(mod, QuantLinear) else mod.weight
            assert torch.equal(w, memory[key]), key
            n_in, n_out, parts = w.shape[1], w.shape[0], len(mod.out_sizes)
            weights += n_in * n_out
            if isinstance(mod, QuantLinear):  # codes, then per group an fp16 scale and a zero; g_idx per projection
                stored += mod.bits * n_in * n_out + (16 + mod.bits) * mod.scales.shape[0] * n_out + 32 * n_in * parts
            else:
                stored += 16 * n_in * n_out
    assert bits["0.self_attn.o_proj"] == 16 and bits["0.mlp.down_proj"] == bits["1.mlp.down_proj"] == 8
    assert sorted(bits.values()).count(8) == 3  # the two down_proj and the one --sensitive chose
    assert report.bits_per_weight == pytest.approx(stored / weights, rel=1e-9)


def test_sensitive_picks_the_linear_of_largest_error(src, tmp_path, monkeypatch):
    from flotilla.quantize import pipeline

    seen = {}
    real = pipeline.measure_errors

    def spy(*args, **kwargs):
        seen.update(real(*args, **kwargs))
        return seen
    monkeypatch.setattr(pipeline, "measure_errors", spy)
    report = quantize_model(src, tmp_path / "q", QuantizeOptions(method="rtn", sensitive=2, **CALIB), progress=False)
    worst = sorted(seen, key=seen.get, reverse=True)[:2]
    assert len(seen) == 8 and all(e > 0 for e in seen.values())
    assert sorted(report.kept) == sorted(f"{u.label}:8" for u in worst)


@pytest.mark.parametrize("index", [0, 1])
def test_sensitivity_of_down_proj_is_what_its_rounding_adds_to_the_residual_stream(src, index):
    """down_proj's measure is exact: the energy its rounding adds to the layer's output over that
    output's energy, checked by running the layer with only down_proj rounded (the last layer too)."""
    from flotilla.models.attention import DenseCausalAttention
    from flotilla.models.weights import load_layer
    from flotilla.quantize.activations import CalibrationActivations
    from flotilla.quantize.grid import GridSpec, rtn_quantize
    from flotilla.quantize.mixed import measure_errors

    source = open_source(src)
    cfg = source.config
    x = torch.randn(3, 16, cfg.hidden_size, generator=torch.Generator().manual_seed(2)) * 2
    options = QuantizeOptions(method="rtn", group_size=64)
    acts = CalibrationActivations(x.clone(), cfg)
    errors = measure_errors(source, cfg, acts, options, progress=False)
    unit = next(u for u in units(cfg) if u.layer == index and u.merged == "down_proj")

    h = x.view(48, -1)
    for i in range(index + 1):
        layer = load_layer(source, i)
        run = lambda: layer(h, acts.positions.repeat(3), acts.rope, DenseCausalAttention(3, 16))  # noqa: E731
        out = run()
        if i < index:
            h = out
    w = layer.mlp.down_proj.weight
    with torch.no_grad():
        w.copy_(rtn_quantize(w, GridSpec(4, True, grid="mse"), 64).dequantize())
    rounded = run()
    want = float((rounded - out).pow(2).sum(-1).mean() / out.pow(2).sum(-1).mean())
    assert errors[unit] == pytest.approx(want, rel=1e-3)


def test_keep_patterns_match_anywhere_in_the_name():
    """`--keep 8:mlp.down_proj` picks every layer's down_proj (the pattern was anchored at the name's start,
    so it matched nothing)."""
    cfg = ModelConfig.from_hf_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=320, hidden_size=128,
                                        intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                                        num_key_value_heads=2))
    chosen = keep_choice(cfg, ((8, "mlp.down_proj"),))
    assert sorted(u.label for u in chosen) == ["0.down_proj", "1.down_proj", "2.down_proj"]
    assert sorted(u.label for u in keep_choice(cfg, ((8, r"layers\.1\.mlp"),))) == ["1.down_proj", "1.gate_up_proj"]
