"""Phi-3 (Phi3ForCausalLM): its fused q/k/v and gate/up read and written under their own names, longrope, against
transformers; the same weights as a Llama quantize to the same tensors; a llama.cpp-style GGUF of it."""
from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest
import safetensors
import torch

from flotilla.errors import FlotillaError
from flotilla.models.config import ModelConfig
from flotilla.models.sources import open_source
from flotilla.models.weights import load_stage

from conftest import make_hf_model, save_byte_tokenizer, save_hf_model, tiny_config, write_llama_gguf
from test_models import our_logits

LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [1.0 + 2.0 * i for i in range(8)]}


def phi3_config(**overrides):
    from transformers import Phi3Config

    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-5,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, sliding_window=None)
    base.update(overrides)
    return Phi3Config(**base)


def logits_diff(ours, hf, length: int, seed: int = 1) -> float:
    ids = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = hf(ids).logits
    return (our_logits(ours, ids) - ref).abs().max().item()


def test_phi3_logits_match_transformers_and_its_fused_tensors_read_split(tmp_path):
    hf = make_hf_model(phi3_config(), seed=3)
    source = open_source(save_hf_model(hf, tmp_path / "phi3"))
    assert source.config.family == "phi3"
    names = source.names()
    assert "model.layers.0.self_attn.k_proj.weight" in names and "model.layers.0.mlp.up_proj.weight" in names
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)
    state = hf.state_dict()
    fused = state["model.layers.1.mlp.gate_up_proj.weight"]
    assert torch.equal(source.get("model.layers.1.mlp.up_proj.weight"), fused[128:])
    assert logits_diff(load_stage(source), hf, 40) < 1e-4


def test_longrope_short_factors_within_the_original_context_long_ones_past_it(tmp_path):
    """A sequence within the original context (64 here) gets transformers' logits (its short factors); past it a
    position's rope takes the long factors (vLLM's decode does so: cached keys keep theirs), while transformers
    recomputes the whole sequence with them: its logits at positions past 64 are what a table of long factors
    alone gives."""
    from flotilla.models.rope import RotaryEmbedding, longrope_inv_frequencies

    hf = make_hf_model(phi3_config(original_max_position_embeddings=64, rope_scaling=dict(LONGROPE)), seed=5)
    source = open_source(save_hf_model(hf, tmp_path / "phi3-long"))
    rope = source.config.rope_scaling
    assert rope.rope_type == "longrope" and rope.original_max_position_embeddings == 64
    assert rope.attention_factor == pytest.approx((1 + torch.log(torch.tensor(4.0)) / torch.log(torch.tensor(64.0))) ** 0.5)
    ours = load_stage(source)  # a table of 256 positions
    assert logits_diff(ours, hf, 40) < 1e-4 and logits_diff(ours, hf, 64) < 1e-4
    table = ours.rope
    for p, factors in ((63, rope.short_factor), (64, rope.long_factor), (200, rope.long_factor)):
        angles = p * longrope_inv_frequencies(16, source.config.rope_theta, factors)
        assert torch.allclose(table.cos[p, :8], angles.cos() * rope.attention_factor, atol=1e-6), p
    whole_long = RotaryEmbedding(16, 256, source.config.rope_theta, dataclasses.replace(
        rope, original_max_position_embeddings=0))  # every position long: transformers' view of an 80-token sequence
    ours.rope = whole_long
    assert logits_diff(ours, hf, 80) < 1e-4
    back = ModelConfig.from_hf_dict(source.config.to_hf_dict())  # written as transformers reads it
    assert back.rope_scaling == rope
    from transformers import Phi3Config

    reread = Phi3Config(**source.config.to_hf_dict()).rope_parameters
    assert reread["rope_type"] == "longrope" and reread["long_factor"] == list(rope.long_factor)


def as_llama(hf_phi3):
    """The same weights as a transformers Llama (q/k/v and gate/up split): the same function."""
    from transformers import LlamaForCausalLM

    c = hf_phi3.config
    llama = LlamaForCausalLM(tiny_config("llama", num_hidden_layers=c.num_hidden_layers, tie_word_embeddings=False))
    state, q, kv, i = {}, c.hidden_size, c.hidden_size // c.num_attention_heads * c.num_key_value_heads, c.intermediate_size
    for name, t in hf_phi3.state_dict().items():
        if "qkv_proj" in name:
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                state[name.replace("qkv_proj", proj)] = part
        elif "gate_up_proj" in name:
            for proj, part in zip(("gate_proj", "up_proj"), t.split([i, i])):
                state[name.replace("gate_up_proj", proj)] = part
        else:
            state[name] = t
    llama.load_state_dict(state)
    return llama.eval()


