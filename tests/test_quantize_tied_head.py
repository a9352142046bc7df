"""quantize --rotate-tied-head: R1 keeps a tied lm_head tied (the final norm's weight becomes the
matrix M = Qᵀ diag(g) Q). The rotated model's logits are the unrotated model's (and transformers'),
and those of the untied-head rotation; through the runtime loader, split into pipeline stages; the
report counts M instead of a head; the flag's misuses are one-line errors."""
from __future__ import annotations

import json

import pytest
import torch

from flotilla.errors import FlotillaError
from flotilla.models.attention import DenseCausalAttention
from flotilla.models.linear import QuantLinear
from flotilla.models.llama import Stage
from flotilla.models.sources import open_source
from flotilla.models.weights import NORM_MATRIX, load_stage
from flotilla.quantize.options import QuantizeOptions
from flotilla.quantize.pipeline import quantize_model
from flotilla.quantize.rotate import rotated
from flotilla.runtime.loader import load_model

from conftest import make_hf_model, save_hf_model, tiny_config
from quantize_helpers import quantize_cli, read_checkpoint, tiny_model_dir

TOKENS = torch.tensor([1, 5, 9, 77, 200, 3, 41, 250, 12, 7, 99, 18])
POSITIONS = torch.arange(len(TOKENS))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(TOKENS, POSITIONS, DenseCausalAttention(1, len(TOKENS))))


def _tied_model(tmp_path, seed: int, suppressed: bool = False):
    """A tiny tied Llama whose final norm weight spans two orders of magnitude (so M is far from a
    multiple of the identity); `suppressed`: channels 5 and 9 near 0 in every norm (kept out of R1)."""
    cfg = tiny_config("llama", hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)
    hf = make_hf_model(cfg, seed=seed)
    with torch.no_grad():
        hf.model.norm.weight.copy_(torch.exp(torch.randn(96, generator=torch.Generator().manual_seed(seed))))
        for name, p in hf.named_parameters():
            if suppressed and "norm" in name:
                p[[5, 9]] = 1e-3
    return hf, save_hf_model(hf, tmp_path / "m")


@pytest.mark.parametrize("kind,scope,suppressed", [("hadamard", "r1+r2", False), ("random", "r1", False),
                                                   ("hadamard", "r1+r2", True)])
