"""GGUF models on their own blocks: the default model against its fp32 path, mixed-type files,
and what the load and `quantize` say."""
from __future__ import annotations

import pytest
import torch

from flotilla.models.gguf_linear import GGUFEmbedding, GGUFLinear, GGUFLMHead
from flotilla.models.gguf_report import load_report
from flotilla.models.sources import GGUFSource, open_source
from flotilla.models.weights import load_stage

from conftest import make_hf_model, tiny_config, write_llama_gguf
from ggml_helpers import mixed_gguf
from test_models import our_logits


def test_default_model_native_logits_match_its_fp32_path(smollm2_gguf):
    """Same weights, other arithmetic (flotilla's kernels against MKL on the dequantized file):
    logits within 5e-4 (1.5e-5 of the largest), the same argmax everywhere."""
    native = load_stage(open_source(smollm2_gguf))
    fp32 = load_stage(open_source(smollm2_gguf, native_gguf=False))
    assert isinstance(native.model.layers["0"].mlp.down_proj, GGUFLinear)
    assert isinstance(native.model.embed_tokens, GGUFEmbedding) and isinstance(native.lm_head, GGUFLMHead)
    assert native.lm_head.weight is native.model.embed_tokens.weight  # tied: one table
    ids = torch.randint(0, 49152, (2, 48), generator=torch.Generator().manual_seed(0))
    got, ref = our_logits(native, ids), our_logits(fp32, ids)
    assert (got - ref).abs().max().item() < 5e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    with torch.no_grad():  # the embedding lookup is exact: the rows the file dequantizes to
        assert torch.equal(native.embed(ids[0]), fp32.embed(ids[0]))
    line = load_report(open_source(smollm2_gguf), native)[0]
    assert "Q4_1: 210 tensors -> cpu 4-bit x fp16 scale + min per 32" in line and "Q8_0: 1 tensor -> cpu int8" in line


def test_projections_of_different_types_merge_into_one_linear(tmp_path):
    path = mixed_gguf(tmp_path)
    native = load_stage(GGUFSource(path))
    qkv = native.model.layers["0"].self_attn.qkv_proj
    forms = [qkv.part_form(i) for i in range(3)]
    assert "4-bit" in forms[0] and "int8" in forms[1] and "5-bit" in forms[2] and "min" in forms[2]
    fp32 = load_stage(GGUFSource(path, native=False))
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(2))
    assert (our_logits(native, ids) - our_logits(fp32, ids)).abs().max().item() < 1e-4


def test_dense_and_reference_kernels_run_the_torch_path(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOTILLA_KERNEL", "dense")
    native = load_stage(GGUFSource(mixed_gguf(tmp_path)))
    assert native.model.layers["1"].mlp.gate_up_proj.kernel.name.startswith("torch")


def test_quantize_says_it_requantizes_a_quantized_gguf(tmp_path, capsys):
    from flotilla.quantize import QuantizeOptions, quantize_model

    path = mixed_gguf(tmp_path)
    quantize_model(path, tmp_path / "out", QuantizeOptions(bits=8, method="rtn", group_size=32), progress=False)
    err = capsys.readouterr().err
    assert "mixed.gguf is already quantized (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)" in err and "requantizes" in err


@pytest.mark.parametrize("native", [True, False])
def test_a_gguf_of_unquantized_tensors_loads_either_way(native, tmp_path):
    hf = make_hf_model(tiny_config("llama"), seed=6)
    path = write_llama_gguf(hf, tmp_path / "f16.gguf", "F16")
    model = load_stage(GGUFSource(path, native=native))
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
    assert (our_logits(model, ids) - ref).abs().max().item() < 0.05


def test_a_mixture_of_experts_gguf_is_named_as_such(tmp_path):
    """A Mixtral-style file says "llama" as its architecture: its expert count, not its first expert
    tensor, gives the error."""
    from flotilla.errors import FlotillaError

    hf = make_hf_model(tiny_config("llama"))
    path = write_llama_gguf(hf, tmp_path / "moe.gguf", uint32s={"llama.expert_count": 8})
    with pytest.raises(FlotillaError, match="a mixture-of-experts model \\(8 experts a layer, as Mixtral\\); "
                                            "flotilla runs dense models only"):
        open_source(path)


def test_gguf_sliding_window_is_read_and_a_bad_eos_is_refused(tmp_path):
    """llama.cpp's <arch>.attention.sliding_window is every layer's window, as an HF Mistral's config says;
    an end token id outside the vocabulary is a corrupt file, said at open."""
    from flotilla.errors import FlotillaError

    hf = make_hf_model(tiny_config("llama"))
    cfg = open_source(write_llama_gguf(hf, tmp_path / "w.gguf", uint32s={"llama.attention.sliding_window": 64})).config
    assert cfg.sliding_window == 64 and cfg.max_model_len == cfg.max_position_embeddings == 256
    assert cfg.layer_window(0) == 64
    with pytest.raises(FlotillaError, match="end-of-text token id 99999 is outside"):
        open_source(write_llama_gguf(hf, tmp_path / "e.gguf", uint32s={"tokenizer.ggml.eot_token_id": 99999}))


def test_a_qwen3_gguf_matches_transformers_through_the_engine(tmp_path):
    """A Qwen3 file as llama.cpp writes one (arch qwen3, attn_q_norm / attn_k_norm, q and k not permuted,
    key_length apart from hidden / heads): the dense forward's logits equal transformers'; through the
    engine (paged attention, rope in its kernel) the prompt's logprobs do too; Q8_0 blocks run natively."""
    from flotilla.runtime.engine_args import EngineArgs, build_engine
    from flotilla.runtime.loader import load_model
    from flotilla.runtime.sampling import SamplingParams

    hf = make_hf_model(tiny_config("qwen3", tie_word_embeddings=True, head_dim=32), seed=8)
    path = write_llama_gguf(hf, tmp_path / "qwen3.gguf")
    source = open_source(path)
    assert source.config.family == "qwen3" and source.config.qk_norm and source.config.head_dim == 32
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
    assert (our_logits(load_stage(source), ids) - ref).abs().max().item() < 1e-4
    prompt = ids[0].tolist()
    eng = build_engine(load_model(path, "cpu", "float32", with_tokenizer=False, progress=False),
                       EngineArgs(kv_cache_memory="8MiB", max_num_batched_tokens=16))
    eng.add_request("q", prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    out = []
    while eng.has_unfinished():
        out += eng.step()
    want = torch.log_softmax(ref[0], dim=-1)
    got = [lp for lp, _, _ in out[0].prompt_logprobs[1:]]
    assert max(abs(g - want[p, prompt[p + 1]].item()) for p, g in enumerate(got)) < 1e-4
    q8_path = write_llama_gguf(hf, tmp_path / "q8.gguf", "Q8_0")
    q8 = load_stage(open_source(q8_path))
    assert isinstance(q8.model.layers["0"].self_attn.qkv_proj, GGUFLinear)
    fp32 = load_stage(open_source(q8_path, native_gguf=False))  # the same blocks dequantized: the oracle
    assert (our_logits(q8, ids) - our_logits(fp32, ids)).abs().max().item() < 1e-4
