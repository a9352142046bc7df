"""Weight sources: sharded loading, GGUF reading, and one-line errors for bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flotilla.errors import FlotillaError
from flotilla.models.checkpoint import CheckpointWriter, layer_key
from flotilla.models.config import ModelConfig
from flotilla.models.llama import Stage
from flotilla.models.sources import GGUFSource, open_source
from flotilla.models.weights import load_stage

from conftest import (REPO, SIMPLE_CHAT_TEMPLATE, make_hf_model, save_byte_tokenizer, save_hf_model, tiny_config,
                      write_llama_gguf)
from test_models import our_logits


def write_sharded_checkpoint(hf_model, out: Path) -> Path:
    """Every layer in its own shard (a tiny shard size), through the checkpoint writer."""
    config = ModelConfig.from_hf_dict(hf_model.config.to_dict())
    by_layer: dict[str, dict] = {}
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        by_layer.setdefault(layer_key(name), {})[name] = t
    order = ["embed"] + [str(i) for i in range(config.num_hidden_layers)] + ["head"]
    with CheckpointWriter(out, config, shard_size=1) as w:
        for key in order:
            w.add_layer(key, by_layer[key])
        w.commit()
    return out


@pytest.fixture(scope="module")
def tiny_hf():
    return make_hf_model(tiny_config("llama", num_hidden_layers=4), seed=3)


def test_layer_range_opens_only_its_shards(tiny_hf, tmp_path):
    ckpt = write_sharded_checkpoint(tiny_hf, tmp_path / "ckpt")
    manifest = json.loads((ckpt / "flotilla.json").read_text())
    assert len(manifest["shards"]) == 6  # embed, 4 layers, head
    layer_to_shard = manifest["layer_to_shard"]

    source = open_source(ckpt)
    load_stage(source, Stage(1, 3, 4))
    assert sorted(source.opened_files) == sorted({layer_to_shard["1"], layer_to_shard["2"]})

    # Proof by removal: with every other shard deleted, the middle stage still loads.
    for f in set(layer_to_shard.values()) - {layer_to_shard["1"], layer_to_shard["2"]}:
        (ckpt / f).unlink()
    load_stage(open_source(ckpt), Stage(1, 3, 4))
    with pytest.raises(FlotillaError, match="missing"):
        load_stage(open_source(ckpt), Stage(0, 1, 4))


def test_hf_sharded_directory_loads_only_needed_files(tiny_hf, tmp_path):
    tiny_hf.save_pretrained(str(tmp_path / "hf"), max_shard_size="60KB")
    source = open_source(tmp_path / "hf")
    total = len(list((tmp_path / "hf").glob("*.safetensors")))
    assert total > 3
    load_stage(source, Stage(3, 4, 4))
    assert 0 < len(source.opened_files) < total


def test_stages_compose_to_the_whole_model(tiny_hf, tmp_path):
    from flotilla.models.attention import DenseCausalAttention

    path = save_hf_model(tiny_hf, tmp_path / "m")
    whole = load_stage(open_source(path))
    first, last = load_stage(open_source(path), Stage(0, 2, 4)), load_stage(open_source(path), Stage(2, 4, 4))
    ids = torch.randint(0, 256, (17,))
    pos = torch.arange(17)
    with torch.no_grad():
        h = first(ids, pos, DenseCausalAttention(1, 17))
        split = last.compute_logits(last(h, pos, DenseCausalAttention(1, 17)))
        ref = whole.compute_logits(whole(ids, pos, DenseCausalAttention(1, 17)))
    assert torch.equal(split, ref)


@pytest.mark.parametrize("qtype,tol", [("F32", 1e-4), ("F16", 0.05), ("Q8_0", 0.1)])
def test_gguf_reader_undoes_llama_cpp_permutation(qtype, tol, tmp_path):
    hf = make_hf_model(tiny_config("llama", tie_word_embeddings=False), seed=5)
    path = write_llama_gguf(hf, tmp_path / "tiny.gguf", qtype)
    ours = load_stage(GGUFSource(path))
    ids = torch.randint(0, 256, (1, 24))
    with torch.no_grad():
        ref = hf(ids).logits
    assert (our_logits(ours, ids) - ref).abs().max().item() < tol


# ----------------------------------------------------------------------------- CLI error paths

def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "flotilla.runtime.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_cli_generates_with_a_tiny_model(tiny_hf, tmp_path):
    path = save_hf_model(tiny_hf, tmp_path / "m")
    save_byte_tokenizer(path, SIMPLE_CHAT_TEMPLATE)
    proc = run_cli("generate", str(path), "--prompt", "hello", "--max-tokens", "5")
    assert proc.returncode == 0, proc.stderr


def test_cli_error_missing_path(tmp_path):
    assert_one_line_error(run_cli("generate", str(tmp_path / "nope"), "-p", "x"), str(tmp_path / "nope"),
                          "no such file")


def test_cli_error_directory_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_one_line_error(run_cli("generate", str(tmp_path / "empty"), "-p", "x"), "no config.json")


def test_cli_error_unsupported_architecture(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    assert_one_line_error(run_cli("generate", str(d), "-p", "x"), "GPT2LMHeadModel", "unsupported architecture")


def test_cli_error_truncated_safetensors(tiny_hf, tmp_path):
    path = save_hf_model(tiny_hf, tmp_path / "m")
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert_one_line_error(run_cli("generate", str(path), "-p", "x"), "model.safetensors")


def test_cli_error_corrupt_checkpoint_shard_is_named(tiny_hf, tmp_path):
    ckpt = write_sharded_checkpoint(tiny_hf, tmp_path / "ckpt")
    save_byte_tokenizer(ckpt)
    shard = json.loads((ckpt / "flotilla.json").read_text())["layer_to_shard"]["2"]
    data = bytearray((ckpt / shard).read_bytes())
    data[-1] ^= 0xFF
    (ckpt / shard).write_bytes(bytes(data))
    assert_one_line_error(run_cli("generate", str(ckpt), "-p", "x"), shard, "sha256")


def gguf_with_embedding_as(tmp_path, qtype: str, name: str) -> Path:
    """A tiny Llama GGUF whose token_embd (256 rows of 64) is zero bytes of `qtype`."""
    import gguf
    import numpy as np

    hf = make_hf_model(tiny_config("llama"), seed=1)
    path = write_llama_gguf(hf, tmp_path / "ok.gguf")
    reader = gguf.GGUFReader(str(path))
    out = tmp_path / name
    w = gguf.GGUFWriter(str(out), "llama")
    for key, field in reader.fields.items():
        if key.startswith("llama.") or key.startswith("tokenizer."):
            w.add_key_value(key, field.contents(), field.types[0])
    qt = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[qt]
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            w.add_tensor(t.name, np.zeros((256, 64 // block * size if block <= 64 else size), dtype=np.uint8),
                         raw_dtype=qt)
        else:
            w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_gguf_type_without_a_kernel_runs_in_fp32_with_a_warning(tmp_path):
    path = gguf_with_embedding_as(tmp_path, "IQ4_NL", "iq4.gguf")
    model = load_stage(GGUFSource(path))
    assert torch.equal(model.embed(torch.tensor([3, 7])), torch.zeros(2, 64))  # IQ4_NL zero bytes: all zeros
    proc = subprocess.run([sys.executable, "-c", "from flotilla.runtime.loader import load_model; "
                           f"load_model({str(path)!r}, 'cpu', with_tokenizer=False)"],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    report = next(ln for ln in lines if ln.startswith("GGUF iq4.gguf: "))
    assert "IQ4_NL: 1 tensor -> " in report and "F32: " in report
    warning = [ln for ln in lines if ln.startswith("warning:")]
    assert len(warning) == 1 and "IQ4_NL" in warning[0] and "model.embed_tokens.weight" in warning[0]
    assert "fp32" in warning[0] and "7.1x" in warning[0]  # 32 bits against IQ4_NL's 4.5


def test_cli_error_gguf_with_a_type_nothing_can_read(tmp_path):
    bad = gguf_with_embedding_as(tmp_path, "Q8_1", "bad.gguf")
    with pytest.raises(FlotillaError, match="Q8_1"):
        load_stage(GGUFSource(bad))
    assert_one_line_error(run_cli("generate", str(bad), "-p", "x"), "bad.gguf", "Q8_1", "token_embd.weight")


def test_cli_error_not_a_model_file(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("hello")
    assert_one_line_error(run_cli("generate", str(f), "-p", "x"), "notes.txt")
