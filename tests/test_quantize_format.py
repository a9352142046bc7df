"""What `quantize` writes: bit-exact round trips through the files, an independent GPTQ decoder,
and the checkpoint's layout (names, config, manifest, index, shards on layer boundaries)."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from flotilla.kernels.gptq import GPTQWeight
from flotilla.kernels.reference import dequantize
from flotilla.models.attention import DenseCausalAttention
from flotilla.models.linear import Linear, QuantLinear
from flotilla.models.sources import open_source
from flotilla.models.weights import load_stage
from flotilla.quantize import QuantizeOptions, quantize_model

from quantize_helpers import decode_gptq, read_checkpoint, read_safetensors, tiny_model_dir

CALIB = dict(calib_samples=4, calib_seq_len=32)
MATRIX = list(itertools.product((4, 8), (True, False), (32, 128, -1), (False, True)))


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("src") / "tiny", seed=3)


def quantize_recording(src, out, **options):
    """Quantize, keeping the quantizer's in-memory dequantized weights per checkpoint projection."""
    memory: dict[str, torch.Tensor] = {}

    def on_layer(index, layer, result):
        for name, mod in layer.named_modules():
            if isinstance(mod, Linear):
                parent, leaf = name.rsplit(".", 1)
                projections = getattr(layer.get_submodule(parent), "MERGED", {}).get(leaf, (leaf,))
                w = result.weights[mod].dequantize()  # [out, in] fp32
                for shard, proj in enumerate(projections):
                    memory[f"model.layers.{index}.{parent}.{proj}"] = w[mod.shard_slice(shard)].clone()

    quantize_model(src, out, QuantizeOptions(**options), progress=False, on_layer=on_layer)
    return memory


@pytest.mark.parametrize("bits,sym,group,act_order", MATRIX,
                         ids=[f"int{b}-{'sym' if s else 'asym'}-g{g}-{'act' if a else 'seq'}" for b, s, g, a in MATRIX])
def test_round_trip_is_exact(tiny_src, tmp_path, bits, sym, group, act_order):
    out = tmp_path / "q"
    memory = quantize_recording(tiny_src, out, bits=bits, sym=sym, group_size=group, act_order=act_order, **CALIB)
    source = open_source(out)
    assert source.config.quant.bits == bits and source.config.quant.desc_act == act_order
    assert len(memory) == 2 * 7
    for prefix, expected in memory.items():
        w = GPTQWeight(*(source.get(f"{prefix}.{s}") for s in ("qweight", "qzeros", "scales", "g_idx")), bits, group)
        from_file = dequantize(w).t()  # [out, in]
        assert torch.equal(from_file, expected), prefix
        if act_order and group != -1 and prefix.endswith("down_proj"):
            assert w.has_act_order  # g_idx really carries the permutation
    # the runtime's merged QuantLinears hold the same weights
    model = load_stage(source, keep_source=True)
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            _, _, index, rel = name.split(".", 3)  # model.layers.N.self_attn.qkv_proj
            parent, leaf = rel.rsplit(".", 1)
            merged = getattr(model.model.layers[index].get_submodule(parent), "MERGED", {}).get(leaf, (leaf,))
            expected = torch.cat([memory[f"model.layers.{index}.{parent}.{p}"] for p in merged])
            assert torch.equal(dequantize(mod.gptq_weight()).t(), expected), name


@pytest.mark.parametrize("bits,sym,act_order", [(4, True, True), (4, False, False), (8, False, True)])
def test_independent_decoder_agrees_with_reference(tiny_src, tmp_path, bits, sym, act_order):
    out = tmp_path / "q"
    quantize_model(tiny_src, out, QuantizeOptions(bits=bits, sym=sym, group_size=32, act_order=act_order, **CALIB),
                   progress=False)
    raw = read_checkpoint(out)  # our own parse of the safetensors files
    source = open_source(out)
    prefixes = sorted({n.rsplit(".", 1)[0] for n in raw if n.endswith(".qweight")})
    assert len(prefixes) == 14
    for prefix in prefixes:
        ours = decode_gptq(raw[f"{prefix}.qweight"], raw[f"{prefix}.qzeros"], raw[f"{prefix}.scales"],
                           raw[f"{prefix}.g_idx"], bits)
        w = GPTQWeight(*(source.get(f"{prefix}.{s}") for s in ("qweight", "qzeros", "scales", "g_idx")), bits, 32)
        np.testing.assert_array_equal(ours, dequantize(w).numpy(), err_msg=prefix)


@pytest.fixture(scope="module")
def partial_src(tmp_path_factory):
    """Inputs of 192 and 320: group 128 leaves a last group of 64 in every linear (as SmolLM2's 576)."""
    return tiny_model_dir(tmp_path_factory.mktemp("src") / "partial", seed=5, hidden_size=192, intermediate_size=320)


PARTIAL = [(4, True, False, 128), (4, False, True, 128), (8, False, False, 128), (4, True, True, 256)]


