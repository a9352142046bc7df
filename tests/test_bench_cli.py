"""`runtime bench --random tiny` end to end on CPU (a subprocess, as users run it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def runtime(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "flotilla.runtime.cli", *args], env=env,
                          capture_output=True, text=True, timeout=600)


def test_bench_random_tiny_decodes_every_token_of_every_stream():
    p = runtime("bench", "--random", "tiny", "--bits", "4", "--batch", "1,3", "--tokens", "6", "--prompt-len", "5",
                "--device", "cpu", "--json")
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["model"] == "random tiny (int4 g128)" and r["device"] == "cpu" and r["dtype"] == "float32"
        assert r["decode_tokens"] == r["batch"] * 5  # 6 tokens a stream, the first from the prefill step
        assert r["decode_steps"] == 5 and r["graphs"] is False and r["overlap"] is False  # a CPU: no overlap
        assert r["tok_s"] > 0 and abs(r["tok_s_per_stream"] * r["batch"] - r["tok_s"]) < 1e-6 * r["tok_s"]


def test_bench_table_and_errors():
    p = runtime("bench", "--random", "tiny", "--bits", "8", "--tokens", "3", "--prompt-len", "2", "--device", "cpu")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("random tiny (int8 g128) on cpu (float32)")
    assert lines[1].split() == ["batch", "tok/s", "tok/s/stream", "ms/step", "graphs", "overlap"]
    assert lines[2].split()[0] == "1" and lines[2].split()[-1] == "no"
    bad = runtime("bench", "--random", "llama-9", "--device", "cpu")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "error: unknown model shape 'llama-9'; valid: llama-3-8b, llama-3-70b, qwen3-8b, phi-3-mini, gemma-3-4b, tiny, tiny-qwen3"
    bad = runtime("bench", "--random", "tiny", "--batch", "1,x", "--device", "cpu")
    assert bad.returncode == 2 and "--batch '1,x': expected positive integers" in bad.stderr
    bad = runtime("bench", "some/model", "--bits", "8", "--device", "cpu")  # was ignored: the path ran as it was
    assert bad.returncode == 2 and bad.stderr.strip() == ("error: --bits: only with --random SHAPE (a random model); "
                                                          "a model file or checkpoint (the default one too) runs "
                                                          "as it was quantized")
    bad = runtime("bench", "--random", "tiny", "--gguf", "Q4_0", "--group-size", "32", "--device", "cpu")
    assert bad.returncode == 2 and "leave out --bits and --group-size" in bad.stderr


def test_bench_runs_a_gguf_file_and_the_default_model(smollm2_gguf):
    """`runtime bench` on a GGUF file (the embedded default): the table, with the bytes its kernels read
    a step (the packed GGUF forms and the tied Q8_0 table), not a traceback."""
    for args in ((str(smollm2_gguf),), ()):
        p = runtime("bench", *args, "--batch", "1", "--tokens", "3", "--prompt-len", "2", "--device", "cpu")
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
        head = p.stdout.splitlines()[0]
        assert head.startswith(f"{smollm2_gguf} on cpu (float32), 0.0"), head  # ~90 MB of SmolLM2's forms
        assert float(head.split(", ")[1].split()[0]) > 0.05


def test_gguf_mixes_give_llama_cpp_types():
    """llama.cpp's Q4_K_M of a 32-layer model, worked by hand: attn_v and ffn_down are Q6_K in layers 0-3 and
    28-31 (the first and last eighth) and every third layer between (6, 9, ..., 27); the output is Q6_K."""
    from flotilla.runtime.random_model import gguf_tensor_type

    more = [i for i in range(32) if gguf_tensor_type("Q4_K_M", "ffn_down", i, 32) == "Q6_K"]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [gguf_tensor_type("Q4_K_M", t, 6, 32) for t in ("attn_q", "attn_v", "ffn_up", "output", "token_embd")] \
        == ["Q4_K", "Q6_K", "Q4_K", "Q6_K", "Q4_K"]
    assert gguf_tensor_type("Q5_K_M", "attn_v", 0, 32) == "Q6_K" and gguf_tensor_type("Q5_K_M", "attn_v", 4, 32) == "Q5_K"
    assert {gguf_tensor_type("Q4_0", t, 0, 32) for t in ("attn_v", "ffn_down")} == {"Q4_0"}
    assert gguf_tensor_type("Q4_0", "output", 0, 32) == "Q6_K" and gguf_tensor_type("Q8_0", "output", 0, 32) == "Q8_0"
    # the last eighth is i >= 7 n / 8: layer 24 of 28 (n - n // 8 would start it at 25)
    assert gguf_tensor_type("Q4_K_M", "attn_v", 24, 28) == "Q6_K" and gguf_tensor_type("Q4_K_M", "attn_v", 22, 28) == "Q4_K"
    # a 70B model's other attn_v get Q5_K in a Q4_K_M file
    assert [gguf_tensor_type("Q4_K_M", "attn_v", i, 80, is_70b=True) for i in (0, 10, 11, 12)] == \
        ["Q6_K", "Q5_K", "Q5_K", "Q6_K"]
    assert gguf_tensor_type("Q4_K_M", "attn_q", 11, 80, is_70b=True) == "Q4_K"
    # rows that are not whole 256-weight blocks: llama.cpp's fallbacks
    assert [gguf_tensor_type("Q4_K_M", t, 0, 32, n_in=576) for t in ("attn_q", "attn_v", "output")] == \
        ["Q5_0", "Q8_0", "Q8_0"]
    assert gguf_tensor_type("Q5_K_M", "attn_q", 4, 32, n_in=576) == "Q5_1"


def test_random_ggml_weights_are_centred_with_the_asked_spread():
    import torch

    from flotilla.kernels.ggml import GGML_FORMATS
    from flotilla.runtime.random_model import random_ggml_weight

    gen = torch.Generator().manual_seed(0)
    for qtype, fmt in GGML_FORMATS.items():
        w = random_ggml_weight(qtype, 64, 1024, gen)
        dense = w.dequantize()
        assert abs(dense.mean().item()) < 0.05 * 1024 ** -0.5, qtype
        assert abs(dense.std().item() * 1024 ** 0.5 - 1) < 0.1, qtype
        assert int(w.codes.min()) >= fmt.code_min and int(w.codes.max()) <= fmt.code_max
        if fmt.fp16_scales:
            assert torch.equal(w.scales, w.scales.half().float())


def test_random_gguf_model_decodes(monkeypatch):
    """A random model in a Q4_K_M file's types (a shape whose rows are whole 256-weight blocks) decodes on the
    CPU's GGUF kernels: every linear, the embedding and the lm_head in GGUF forms, logits finite and of
    about unit spread, the same bytes for the same seed."""
    import torch

    from flotilla.models.config import ModelConfig
    from flotilla.models.gguf_linear import GGUFLinear, GGUFLMHead
    from flotilla.runtime import random_model
    from flotilla.runtime.bench import run_batches

    monkeypatch.setitem(random_model.SHAPES, "gguf-test", ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=512, hidden_size=256, intermediate_size=512,
        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False, eos_token_ids=()))
    model = random_model.build_random_gguf_model("gguf-test", "Q4_K_M", "cpu", torch.float32, seed=1)
    assert sum(isinstance(m, GGUFLinear) and m.prepared for m in model.modules()) == 8 * 4
    assert isinstance(model.lm_head, GGUFLMHead) and model.lm_head.prepared
    ids = torch.arange(1, 9)
    with torch.no_grad():
        hidden = model.model.embed_tokens(ids)
    assert hidden.shape == (8, 256) and 0.8 < hidden.std().item() < 1.2
    again = random_model.build_random_gguf_model("gguf-test", "Q4_K_M", "cpu", torch.float32, seed=1)
    assert torch.equal(again.model.embed_tokens(ids), hidden)
    (r,) = run_batches(model, [2], prompt_len=4, tokens=4, graphs=False)
    assert r.decode_tokens == 2 * 3 and r.tok_s > 0


def test_bench_random_gguf_cli():
    p = runtime("bench", "--random", "tiny", "--gguf", "q8_0", "--batch", "2", "--tokens", "3", "--prompt-len", "2",
                "--device", "cpu", "--json")
    assert p.returncode == 0, p.stderr
    (row,) = [json.loads(line) for line in p.stdout.splitlines()]
    assert row["model"] == "random tiny (GGUF Q8_0)" and row["batch"] == 2
    # rows of 128 are no whole K blocks: llama.cpp's fallbacks (Q5_0, Q8_0) as in its own files
    p = runtime("bench", "--random", "tiny", "--gguf", "Q4_K", "--tokens", "3", "--prompt-len", "2", "--device", "cpu")
    assert p.returncode == 0 and p.stdout.startswith("random tiny (GGUF Q4_K_M) on cpu"), p.stderr
    bad = runtime("bench", "--random", "tiny", "--gguf", "Q3_K", "--device", "cpu")
    assert bad.returncode == 2 and "--gguf Q3_K: expected one of" in bad.stderr
    bad = runtime("bench", "--gguf", "Q4_0", "--device", "cpu")
    assert bad.returncode == 2 and "give --random SHAPE too" in bad.stderr


def test_a_random_phi3_shape_decodes_and_writes_fused_checkpoints(monkeypatch, tmp_path):
    """`runtime bench --random phi-3-mini`'s kind of model (heads 96 wide, fused q/k/v and gate/up) at a CPU size:
    INT4 decodes, and its random checkpoint stores the fused names and loads back."""
    import dataclasses

    import safetensors
    import torch

    from flotilla.models.attention import DenseCausalAttention
    from flotilla.models.sources import open_source
    from flotilla.models.weights import load_stage
    from flotilla.runtime import random_model
    from flotilla.runtime.bench import run_batches

    small = dataclasses.replace(random_model.SHAPES["phi-3-mini"], vocab_size=512, hidden_size=256,
                                intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=4, head_dim=64, max_position_embeddings=512)
    monkeypatch.setitem(random_model.SHAPES, "phi3-test", small)
    model = random_model.build_random_model("phi3-test", bits=4, seed=1)
    assert model.config.family == "phi3"
    (r,) = run_batches(model, [2], prompt_len=4, tokens=4, graphs=False)
    assert r.decode_tokens == 2 * 3 and r.tok_s > 0
    out = tmp_path / "ckpt"
    random_model.write_random_checkpoint("phi3-test", out)
    names = set()
    for f in out.glob("*.safetensors"):
        with safetensors.safe_open(str(f), "pt") as h:
            names |= set(h.keys())
    assert "model.layers.0.self_attn.qkv_proj.qweight" in names and "model.layers.1.mlp.gate_up_proj.scales" in names
    assert not any("q_proj" in n or "gate_proj" in n for n in names)
    loaded = load_stage(open_source(out))
    ids = torch.arange(1, 6)
    with torch.no_grad():
        logits = loaded.compute_logits(loaded(ids, torch.arange(5), DenseCausalAttention(1, 5)))
    assert logits.shape == (5, 512) and torch.isfinite(logits).all()


def test_a_random_gemma3_shape_decodes_and_writes_its_norms(monkeypatch, tmp_path):
    """`runtime bench --random gemma-3-4b`'s kind of model (output norms, gelu, two ropes, sliding layers) at a CPU
    size: INT4 decodes past its window, and its random checkpoint holds the four norms a layer and loads back."""
    import dataclasses

    import safetensors
    import torch

    from flotilla.models.attention import DenseCausalAttention
    from flotilla.models.sources import open_source
    from flotilla.models.weights import load_stage
    from flotilla.runtime import random_model
    from flotilla.runtime.bench import run_batches

    small = dataclasses.replace(random_model.SHAPES["gemma-3-4b"], vocab_size=512, hidden_size=256,
                                intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                max_position_embeddings=512, sliding_window=4)
    monkeypatch.setitem(random_model.SHAPES, "gemma3-test", small)
    model = random_model.build_random_model("gemma3-test", bits=4, seed=1, num_layers=7)
    assert model.config.family == "gemma3" and model.config.layer_types[5] == "full_attention"
    assert model.config.layer_types[6] == "sliding_attention"
    (r,) = run_batches(model, [2], prompt_len=6, tokens=6, graphs=False)
    assert r.decode_tokens == 2 * 5 and r.tok_s > 0
    out = tmp_path / "ckpt"
    random_model.write_random_checkpoint("gemma3-test", out, num_layers=2)
    names = set()
    for f in out.glob("*.safetensors"):
        with safetensors.safe_open(str(f), "pt") as h:
            names |= set(h.keys())
    assert {"model.layers.1.pre_feedforward_layernorm.weight", "model.layers.1.post_feedforward_layernorm.weight",
            "model.layers.0.self_attn.q_norm.weight"} <= names
    loaded = load_stage(open_source(out))
    ids = torch.arange(1, 9)
    with torch.no_grad():
        logits = loaded.compute_logits(loaded(ids, torch.arange(8), DenseCausalAttention(1, 8)))
    assert logits.shape == (8, 512) and torch.isfinite(logits).all()
