"""A quantized lm_head (quantization_config `lm_head: true`, GPTQModel's flag): read from the config,
loaded from `lm_head.qweight/...`, run by the registry's kernel, equal to its dequantized weight."""
import json

import pytest
import torch
from safetensors import safe_open
from conftest import needs_gpu

from flotilla.errors import FlotillaError
from flotilla.kernels.reference import dequantize
from flotilla.models.config import QuantConfig
from flotilla.models.linear import LMHead, QuantLMHead
from flotilla.runtime.loader import load_model
from flotilla.runtime.random_model import shape_config, write_random_checkpoint


@pytest.mark.parametrize("head_bits", [8, 4])
def test_quantized_head_loads_and_matches_its_dequantized_weight(tmp_path, head_bits):
    ckpt = write_random_checkpoint("tiny", tmp_path / "m", 4, 128, seed=3, device="cpu", num_layers=2,
                                   head_bits=head_bits)
    qc = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert qc["lm_head"] is True and qc["bits"] == 4
    names = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.qweight" in names and "lm_head.weight" not in names

    lm = load_model(ckpt, device="cpu", dtype="float32", with_tokenizer=False, progress=False, keep_source=True)
    head = lm.model.lm_head
    assert isinstance(head, QuantLMHead) and head.bits == head_bits
    with safe_open(str(ckpt / names["lm_head.qweight"]), "pt") as f:  # the loader put the file's tensors in
        for suffix in ("qweight", "qzeros", "scales", "g_idx"):
            assert torch.equal(getattr(head, suffix), f.get_tensor(f"lm_head.{suffix}").to(getattr(head, suffix).dtype))
    hidden = torch.randn(5, lm.config.hidden_size)
    want = hidden @ dequantize(head.gptq_weight())  # dequantize gives [in, out]
    torch.testing.assert_close(lm.model.compute_logits(hidden), want, rtol=1e-4, atol=1e-4)
    # and the whole model runs to logits through it
    ids = torch.tensor([1, 2, 3])
    assert lm.model.embed(ids).shape == (3, lm.config.hidden_size)


def test_fp16_head_stays_a_plain_linear(tmp_path):
    ckpt = write_random_checkpoint("tiny", tmp_path / "m", 4, 128, seed=3, device="cpu", num_layers=1)
    lm = load_model(ckpt, device="cpu", dtype="float32", with_tokenizer=False, progress=False)
    assert isinstance(lm.model.lm_head, LMHead)
    assert json.loads((ckpt / "config.json").read_text())["quantization_config"]["lm_head"] is False


def test_head_config_from_dynamic_and_round_trip():
    q = QuantConfig.from_hf({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True,
                             "dynamic": {r"+:^lm_head$": {"bits": 8}}})
    assert q.lm_head and q.head_quant().bits == 8 and q.for_module(["model.layers.0.mlp.down_proj"]).bits == 4
    assert QuantConfig.from_hf(q.to_hf()) == q
    assert QuantConfig.from_hf({"quant_method": "gptq", "bits": 4, "group_size": 128}).head_quant() is None
    # a `-:` pattern that names the head leaves it in fp16 even with the flag
    q2 = QuantConfig.from_hf({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True,
                              "dynamic": {"-:lm_head": {}}})
    assert q2.head_quant() is None


def test_head_bits_need_a_quantized_model():
    with pytest.raises(FlotillaError, match="head-bits"):
        shape_config("tiny", 16, head_bits=8)
    with pytest.raises(FlotillaError, match="head-bits"):
        shape_config("tiny", 4, head_bits=6)