@pytest.mark.parametrize("bits,sym,act_order,group", PARTIAL,
                         ids=[f"int{b}-{'sym' if s else 'asym'}-{'act' if a else 'seq'}-g{g}" for b, s, a, g in PARTIAL])
def test_partial_last_group_round_trips_and_runs(partial_src, tmp_path, monkeypatch, bits, sym, act_order, group):
    out = tmp_path / "q"
    memory = quantize_recording(partial_src, out, bits=bits, sym=sym, group_size=group, act_order=act_order, **CALIB)
    raw = read_checkpoint(out)
    source = open_source(out)
    assert source.config.quant.group_size == group
    for prefix, expected in memory.items():
        t = {s: raw[f"{prefix}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx")}
        n_in = t["g_idx"].shape[0]
        assert t["scales"].shape[0] == -(-n_in // group) and n_in % group  # a partial last group
        assert np.bincount(t["g_idx"]).tolist()[-1] == n_in % group
        decoded = decode_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits)  # independent reader
        np.testing.assert_array_equal(decoded.T, expected.numpy(), err_msg=prefix)
    ids = torch.arange(40) % 250
    positions = torch.arange(40)
    model = load_stage(source)  # the registry's kernel (the compiled CPU one where it builds)
    logits = model.compute_logits(model(ids, positions, DenseCausalAttention(1, 40)))
    monkeypatch.setenv("FLOTILLA_KERNEL", "reference")
    reference = load_stage(open_source(out))
    torch.testing.assert_close(logits, reference.compute_logits(reference(ids, positions, DenseCausalAttention(1, 40))), rtol=1e-4, atol=1e-4)