def test_tied_head_rotation_gives_the_same_logits(tmp_path, kind, scope, suppressed):
    hf, src = _tied_model(tmp_path, seed=2, suppressed=suppressed)
    source = open_source(src)
    tied = rotated(source, kind, scope, seed=0, tied_head=True)
    assert tied.norm_matrix and not tied.untied_head and bool(tied.rot.kept) == suppressed
    assert tied.config.tie_word_embeddings and tied.config.final_norm_matrix
    assert NORM_MATRIX in tied.names() and "lm_head.weight" not in tied.names()
    assert torch.equal(tied.get("model.norm.weight"), torch.ones(96))
    m, q = tied.get(NORM_MATRIX), tied.rot.q
    torch.testing.assert_close(m, m.T, rtol=0, atol=1e-5)
    torch.testing.assert_close(q @ m @ q.T, torch.diag(source.get("model.norm.weight")), rtol=0, atol=1e-4)
    want = _logits(load_stage(source))
    with torch.no_grad():
        hf_logits = hf(TOKENS[None]).logits[0]
    torch.testing.assert_close(want, hf_logits, rtol=1e-4, atol=1e-4)
    got = _logits(load_stage(tied))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    untied = _logits(load_stage(rotated(source, kind, scope, seed=0)))
    torch.testing.assert_close(got, untied, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny tied Llama quantized INT4 RTN g64, rotated, with and without the flag; with every linear
    kept in fp16 (--keep 16:.*) so that the logits can be compared with the float model's; and with
    the head quantized (--lm-head-bits 8: the rotated embedding, after M)."""
    root = tmp_path_factory.mktemp("tied-head")
    src = tiny_model_dir(root / "src", seed=4, tie_word_embeddings=True)
    out = {"src": src}
    for name, extra in (("tied", dict(rotate_tied_head=True)), ("untied", {}),
                        ("fp16", dict(rotate_tied_head=True, keep=((16, ".*"),))),
                        ("head8", dict(rotate_tied_head=True, lm_head_bits=8))):
        options = QuantizeOptions(method="rtn", group_size=64, rotate="hadamard", **extra)
        out[name] = root / name
        out[f"{name}-report"] = quantize_model(src, out[name], options, progress=False)
    return out


def test_tied_head_checkpoint_stores_m_and_no_head(checkpoints):
    tied, untied = checkpoints["tied"], checkpoints["untied"]
    config = json.loads((tied / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["flotilla_final_norm_matrix"] is True
    assert config["quantization_config"]["flotilla_rotation"] == "r1 hadamard-128, r2 hadamard-32, seed 0"
    tensors = read_checkpoint(tied)  # the independent safetensors reader
    assert tensors[NORM_MATRIX].dtype.name == "float16" and tensors[NORM_MATRIX].shape == (128, 128)
    assert not any(n.startswith("lm_head.") for n in tensors)
    assert (tensors["model.norm.weight"] == 1).all()
    assert "lm_head.weight" in read_checkpoint(untied) and NORM_MATRIX not in read_checkpoint(untied)
    assert "flotilla_final_norm_matrix" not in json.loads((untied / "config.json").read_text())
    # bits per weight: the same decoder linears; M (128 x 128 fp16) in place of the head (320 x 128 fp16)
    r_tied, r_untied = checkpoints["tied-report"], checkpoints["untied-report"]
    weights = 2 * (128 * (128 + 2 * 64) + 128 * 128 + 2 * 128 * 256 + 256 * 128)  # 2 layers' q/k/v, o, gate/up, down
    assert r_untied.bits_per_weight - r_tied.bits_per_weight == pytest.approx(16 * (320 - 128) * 128 / weights)
    assert r_tied.norm_matrix and not r_tied.untied_head and "kept the lm_head tied" in "\n".join(r_tied.lines())
    said = "\n".join(checkpoints["head8-report"].lines())  # M and an int8 head apart: not "kept tied"
    assert "kept the lm_head tied" not in said and "lm_head written apart at 8 bits" in said, said


def test_tied_head_checkpoint_through_the_runtime_loader(checkpoints):
    src = load_model(checkpoints["src"], device="cpu", dtype="float32", with_tokenizer=False).model
    want = _logits(src)
    fp16 = load_model(checkpoints["fp16"], device="cpu", dtype="float32", with_tokenizer=False).model
    assert fp16.model.norm_matrix is not None and fp16.lm_head.weight is fp16.model.embed_tokens.weight
    assert (_logits(fp16) - want).abs().max() < 2e-3 * want.abs().max()  # only fp16 storage rounds
    tied = load_model(checkpoints["tied"], device="cpu", dtype="float32", with_tokenizer=False).model
    untied = load_model(checkpoints["untied"], device="cpu", dtype="float32", with_tokenizer=False).model
    got, other = _logits(tied), _logits(untied)
    assert (got - other).abs().max() < 2e-3 * other.abs().max()  # the same INT4 linears, the same head's function
    head8 = load_model(checkpoints["head8"], device="cpu", dtype="float32", with_tokenizer=False).model
    assert head8.model.norm_matrix is not None and isinstance(head8.lm_head, QuantLinear)
    assert (_logits(head8) - other).abs().max() < 2e-2 * other.abs().max()  # the rotated embedding as an INT8 head
    assert (got - want).norm() < 0.5 * want.norm()  # INT4 RTN of random weights


def test_tied_head_checkpoint_in_two_pipeline_stages(checkpoints):
    source = open_source(checkpoints["tied"])
    whole = load_stage(source)
    first, last = load_stage(source, Stage(0, 1, 2)), load_stage(source, Stage(1, 2, 2))
    assert first.model.norm_matrix is None and last.model.norm_matrix is not None
    attn = DenseCausalAttention(1, len(TOKENS))
    with torch.no_grad():
        hidden = first(TOKENS, POSITIONS, attn)
        got = last.compute_logits(last(hidden, POSITIONS, DenseCausalAttention(1, len(TOKENS))))
    torch.testing.assert_close(got, _logits(whole), rtol=1e-5, atol=1e-5)


def test_tied_head_misuse_is_a_clear_error(tmp_path):
    with pytest.raises(FlotillaError, match="--rotate-tied-head needs --rotate"):
        QuantizeOptions(rotate_tied_head=True)
    with pytest.raises(FlotillaError, match="--rotate-scope r2 has no R1"):
        QuantizeOptions(rotate="random", rotate_scope="r2", rotate_tied_head=True)
    src = tiny_model_dir(tmp_path / "untied", seed=1, tokenizer=False)  # tie_word_embeddings false
    r = quantize_cli(src, "-o", tmp_path / "q", "--method", "rtn", "--rotate", "--rotate-tied-head")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "tie_word_embeddings is false" in r.stderr
    assert not (tmp_path / "q").exists()
