"""Community checkpoints into flotilla's kernels: bitsandbytes 4-bit (NF4 nested, FP4) and 8-bit files
written by transformers + bitsandbytes themselves, against that library's own forward; AutoAWQ's
GEMM layout by a writer following its description, against the writer's decode."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from flotilla.errors import FlotillaError
from flotilla.kernels.reference import dequantize
from flotilla.models.attention import DenseCausalAttention
from flotilla.models.linear import Linear, QuantLinear
from flotilla.models.sources import open_source
from flotilla.models.weights import load_stage

from conftest import make_hf_model, save_hf_model, tiny_config

T = 48


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model(tiny_config("llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2), seed=5)


@pytest.fixture(scope="module")
def src(hf_model, tmp_path_factory):
    return save_hf_model(hf_model, tmp_path_factory.mktemp("src") / "fp32")


def ids() -> torch.Tensor:
    return torch.arange(T) * 7 % 256


def flotilla_logits(path) -> tuple[torch.Tensor, torch.nn.Module]:
    model = load_stage(open_source(path), keep_source=True)  # the tests read the GPTQ tensors back
    with torch.no_grad():
        return model.compute_logits(model(ids(), torch.arange(T), DenseCausalAttention(1, T))), model


# ------------------------------------------------------------------------------------------ bitsandbytes

BNB = {
    "nf4-nested": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "int8-skip-down": dict(load_in_8bit=True, llm_int8_skip_modules=["lm_head", "down_proj"]),
}


@pytest.mark.parametrize("kind", sorted(BNB))
def test_bitsandbytes_checkpoint_matches_bitsandbytes(kind, hf_model, src, tmp_path):
    """Logits of the model whose weights are bitsandbytes' own dequantization of the file's, within 8%
    of how far that model's logits are from the float model's (measured: 5% for NF4 and FP4, 3% for
    8-bit): 4-bit levels land on an INT8 grid, each weight within 0.0035 x its block's absmax
    (bnb_layout.py); 8-bit weights only round their scale to fp16. (bitsandbytes' forward is no
    oracle: its 8-bit matmul quantizes the activations too.)"""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(bnb_4bit_compute_dtype=torch.float32, **BNB[kind])
    bnb = AutoModelForCausalLM.from_pretrained(str(src), quantization_config=config, device_map="cpu",
                                               dtype=torch.float32)
    bnb.save_pretrained(str(tmp_path / kind))
    assert json.loads((tmp_path / kind / "config.json").read_text())["quantization_config"]["quant_method"] == \
        "bitsandbytes"
    oracle = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, mod in bnb.named_modules():
            if hasattr(getattr(mod, "weight", None), "quant_state") or hasattr(getattr(mod, "weight", None), "SCB"):
                oracle.get_submodule(name).weight.copy_(_bnb_dequantized(mod))
        want = oracle(ids()[None]).logits[0]
        fp32 = hf_model(ids()[None]).logits[0]
    got, model = flotilla_logits(tmp_path / kind)
    assert float((got - want).abs().max()) < 0.08 * float((fp32 - want).abs().max())
    assert float((got - want).pow(2).mean()) < 0.08**2 * float((fp32 - want).pow(2).mean())

    layer = model.model.layers["1"]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and layer.self_attn.qkv_proj.bits == 8
    if kind == "int8-skip-down":
        assert type(layer.mlp.down_proj) is Linear  # stored in float by the library: a plain linear here
        torch.testing.assert_close(layer.mlp.down_proj.weight, oracle.model.layers[1].mlp.down_proj.weight)
    want_w = oracle.model.layers[1].mlp.up_proj.weight
    ours = dequantize(layer.mlp.gate_up_proj.gptq_weight()).t()[256:]  # the up_proj half
    blocks = want_w.abs().reshape(-1, 64).amax(dim=1, keepdim=True)
    assert torch.all((ours - want_w).reshape(-1, 64).abs() <= 0.0035 * blocks)


def _bnb_dequantized(module) -> torch.Tensor:
    """bitsandbytes' own dequantization of a Linear4bit / Linear8bitLt weight."""
    import bitsandbytes.functional as F

    w = module.weight
    if hasattr(w, "quant_state"):
        return F.dequantize_4bit(w.data, w.quant_state).float()
    return F.int8_vectorwise_dequant(w.data, w.SCB).float()


