"""quantize --rotate: the orthogonal matrices, the rotated model's exactness (its fp32 logits are the
unrotated model's) and the checkpoints it writes."""
from __future__ import annotations

import json

import pytest
import torch

from flotilla.models.attention import DenseCausalAttention
from flotilla.models.sources import open_source
from flotilla.models.weights import load_stage
from flotilla.quantize.hadamard import hadamard, rotation
from flotilla.quantize.options import QuantizeOptions
from flotilla.quantize.pipeline import quantize_model
from flotilla.quantize.rotate import rotated

from conftest import make_hf_model, save_hf_model, tiny_config
from quantize_helpers import quantize_cli, tiny_model_dir

TOKENS = torch.tensor([1, 5, 9, 77, 200, 3, 41, 250, 12, 7, 99, 18])


@pytest.mark.parametrize("n", [1, 2, 12, 24, 36, 64, 72, 96, 576, 960])
def test_hadamard_orders(n):
    h = hadamard(n)
    assert h is not None and set(h.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=h.dtype))


@pytest.mark.parametrize("kind,n,expect", [("hadamard", 576, "hadamard-576"), ("hadamard", 100, "random-100"),
                                           ("random", 64, "random-64")])
def test_rotations_are_orthogonal_and_seeded(kind, n, expect):
    q, name = rotation(n, kind, 3)
    assert name == expect
    torch.testing.assert_close(q @ q.T, torch.eye(n, dtype=q.dtype), rtol=0, atol=1e-12)
    assert torch.equal(q, rotation(n, kind, 3)[0]) and not torch.equal(q, rotation(n, kind, 4)[0])


def _logits(source) -> torch.Tensor:
    model = load_stage(source)
    with torch.no_grad():
        return model.compute_logits(model(TOKENS, torch.arange(len(TOKENS)), DenseCausalAttention(1, len(TOKENS))))


@pytest.mark.parametrize("family,kind,scope,extra", [
    ("llama", "hadamard", "r1+r2", dict(tie_word_embeddings=True)),  # hidden 96 = 12 x 8, head_dim 24 = Paley I
    ("llama", "random", "r1", dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True)),
    ("qwen2", "hadamard", "r1+r2", dict(tie_word_embeddings=False)),  # q/k/v biases
    ("qwen2", "random", "r2", dict(tie_word_embeddings=True)),
])
def test_rotated_model_gives_the_same_logits(tmp_path, family, kind, scope, extra):
    cfg = tiny_config(family, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, **extra)
    src = save_hf_model(make_hf_model(cfg, seed=2), tmp_path / "m")
    source = open_source(src)
    rot = rotated(source, kind, scope, seed=0)
    assert (rot.rot.r is None) == (scope == "r1") and (rot.rot.q is None) == (scope == "r2")
    norm = rot.get("model.layers.1.input_layernorm.weight")
    if scope == "r2":  # the residual stream as it was: norms and a tied head kept
        assert rot.config.tie_word_embeddings and torch.equal(norm, source.get("model.layers.1.input_layernorm.weight"))
    else:
        assert not rot.config.tie_word_embeddings and torch.equal(norm, torch.ones(96))
    torch.testing.assert_close(_logits(rot), _logits(source), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind,kept", [("hadamard", 8), ("random", 2)])
def test_suppressed_channels_stay_out_of_r1_and_the_logits_still_match(tmp_path, kind, kept):
    cfg = tiny_config("llama", hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)
    hf = make_hf_model(cfg, seed=3)
    with torch.no_grad():  # channels 5 and 9 suppressed by every norm, as massive-activation channels are
        for name, p in hf.named_parameters():
            if "norm" in name:
                p[[5, 9]] = 1e-3
    source = open_source(save_hf_model(hf, tmp_path / "m"))
    rot = rotated(source, kind, "r1+r2", seed=0)
    assert len(rot.rot.kept) == kept and {5, 9} <= set(rot.rot.kept)  # 96 - 8 = 88 = 43 + 1 (Paley I)
    assert rot.rot.description.startswith(f"r1 {kind}-{96 - kept} (channels ")
    norm = rot.get("model.layers.0.input_layernorm.weight")
    rest = [c for c in range(96) if c not in rot.rot.kept]
    g = source.get("model.layers.0.input_layernorm.weight")
    assert float(norm[5]) == pytest.approx(1e-3 / float(g.abs().median()), rel=1e-6)  # the median goes to the weights
    assert torch.equal(norm[rest], torch.ones(len(rest)))
    torch.testing.assert_close(_logits(rot), _logits(source), rtol=1e-4, atol=1e-4)
    assert rotated(source, kind, "r1", seed=0, keep_outliers=False).rot.kept == ()


def test_smollm2_rotated_logits_match(smollm2_gguf):
    source = open_source(smollm2_gguf, native_gguf=False)
    rot = rotated(source, "hadamard", "r1+r2", seed=0)
    assert rot.rot.description == "r1 hadamard-572 (channels 128, 247, 423, 507 kept), r2 hadamard-64, seed 0"
    want = _logits(source)
    torch.testing.assert_close(_logits(rot), want, rtol=0, atol=2e-3 * float(want.abs().max()))


def test_rotated_checkpoint_is_plain_gptq_and_runs(tmp_path):
    src = tiny_model_dir(tmp_path / "tiny", seed=4, tie_word_embeddings=True)
    out = tmp_path / "q"
    r = quantize_cli(src, "-o", out, "--method", "rtn", "--bits", "8", "--rotate", "--quiet")
    assert r.returncode == 0, r.stderr
    assert "r1 hadamard-128, r2 hadamard-32, seed 0" in r.stderr and "untied" in r.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["quantization_config"]["flotilla_rotation"] == "r1 hadamard-128, r2 hadamard-32, seed 0"
    assert open_source(out).config.quant.rotation == config["quantization_config"]["flotilla_rotation"]
    got, want = _logits(open_source(out)), _logits(open_source(src))
    assert (got - want).abs().max() < 0.05 * want.abs().max()  # INT8 of a rotated model: close to the float one


def test_rotate_composes_with_awq_gptq_and_sensitive(tmp_path):
    src = tiny_model_dir(tmp_path / "tiny", seed=6)
    calib = tmp_path / "calib.txt"
    calib.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    options = QuantizeOptions(method="awq+gptq", group_size=64, sensitive=2, rotate="random", rotate_scope="r1",
                              calib_file=calib, calib_samples=4, calib_seq_len=32)
    report = quantize_model(src, tmp_path / "q", options, progress=False)
    assert len(report.kept) == 2 and not report.untied_head  # the tiny model's lm_head is untied already
    quant = open_source(tmp_path / "q").config.quant
    assert quant.rotation == "r1 random-128, seed 0" and quant.method == "awq+gptq" and quant.dynamic
    got, want = _logits(open_source(tmp_path / "q")), _logits(open_source(src))
    assert (got - want).norm() < 0.5 * want.norm()  # INT4 of random weights: 0.36, as without --rotate (0.37)


def test_bad_rotation_is_one_line(tmp_path):
    r = quantize_cli(tmp_path / "nowhere", "--rotate", "givens")
    assert r.returncode == 2 and "--rotate 'givens' is not a rotation" in r.stderr