def read_all(directory):
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safetensors.safe_open(str(f), "pt") as h:
            out.update({n: h.get_tensor(n) for n in h.keys()})
    return out


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_a_quantized_phi3_stores_fused_tensors_equal_to_the_llama_twins_split_ones(method, tmp_path):
    """Phi-3 is a Llama whose q/k/v and gate/up are stored fused: quantized the same way, its checkpoint's fused
    tensors are the Llama twin's joined (so vLLM and GPTQModel read it as a Phi-3), and it runs the same."""
    hf = make_hf_model(phi3_config(num_hidden_layers=2), seed=7)
    llama = as_llama(hf)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (hf(ids).logits - llama(ids).logits).abs().max() < 1e-5
    outs = {}
    for name, model in (("phi3", hf), ("llama", llama)):
        save_hf_model(model, tmp_path / name)
        save_byte_tokenizer(tmp_path / name)
        r = subprocess.run(["quantize", "--bits", "4", "--group-size", "32", "--method", method, "--calib-samples", "4",
                            "--calib-seq-len", "32", str(tmp_path / name), "-o", str(tmp_path / f"{name}-q")],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        outs[name] = read_all(tmp_path / f"{name}-q")
    phi, lla = outs["phi3"], outs["llama"]
    assert json.loads((tmp_path / "phi3-q" / "config.json").read_text())["architectures"] == ["Phi3ForCausalLM"]
    for layer in range(2):
        p = f"model.layers.{layer}."
        for fused, parts in (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                             ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"))):
            for suffix in ("qweight", "qzeros", "scales"):
                assert torch.equal(phi[f"{p}{fused}.{suffix}"], torch.cat([lla[f"{p}{x}.{suffix}"] for x in parts], 1))
            assert torch.equal(phi[f"{p}{fused}.g_idx"], lla[f"{p}{parts[0]}.g_idx"])
            assert not any(f"{p}{x}." in n for x in parts for n in phi)
    got = [our_logits(load_stage(open_source(tmp_path / f"{n}-q")), ids) for n in ("phi3", "llama")]
    assert torch.equal(got[0], got[1])


@pytest.mark.parametrize("qtype,rope", [("F32", None), ("Q8_0", "longrope")])
def test_a_llama_cpp_phi3_gguf_runs_as_transformers(qtype, rope, tmp_path):
    """llama.cpp's Phi-3: attn_qkv, ffn_up holding gate then up, no q/k permutation, longrope's factors as
    rope_factors_long / rope_factors_short tensors; native blocks split by rows."""
    overrides = dict(original_max_position_embeddings=64, rope_scaling=dict(LONGROPE)) if rope else {}
    hf = make_hf_model(phi3_config(**overrides), seed=9)
    path = write_llama_gguf(hf, tmp_path / "phi3.gguf", qtype)
    source = open_source(path)
    assert source.config.family == "phi3" and "model.layers.0.self_attn.v_proj.weight" in source.names()
    if rope:
        assert source.config.rope_scaling.long_factor == tuple(LONGROPE["long_factor"])
    ours = load_stage(source)
    tolerance = 1e-4 if qtype == "F32" else 0.2  # Q8_0 rounds the weights
    assert logits_diff(ours, hf, 40) < tolerance
    from flotilla.models.gguf_report import load_report

    assert load_report(source, ours)[0].startswith("GGUF phi3.gguf: ") and qtype in load_report(source, ours)[0]
    if qtype != "F32":  # against the same blocks read as fp32 (not native): the split is exact
        plain = load_stage(open_source(path, native_gguf=False))
        ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(4))
        assert (our_logits(ours, ids) - our_logits(plain, ids)).abs().max() < 1e-3


def test_a_dynamic_that_names_the_fused_modules_decides_for_them(tmp_path):
    """GPTQModel and vLLM name a Phi-3's modules qkv_proj and gate_up_proj: a per-module override written so
    applies to the fused linear (and a plain "-:" one keeps it in float), and each fused tensor is read once."""
    from flotilla.models.config import QuantConfig
    from flotilla.models.fused_names import SplitSource

    hf = make_hf_model(phi3_config(num_hidden_layers=2), seed=11)
    save_hf_model(hf, tmp_path / "phi3")
    save_byte_tokenizer(tmp_path / "phi3")
    r = subprocess.run(["quantize", "--bits", "4", "--group-size", "32", "--method", "rtn", str(tmp_path / "phi3"),
                        "-o", str(tmp_path / "q")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    config = ModelConfig.from_hf_dir(tmp_path / "q")
    dynamic = ((r"+:model\.layers\.0\.self_attn\.qkv_proj$", (("bits", 8),)), (r"-:model\.layers\.1\.mlp\.gate_up_proj$", ()))
    quant = dataclasses.replace(config.quant, dynamic=dynamic)
    cfg = config.with_quant(quant)
    assert cfg.linear_quant("model.layers.0.self_attn.", ("q_proj", "k_proj", "v_proj")).bits == 8
    assert cfg.linear_quant("model.layers.1.mlp.", ("gate_proj", "up_proj")) is None
    assert cfg.linear_quant("model.layers.0.mlp.", ("gate_proj", "up_proj")).bits == 4
    assert isinstance(quant, QuantConfig)
    reads = []
    source = open_source(tmp_path / "q")
    assert isinstance(source, SplitSource)
    inner_get = source.inner.get
    source.inner.get = lambda name: reads.append(name) or inner_get(name)
    load_stage(source)
    fused = [n for n in reads if "qkv_proj" in n or "gate_up_proj" in n]
    assert fused and len(fused) == len(set(fused)), sorted(fused)


def test_phi3_variants_flotilla_does_not_run_are_refused_by_name(tmp_path):
    d = phi3_config().to_dict()
    with pytest.raises(FlotillaError, match="partial_rotary_factor 0.75"):
        ModelConfig.from_hf_dict({**d, "architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.75})
    bad = {**d, "architectures": ["Phi3ForCausalLM"],
           "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 7}}
    with pytest.raises(FlotillaError, match="differ in length"):
        ModelConfig.from_hf_dict(bad)
    window = ModelConfig.from_hf_dict({**d, "architectures": ["Phi3ForCausalLM"], "sliding_window": 128})
    assert window.sliding_window == 128 and window.layer_window(0) == 128  # every layer's window, as Mistral's
    su = {**d, "architectures": ["Phi3ForCausalLM"], "original_max_position_embeddings": None,
          "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}
    rope = ModelConfig.from_hf_dict(su).rope_scaling
    assert rope.rope_type == "longrope" and rope.original_max_position_embeddings == 4096  # Phi3Config's default
    llama = tiny_config("llama").to_dict()
    with pytest.raises(FlotillaError, match="rope scaling type 'yarn' is not supported"):  # no alias outside Phi-3
        ModelConfig.from_hf_dict({**llama, "architectures": ["LlamaForCausalLM"],
                                  "rope_scaling": {"type": "yarn", "factor": 4.0}})


def test_the_engine_runs_a_phi3_of_head_dim_96_greedy_as_transformers(tmp_path):
    """Phi-3-mini's heads are 96 wide (3072 / 32), not a power of two: the engine's paged path (prefill, decode,
    rope, the CPU kernels) gives transformers' greedy tokens."""
    from flotilla.runtime.engine_args import EngineArgs, build_engine
    from flotilla.runtime.loader import load_model
    from flotilla.runtime.sampling import SamplingParams

    hf = make_hf_model(phi3_config(hidden_size=192, num_attention_heads=2, num_key_value_heads=2,
                                   intermediate_size=256), seed=1)
    save_hf_model(hf, tmp_path / "p")
    save_byte_tokenizer(tmp_path / "p")
    engine = build_engine(load_model(tmp_path / "p", "cpu", "float32", progress=False), EngineArgs())
    prompt = list(range(10, 30))
    engine.add_request("a", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    got = []
    while engine.has_unfinished():
        for out in engine.step():
            got += list(out.new_token_ids)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    assert got == ids[len(prompt):]