# ------------------------------------------------------------------------------------------------ AWQ

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's WQLinear_GEMM: nibble k of a word holds column 8j + order[k]
GROUP = 64


def awq_pack(codes: torch.Tensor) -> torch.Tensor:
    """int codes [rows, cols] (0..15) -> int32 [rows, cols / 8], packed along the columns in AWQ's order."""
    words = torch.zeros(codes.shape[0], codes.shape[1] // 8, dtype=torch.int64)
    for k, col in enumerate(AWQ_ORDER):
        words |= codes[:, col::8].to(torch.int64) << (4 * k)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def awq_quantize(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """AutoAWQ's zero-point quantization of w [out, in] at GROUP, as its GEMM tensors, and their decode
    (q - zero) * scale [out, in]. (Written from AutoAWQ's description; its own from_linear packs the
    same codes into the same words, bit for bit, checked once with AutoAWQ 0.2.9.)"""
    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // GROUP, GROUP)
    scales = ((g.amax(2) - g.amin(2)).clamp(min=1e-5) / 15).half()  # [out, groups]
    zeros = (-torch.round(g.amin(2) / scales.float())).clamp(0, 15)
    q = (torch.round(g / scales.float()[..., None]) + zeros[..., None]).clamp(0, 15)  # [out, groups, GROUP]
    decoded = ((q - zeros[..., None]) * scales.float()[..., None]).reshape(out_f, in_f)
    tensors = {"qweight": awq_pack(q.reshape(out_f, in_f).t().int()), "qzeros": awq_pack(zeros.t().int()),
               "scales": scales.t().contiguous()}
    return tensors, decoded


def test_awq_checkpoint_decodes_exactly(hf_model, tmp_path):
    from safetensors.torch import save_file

    decoded_model = copy.deepcopy(hf_model)
    tensors = {}
    with torch.no_grad():
        down = decoded_model.model.layers[0].mlp.down_proj.weight
        down[3, :GROUP] = down[3, :GROUP].abs()  # an all-positive group: zero point 0, which the gptq format cannot store
        for name, p in decoded_model.named_parameters():
            prefix = name.removesuffix(".weight")
            if name.endswith("_proj.weight") and "layers.1.self_attn.o_proj" not in name:  # o_proj 1 left in fp16
                awq, p_decoded = awq_quantize(p)
                tensors.update({f"{prefix}.{k}": v for k, v in awq.items()})
                p.copy_(p_decoded)
            else:
                tensors[name] = p.half()
                p.copy_(p.half().float())
        want = decoded_model(ids()[None]).logits[0]
    decoded_model.config.save_pretrained(str(tmp_path / "awq"))
    config = json.loads((tmp_path / "awq" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                     "version": "gemm", "modules_to_not_convert": ["layers.1.self_attn.o_proj"]}
    (tmp_path / "awq" / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "awq" / "model.safetensors"), metadata={"format": "pt"})
    assert int(tensors["model.layers.0.mlp.down_proj.qzeros"][0, 0]) >> 20 & 15 == 0  # column 3: nibble 5 of word 0

    got, model = flotilla_logits(tmp_path / "awq")
    torch.testing.assert_close(got, want, rtol=0, atol=2e-4)
    layers = model.model.layers
    assert type(layers["1"].self_attn.o_proj) is Linear and layers["1"].self_attn.qkv_proj.bits == 4
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            i, part = name.split(".")[2], name.split(".")[-1]
            merged = {"qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")), "o_proj": ("self_attn", ("o_proj",)),
                      "gate_up_proj": ("mlp", ("gate_proj", "up_proj")), "down_proj": ("mlp", ("down_proj",))}[part]
            parent = getattr(decoded_model.model.layers[int(i)], merged[0])
            expected = torch.cat([getattr(parent, p).weight for p in merged[1]])
            assert torch.equal(dequantize(mod.gptq_weight()).t(), expected), name