def test_engine_with_a_quantized_head_equals_its_dequantized_head(tmp_path):
    """Greedy tokens through the engine (paged KV, the runner's logits path) with the int8 head
    equal those of the same model whose head is the plain fp32 linear of the dequantized weight."""
    from torch import nn

    from flotilla.runtime.engine_args import EngineArgs, build_engine, generate
    from flotilla.runtime.sampling import SamplingParams

    ckpt = write_random_checkpoint("tiny", tmp_path / "m", 4, 128, seed=5, device="cpu", num_layers=2, head_bits=8)
    prompts = [[1, 5, 9, 13], [2, 4, 6, 8, 10, 12]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    args = EngineArgs(kv_cache_memory="8MiB", max_num_seqs=4, max_model_len=128)
    lm = load_model(ckpt, device="cpu", dtype="float32", with_tokenizer=False, progress=False)
    got = generate(build_engine(lm, args), prompts, params)

    oracle = load_model(ckpt, device="cpu", dtype="float32", with_tokenizer=False, progress=False,
                        keep_source=True)
    plain = LMHead(oracle.config.hidden_size, oracle.config.vocab_size)
    plain.weight = nn.Parameter(dequantize(oracle.model.lm_head.gptq_weight()).T.contiguous(), requires_grad=False)
    oracle.model.lm_head = plain
    assert got == generate(build_engine(oracle, args), prompts, params)


def test_quantize_lm_head_bits_writes_a_head_the_runtime_reads(tmp_path):
    """quantize --lm-head-bits: a tied source's head becomes its own quantized tensor (GPTQModel's
    layout and flag); the body is unchanged; the logits stay close to the fp16-head checkpoint's."""
    from quantize_helpers import quantize_cli, tiny_model_dir

    from flotilla.models.sources import open_source
    from flotilla.models.weights import EMBED, load_stage
    from flotilla.quantize import QuantizeOptions, quantize_model

    src = tiny_model_dir(tmp_path / "src", seed=4, tie_word_embeddings=True)
    plain = quantize_model(src, tmp_path / "plain", QuantizeOptions(method="rtn"), progress=False).out
    headed = quantize_model(src, tmp_path / "h8", QuantizeOptions(method="rtn", lm_head_bits=8), progress=False).out
    cfg = json.loads((headed / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    assert cfg["quantization_config"]["lm_head"] is True
    assert list(cfg["quantization_config"]["dynamic"]) == [r"+:^lm_head$"]

    a, b = (load_stage(open_source(p), dtype=torch.float32, keep_source=True) for p in (plain, headed))
    assert isinstance(b.lm_head, QuantLMHead) and b.lm_head.bits == 8 and isinstance(a.lm_head, LMHead)
    for name in ("qweight", "scales"):  # the body is what it was
        assert torch.equal(getattr(a.model.layers["0"].self_attn.qkv_proj, name),
                           getattr(b.model.layers["0"].self_attn.qkv_proj, name))
    embed = open_source(src).get(EMBED).float()  # the tied head of the source
    head = dequantize(b.lm_head.gptq_weight()).T
    assert (head - embed).abs().max() <= embed.abs().amax(dim=1).max() / 127  # within one 8-bit step
    hidden = torch.randn(4, embed.shape[1])
    ref = a.compute_logits(hidden)
    assert (b.compute_logits(hidden) - ref).abs().max() < 0.02 * ref.abs().max()

    four = quantize_model(src, tmp_path / "h4", QuantizeOptions(method="rtn", lm_head_bits=4), progress=False).out
    q4 = json.loads((four / "config.json").read_text())["quantization_config"]
    assert q4["lm_head"] is True and "dynamic" not in q4
    assert load_stage(open_source(four), dtype=torch.float32).lm_head.bits == 4

    bad = quantize_cli(src, "-o", tmp_path / "bad", "--method", "rtn", "--lm-head-bits", "6")
    assert bad.returncode == 2 and "--lm-head-bits 6" in bad.stderr and "Traceback" not in bad.stderr


def test_rotated_model_with_a_quantized_head(tmp_path):
    """--rotate unties the head; --lm-head-bits then stores the rotated head quantized (and counts it)."""
    from quantize_helpers import tiny_model_dir

    from flotilla.models.sources import open_source
    from flotilla.models.weights import load_stage
    from flotilla.quantize import QuantizeOptions, quantize_model

    src = tiny_model_dir(tmp_path / "src", seed=7, tie_word_embeddings=True)
    opts = dict(bits=8, method="rtn", rotate="hadamard")
    plain = quantize_model(src, tmp_path / "r", QuantizeOptions(**opts), progress=False)
    headed = quantize_model(src, tmp_path / "rh", QuantizeOptions(**opts, lm_head_bits=8), progress=False)
    assert plain.untied_head and headed.untied_head
    assert headed.bits_per_weight < plain.bits_per_weight  # an int8 head in place of the fp16 one
    qc = json.loads((headed.out / "config.json").read_text())["quantization_config"]
    assert qc["lm_head"] is True and qc["flotilla_rotation"]
    a, b = (load_stage(open_source(r.out), dtype=torch.float32) for r in (plain, headed))
    assert isinstance(b.lm_head, QuantLMHead)
    hidden = torch.randn(4, a.config.hidden_size)
    ref = a.compute_logits(hidden)
    assert (b.compute_logits(hidden) - ref).abs().max() < 0.02 * ref.abs().max()


@needs_gpu
@pytest.mark.parametrize("head_bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_quantized_head_on_the_gpu_matches_the_reference(tmp_path, head_bits, rows):
    """The registry's GPU kernel for the head (the GEMV at few rows) against the dequantized weight."""
    ckpt = write_random_checkpoint("tiny", tmp_path / "m", 4, 128, seed=3, device="cpu", num_layers=1,
                                   head_bits=head_bits)
    lm = load_model(ckpt, device="cuda:0", dtype="float16", with_tokenizer=False, progress=False, keep_source=True)
    hidden = torch.randn(rows, lm.config.hidden_size, device="cuda:0", dtype=torch.float16)
    want = hidden.float() @ dequantize(lm.model.lm_head.gptq_weight())
    got = lm.model.compute_logits(hidden)
    assert (got - want).abs().max() <= 2e-3 * want.abs().max() + 1e-3