def test_checkpoint_layout(tiny_src, tmp_path):
    out = tmp_path / "q"
    report = quantize_model(tiny_src, out, QuantizeOptions(shard_size=40_000, **CALIB), progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False, "damp_percent": 0.01,
        "checkpoint_format": "gptq", "true_sequential": True, "lm_head": False, "flotilla_method": "gptq"}
    # AutoGPTQ reads a local directory's quantization from quantize_config.json only
    assert json.loads((out / "quantize_config.json").read_text()) == config["quantization_config"]
    assert config["torch_dtype"] == "float16"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).is_file(), name
    manifest = json.loads((out / "flotilla.json").read_text())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = manifest["shards"]
    assert len(shards) > 1 and report.shards == len(shards)
    # every layer lives in exactly one shard, in order, and the index agrees with the manifest
    layers = [layer for s in shards for layer in s["layers"]]
    assert layers == ["embed", "0", "1", "head"]
    for name, file in index["weight_map"].items():
        key = "embed" if "embed_tokens" in name else "head" if name.startswith(("model.norm", "lm_head")) \
            else name.split(".")[2]
        assert manifest["layer_to_shard"][key] == file, name
    names = set(index["weight_map"])
    assert "model.layers.0.self_attn.q_proj.qweight" in names and "model.layers.1.mlp.up_proj.g_idx" in names
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)  # per-projection names only
    assert not any(n.startswith("lm_head") for n in names) or not config["tie_word_embeddings"]
    raw = read_checkpoint(out)
    assert raw["model.embed_tokens.weight"].dtype == np.float16
    assert raw["model.layers.0.self_attn.q_proj.qweight"].shape == (128 * 4 // 32, 128)
    assert raw["model.layers.0.self_attn.k_proj.qzeros"].shape == (1, 64 * 4 // 32)
    assert report.out_bytes == sum(s["size"] for s in shards)


def test_concat_safetensors_joins_files_without_loading(tmp_path):
    from safetensors.torch import load_file, save_file

    from flotilla.models.safetensors_stream import concat_safetensors

    parts = [{"a.odd": torch.arange(3, dtype=torch.float16), "a.int": torch.arange(6, dtype=torch.int32).view(2, 3)},
             {"b.f32": torch.randn(5), "b.empty": torch.zeros(0, 4, dtype=torch.int32)},
             {"c.bf16": torch.randn(7, dtype=torch.bfloat16)}]
    files = []
    for i, tensors in enumerate(parts):
        files.append(tmp_path / f"p{i}.safetensors")
        save_file(tensors, str(files[-1]))
    names = concat_safetensors(files, tmp_path / "joined.safetensors")
    joined = load_file(str(tmp_path / "joined.safetensors"))  # safetensors validates offsets and sizes
    expected = {k: v for p in parts for k, v in p.items()}
    assert sorted(names) == sorted(expected) and set(joined) == set(expected)
    for name, t in expected.items():
        assert joined[name].dtype == t.dtype and torch.equal(joined[name], t), name
    raw = read_safetensors(tmp_path / "joined.safetensors")
    assert np.array_equal(raw["a.int"], parts[0]["a.int"].numpy())


def test_quant_linear_releases_its_gptq_tensors_once_the_kernel_has_its_own(tmp_path, monkeypatch):
    """prepare() drops the GPTQ tensors where the kernel holds its own form (weights in memory
    once), keeps them for the reference kernel or with keep_source, and counts their bytes either way."""
    from flotilla.kernels import registry
    from flotilla.runtime.pipeline.probe import _bytes

    src = tiny_model_dir(tmp_path / "src", seed=4, tokenizer=False)
    out = tmp_path / "q"
    quantize_model(src, out, QuantizeOptions(method="rtn", bits=4, group_size=32), progress=False)
    kept = load_stage(open_source(out), keep_source=True)
    released = load_stage(open_source(out))
    x = torch.randn(3, kept.config.hidden_size)
    for name, mod in kept.named_modules():
        if not isinstance(mod, QuantLinear):
            continue
        rel = released.get_submodule(name)
        assert rel.released_bytes > 0 and rel.qweight.numel() == 0 and rel.scales.numel() == 0
        assert mod.released_bytes == 0 and mod.qweight.numel() > 0
        assert rel.weight_bytes() == mod.weight_bytes()
        if mod.in_features == kept.config.hidden_size:
            assert torch.equal(rel(x), mod(x))  # the kernel's own form serves
        with pytest.raises(RuntimeError, match="keep_source"):
            rel.gptq_weight()
        rel.prepare(torch.float32)  # the same dtype: nothing to do
        with pytest.raises(RuntimeError, match="load the model again"):
            rel.prepare(torch.float16)
    assert _bytes(released.model.layers["0"]) == _bytes(kept.model.layers["0"])
    monkeypatch.setenv(registry.ENV_KERNEL, "reference")
    ref = load_stage(open_source(out))
    assert all(m.released_bytes == 0 and m.qweight.numel() > 0 for m in ref.modules() if isinstance(m, QuantLinear))


def test_a_group_size_that_leaves_a_short_group_is_noted():
    """SmolLM2's shape (576 wide) at the default 128: a note names the inputs and what divides them all."""
    from types import SimpleNamespace

    from flotilla.quantize.pipeline import _partial_group_note

    smol = SimpleNamespace(hidden_size=576, q_size=576, intermediate_size=1536)
    assert _partial_group_note(smol, 128) == (
        "note: group size 128 leaves a short last group on the 576-wide inputs; flotilla and transformers run "
        "it, vLLM refuses it (--group-size 64 divides every input)")
    assert _partial_group_note(smol, 64) is None and _partial_group_note(smol, -1) is None
    odd = SimpleNamespace(hidden_size=600, q_size=600, intermediate_size=1600)
    assert "--group-size -1 (per channel) loads there" in _partial_group_note(odd, 128)


def test_a_qwen3_model_quantizes_with_its_q_and_k_norms(tmp_path):
    """GPTQ INT8 of a tiny Qwen3 (q/k norms, head_dim apart from hidden / heads): the checkpoint keeps the
    norms in fp16 beside the GPTQ tensors, its config reads back as Qwen3 (transformers too), and its logits
    stay near the float model's."""
    from transformers import AutoConfig

    from conftest import make_hf_model, save_hf_model, tiny_config
    from quantize_helpers import byte_tokenizer

    hf = make_hf_model(tiny_config("qwen3", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=320,
                                   tie_word_embeddings=True), seed=5)
    src = save_hf_model(hf, tmp_path / "qwen3")
    byte_tokenizer(src)
    out = tmp_path / "qwen3-int8"
    quantize_model(src, out, QuantizeOptions(bits=8, group_size=128, **CALIB), progress=False)
    tensors = read_checkpoint(out)
    assert tensors["model.layers.1.self_attn.q_norm.weight"].dtype == np.float16
    assert "model.layers.1.self_attn.k_norm.weight" in tensors and "model.layers.1.self_attn.q_proj.qweight" in tensors
    assert AutoConfig.from_pretrained(out).model_type == "qwen3"
    source = open_source(out)
    assert source.config.qk_norm and source.config.head_dim == 64
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        model = load_stage(source)
        got = model.compute_logits(model(ids.flatten(), torch.arange(24).repeat(2), DenseCausalAttention(2, 24)))
    assert (got.view_as(ref) - ref).abs().max().item() < 0.05 * ref.abs().max().item()


@pytest.mark.parametrize("tensor, said", [("model.norm.weight", "'model.norm.weight' holds NaN"),
                                          ("model.layers.1.mlp.up_proj.weight", "layer 1's mlp.gate_up_proj.weight")])
def test_a_source_with_nan_weights_is_refused_and_leaves_nothing(tiny_src, tmp_path, tensor, said):
    """A corrupt source (bytes flipped into NaNs) is named, not quantized into a checkpoint that generates
    nothing (an audit's finding)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from flotilla.errors import FlotillaError

    bad = tmp_path / "bad"
    shutil.copytree(tiny_src, bad)
    (shard,) = bad.glob("*.safetensors")
    tensors = load_file(str(shard))
    tensors[tensor][..., :3] = float("nan")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(FlotillaError, match=said):
        quantize_model(bad, tmp_path / "out", QuantizeOptions(method="rtn"), progress=False)
    assert not (tmp_path / "out").exists()