@pytest.mark.parametrize("key", ["checkpoint_format", "format"])
def test_gptq_v2_checkpoint_reads_zeros_as_stored(src, tmp_path, key):
    """GPTQModel's gptq_v2 format: the same checkpoint with zeros stored without the -1 loads to the same model
    (said as `checkpoint_format`, or as `format`, the key of GPTQModel's early configs)."""
    from safetensors.torch import load_file, save_file

    from flotilla.kernels.gptq import pack_cols, unpack_cols
    from flotilla.quantize import QuantizeOptions, quantize_model

    quantize_model(src, tmp_path / "v1", QuantizeOptions(method="rtn", sym=False, group_size=64), progress=False)
    (tmp_path / "v2").mkdir()
    (shard,) = (tmp_path / "v1").glob("model-*.safetensors")
    tensors = load_file(str(shard))
    for name in [n for n in tensors if n.endswith(".qzeros")]:
        tensors[name] = pack_cols(unpack_cols(tensors[name], 4) + 1, 4)
    save_file(tensors, str(tmp_path / "v2" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "v1" / "config.json").read_text())
    config["quantization_config"].pop("checkpoint_format")
    config["quantization_config"][key] = "gptq_v2"
    (tmp_path / "v2" / "config.json").write_text(json.dumps(config))
    torch.testing.assert_close(flotilla_logits(tmp_path / "v2")[0], flotilla_logits(tmp_path / "v1")[0], rtol=0, atol=0)
    config["quantization_config"].update(checkpoint_format="gptq_v2", format="gptq")  # two answers: refused
    (tmp_path / "v2" / "config.json").write_text(json.dumps(config))
    with pytest.raises(FlotillaError, match="checkpoint_format 'gptq_v2' and format 'gptq'"):
        open_source(tmp_path / "v2")


def test_an_autogptq_checkpoint_with_quantize_config_json_alone_loads(src, tmp_path):
    """AutoGPTQ's older checkpoints say their quantization in quantize_config.json only (config.json has no
    quantization_config), as AutoGPTQ, GPTQModel and vLLM read them: the same model as with it."""
    import shutil

    from flotilla.quantize import QuantizeOptions, quantize_model

    quantize_model(src, tmp_path / "q", QuantizeOptions(method="rtn", group_size=64), progress=False)
    shutil.copytree(tmp_path / "q", tmp_path / "old")
    (tmp_path / "old" / "flotilla.json").unlink()
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    qc = config.pop("quantization_config")
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    legacy = {k: qc[k] for k in ("bits", "group_size", "desc_act", "sym")}  # AutoGPTQ 0.4's keys, no quant_method
    (tmp_path / "old" / "quantize_config.json").write_text(json.dumps({**legacy, "true_sequential": True}))
    torch.testing.assert_close(flotilla_logits(tmp_path / "old")[0], flotilla_logits(tmp_path / "q")[0], rtol=0, atol=0)


def test_a_gptq_config_says_what_it_holds_and_refuses_other_word_widths():
    from flotilla.models.config import QuantConfig

    base = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    assert QuantConfig.from_hf({**base, "desc_act": True, "sym": False}).describe() == "GPTQ INT4 g128 act-order asym"
    assert QuantConfig.from_hf({**base, "pack_dtype": "torch.int32"}).describe() == "GPTQ INT4 g128"
    with pytest.raises(FlotillaError, match="pack_dtype is 'int16'; flotilla reads int32-packed"):
        QuantConfig.from_hf({**base, "pack_dtype": "int16"})
    with pytest.raises(FlotillaError, match="checkpoint_format 'marlin' is not supported .expected gptq or gptq_v2"):
        QuantConfig.from_hf({**base, "checkpoint_format": "marlin"})
    with pytest.raises(FlotillaError, match=r"quantization_config\.format 'marlin' is not supported"):
        QuantConfig.from_hf({**base, "format": "marlin"})
    with pytest.raises(FlotillaError, match="is_marlin_format is set: AutoGPTQ's Marlin layout is not supported"):
        QuantConfig.from_hf({**base, "is_marlin_format": True})
