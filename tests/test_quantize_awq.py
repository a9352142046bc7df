"""AWQ: the scales keep the float layer's function, are folded where the file can hold them, lower
the output error where activations are uneven, and the checkpoint is a plain GPTQ one."""
from __future__ import annotations

import json

import pytest
import torch

from flotilla.kernels.gptq import GPTQWeight
from flotilla.kernels.reference import dequantize
from flotilla.models.attention import DenseCausalAttention
from flotilla.models.linear import Linear
from flotilla.models.sources import open_source
from flotilla.models.weights import load_layer, load_stage
from flotilla.quantize import QuantizeOptions, quantize_model
from flotilla.quantize.activations import CalibrationActivations
from flotilla.quantize.awq import InputStats, apply_scale, output_error, scale_sites, search_scale
from flotilla.quantize.clip import output_clip_params
from flotilla.quantize.grid import GridSpec, rtn_quantize

from quantize_helpers import decode_gptq, read_checkpoint, tiny_model_dir

CALIB = dict(calib_samples=4, calib_seq_len=32)


@pytest.fixture(scope="module")
def mha_src(tmp_path_factory):
    """As many KV heads as heads, so the v_proj -> o_proj site is used too."""
    return tiny_model_dir(tmp_path_factory.mktemp("src") / "mha", seed=4, num_attention_heads=4, num_key_value_heads=4)


def uneven_inputs(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.ones(dim)
    scale[torch.randperm(dim, generator=g)[:dim // 16]] = 20.0  # a few salient channels, as in LLM activations
    return torch.randn(n, dim, generator=g) * scale


def test_search_lowers_the_output_error_where_a_few_channels_dominate():
    X, W = uneven_inputs(2048, 256), torch.randn(64, 256) * 0.05
    stats = InputStats(256, "cpu")
    stats.add(X)
    spec = GridSpec(4, sym=True)
    s, alpha = search_scale(W, stats, spec, 128)
    plain = output_error(W, torch.ones(256), stats.hessian.hessian(), spec, 128)
    assert alpha >= 0 and output_error(W, s, stats.hessian.hessian(), spec, 128) < 0.8 * plain
    assert float(s[X.abs().mean(0) > 5].mean()) > float(s[X.abs().mean(0) < 5].mean())  # salient channels grow


@pytest.mark.parametrize("grid", ["minmax", "output"])
def test_search_keeps_s_one_when_nothing_helps(grid):
    """Scores include s = 1, so the chosen scales never do worse than plain rounding (on the grid
    the weights will be rounded on)."""
    W = torch.randn(16, 64)
    stats = InputStats(64, "cpu")
    stats.add(torch.randn(512, 64))
    spec = GridSpec(4, sym=False, grid=grid)
    s, _ = search_scale(W, stats, spec, 32)
    H = stats.hessian.hessian()
    assert output_error(W, s, H, spec, 32) <= output_error(W, torch.ones(64), H, spec, 32)


def test_output_grid_scores_the_rounding_the_layer_gets():
    """On the output grid a candidate is scored by exactly what the layer will hold: RTN with the
    clipping ranges clip.py picks for the scaled weight and its scaled input."""
    X, W = uneven_inputs(1024, 128), torch.randn(32, 128) * 0.05
    stats = InputStats(128, "cpu")
    stats.add(X)
    spec, H = GridSpec(4, sym=True, grid="output"), stats.hessian.hessian()
    s, alpha = search_scale(W, stats, spec, 64)
    Ws, Hs = W * s, (X / s).T @ (X / s) * (2 / X.shape[0])
    held = rtn_quantize(Ws, spec, 64, output_clip_params(Ws, Hs, spec, 64)).dequantize() / s
    assert alpha >= 0 and output_error(W, s, H, spec, 64) != output_error(W, s, H, GridSpec(4, sym=True), 64)
    assert output_error(W, s, H, spec, 64) == pytest.approx(float(((X @ (held - W).T) ** 2).sum() * 2 / X.shape[0]),
                                                            rel=1e-3)


def test_folded_scales_keep_the_layers_float_outputs(mha_src):
    source = open_source(mha_src)
    layer = load_layer(source, 0)
    x = torch.randn(2, 16, 128) * 3
    acts = CalibrationActivations(x.clone(), source.config)
    before = layer(x.view(32, 128), acts.positions.repeat(2), acts.rope, DenseCausalAttention(2, 16))
    sites = scale_sites(layer)
    assert [s.name for s in sites] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    gen = torch.Generator().manual_seed(0)
    for site in sites:
        apply_scale(site, torch.rand(site.linear.in_features, generator=gen) * 3 + 0.2)
    after = layer(x.view(32, 128), acts.positions.repeat(2), acts.rope, DenseCausalAttention(2, 16))
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    norm = layer.input_layernorm.weight
    assert torch.equal(norm, norm.half().float())  # folded norms are exact in fp16, as the file stores them


def test_gqa_layers_leave_o_proj_unscaled(tmp_path):
    src = tiny_model_dir(tmp_path / "gqa", seed=1, tokenizer=False)  # 4 heads, 2 KV heads
    assert [s.name for s in scale_sites(load_layer(open_source(src), 0))] == ["qkv_proj", "gate_up_proj", "down_proj"]


@pytest.mark.parametrize("method,act_order", [("awq", False), ("awq+gptq", True)])
def test_awq_checkpoint_is_plain_gptq_and_matches_the_quantizer(mha_src, tmp_path, method, act_order):
    out = tmp_path / "q"
    memory, norms, alphas = {}, {}, []

    def on_layer(index, layer, result):
        alphas.extend(result.awq_alpha.values())
        norms[index] = layer.input_layernorm.weight.clone()
        for name, mod in layer.named_modules():
            if isinstance(mod, Linear):
                memory[f"{index}.{name}"] = result.weights[mod].dequantize()

    quantize_model(mha_src, out, QuantizeOptions(method=method, act_order=act_order, group_size=64, **CALIB),
                   progress=False, on_layer=on_layer)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "gptq" and config["flotilla_method"] == method
    assert len(alphas) == 8 and any(a >= 0 for a in alphas)  # scales were chosen somewhere
    raw = read_checkpoint(out)
    for index in (0, 1):
        p = f"model.layers.{index}."
        # a folded norm is fp16-exact already; an unscaled one (α -1) is the fp32 source's, stored in fp16
        assert torch.equal(torch.from_numpy(raw[p + "input_layernorm.weight"].copy()).float(),
                           norms[index].half().float())
        t = {s: raw[f"{p}self_attn.o_proj.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx")}
        decoded = torch.from_numpy(decode_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4))
        assert torch.equal(decoded.t(), memory[f"{index}.self_attn.o_proj"])
    model = load_stage(open_source(out), keep_source=True)
    w = model.model.layers["1"].mlp.down_proj.gptq_weight()
    assert isinstance(w, GPTQWeight) and torch.equal(dequantize(w).t(), memory["1.mlp.down_proj"])


def test_awq_beats_rtn_on_a_tiny_models_outputs(tmp_path):
    """With a few salient hidden channels (as trained LLMs have: here the norms boost 8 of 128),
    scaled weights give logits closer to the float model's, on self-generated calibration text."""
    from safetensors.torch import load_file, save_file

    src = tiny_model_dir(tmp_path / "src", seed=4, num_attention_heads=4, num_key_value_heads=4)
    tensors = load_file(str(src / "model.safetensors"))
    salient = torch.randperm(128, generator=torch.Generator().manual_seed(0))[:8]
    for name, t in tensors.items():
        if name.endswith("layernorm.weight"):
            t[salient] *= 10
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    fp = load_stage(open_source(src))
    ids, positions = torch.arange(64) % 250, torch.arange(64)

    def logits(model):
        return model.compute_logits(model(ids, positions, DenseCausalAttention(1, 64)))

    ref = logits(fp)
    err = {}
    for method in ("rtn", "awq"):
        quantize_model(src, tmp_path / method, QuantizeOptions(method=method, group_size=64, grid="minmax",
                                                                   calib_samples=16, calib_seq_len=64), progress=False)
        err[method] = float((logits(load_stage(open_source(tmp_path / method))) - ref).pow(2).mean())
    assert err["awq"] < err["rtn"]


def test_calibrated_methods_clip_by_output_error_unless_told():
    """A weight-space clipping search would clip the weights AWQ scaled up (options.default_grid)."""
    for method in ("awq", "awq+gptq", "gptq"):
        assert QuantizeOptions(method=method).grid == "output"
    assert QuantizeOptions(method="rtn").grid == "mse"
    assert QuantizeOptions(method="awq", grid="minmax").grid == "minmax"
    assert QuantizeOptions(method="awq").label == "INT4 AWQ g128 sym"
    assert QuantizeOptions(method="awq", grid="mse").label == "INT4 AWQ g128 sym mse"
