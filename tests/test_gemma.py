"""Gemma 3's text model (Gemma3ForCausalLM, llama.cpp's gemma3 GGUF) against transformers: norms of 1 + weight, a
norm after attention and after the MLP, gelu-tanh, the embedding times sqrt(hidden), q/k norms, the attention
scale of query_pre_attn_scalar, sliding-window layers with their own rope base and every sixth layer global with
the model's (linearly scaled) rope; and Gemma 2 (Gemma2ForCausalLM, llama.cpp's gemma2 GGUF): the same layer without
q/k norms, one rope, every second layer global, its attention scores and logits soft-capped."""
from __future__ import annotations

import pytest
import torch

from flotilla.errors import FlotillaError
from flotilla.models.config import ModelConfig
from flotilla.models.sources import open_source
from flotilla.models.weights import load_stage

from conftest import make_hf_model, save_byte_tokenizer, save_hf_model, write_llama_gguf
from test_models import our_logits


def gemma3_config(**overrides):
    from transformers import Gemma3TextConfig

    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=256, sliding_window=8,
                query_pre_attn_scalar=24, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    base.update(overrides)
    return Gemma3TextConfig(**base)


def test_gemma3_logits_match_transformers(tmp_path):
    hf = make_hf_model(gemma3_config(), seed=7)
    source = open_source(save_hf_model(hf, tmp_path / "g"))
    cfg = source.config
    assert cfg.family == "gemma3" and cfg.max_model_len == 256
    assert [cfg.layer_window(i) for i in range(7)] == [8, 8, 8, 8, 8, 0, 8]  # the sixth layer is global
    assert [cfg.layer_rope_local(i) for i in range(7)] == [True] * 5 + [False, True]
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    got = our_logits(load_stage(source), ids)
    assert (got - ref).abs().max().item() < 1e-4


def test_gemma3_config_round_trips_and_transformers_reads_it_back():
    from transformers import Gemma3TextConfig

    cfg = ModelConfig.from_hf_dict(gemma3_config().to_dict())
    d = cfg.to_hf_dict()
    assert d["model_type"] == "gemma3_text" and d["architectures"] == ["Gemma3ForCausalLM"]
    assert ModelConfig.from_hf_dict(d) == cfg
    back = Gemma3TextConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    assert back.layer_types == list(cfg.layer_types) and back.sliding_window == 8
    assert back.query_pre_attn_scalar == 24
    assert back.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    full = back.rope_parameters["full_attention"]
    assert (full["rope_theta"], full["rope_type"], full["factor"]) == (1e6, "linear", 8.0)


def test_a_transformers_4_gemma3_config_is_read():
    """google/gemma-3-1b-it's config.json as transformers 4 wrote it: the pattern, the local base, no rope_parameters."""
    d = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
         "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
         "head_dim": 256, "vocab_size": 262144, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
         "rope_theta": 1000000, "rope_local_base_freq": 10000, "rope_scaling": None, "sliding_window": 512,
         "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
         "final_logit_softcapping": None, "attn_logit_softcapping": None, "eos_token_id": [1, 106],
         "bos_token_id": 2, "torch_dtype": "bfloat16"}
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.rope_theta == 1e6 and cfg.rope_local_theta == 10000.0 and cfg.rope_scaling is None
    assert [i for i in range(26) if cfg.layer_window(i) == 0] == [5, 11, 17, 23]
    assert cfg.eos_token_ids == (1, 106) and cfg.head_dim == 256 and cfg.embed_scale == 1152 ** 0.5


@pytest.mark.parametrize("change, message", [
    ({"final_logit_softcapping": -1.0}, "final_logit_softcapping must be a positive number or null, got -1.0"),
    ({"attn_logit_softcapping": "50"}, "attn_logit_softcapping must be a positive number or null, got '50'"),
    ({"use_bidirectional_attention": True}, "an embedding model"),
    ({"hidden_activation": "relu"}, "hidden_activation 'relu' is not supported"),
])
def test_what_gemma3_support_lacks_is_refused(change, message):
    d = {**gemma3_config().to_dict(), "architectures": ["Gemma3ForCausalLM"], **change}
    with pytest.raises(FlotillaError, match=message):
        ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_a_gemma3_gguf_matches_transformers(tmp_path, qtype):
    """As llama.cpp writes the file: norms stored as 1 + w, the post-attention / pre- and post-MLP norms under
    its names, no q/k permutation, the pattern and the local base left to llama.cpp's defaults."""
    hf = make_hf_model(gemma3_config(num_hidden_layers=6, query_pre_attn_scalar=32), seed=2)
    path = write_llama_gguf(hf, tmp_path / "g.gguf", qtype)
    source = open_source(path)
    cfg = source.config
    assert cfg.family == "gemma3" and cfg.sliding_window == 8 and cfg.query_pre_attn_scalar == 32
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0 and cfg.rope_local_theta == 10000.0
    assert cfg.tie_word_embeddings
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
    got = our_logits(load_stage(source), ids)
    if qtype == "F32":
        assert (got - ref).abs().max().item() < 1e-4
    else:  # the native Q8_0 blocks against the same blocks read as fp32
        plain = our_logits(load_stage(open_source(path, native_gguf=False)), ids)
        assert (got - plain).abs().max().item() < 1e-3
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
@pytest.mark.parametrize("kernels", ["compiled", "torch"])
def test_the_engine_decodes_a_gemma_as_transformers(kernels, family, tmp_path, monkeypatch):
    """Two requests at once through the paged cache, past the window, one after the other's prefix is cached
    (Gemma 2: its capped scores in the compiled decode and in the hand-computed torch attention)."""
    from flotilla.kernels.cpu import ops
    from flotilla.runtime.engine_args import EngineArgs, build_engine
    from flotilla.runtime.loader import load_model
    from test_sliding_window import greedy_rounds, transformers_greedy

    if kernels == "torch":
        monkeypatch.setenv("FLOTILLA_KERNEL", "dense")
    ops.reset()
    hf = make_hf_model(gemma3_config() if family == "gemma3" else gemma2_config(), seed=9)
    save_hf_model(hf, tmp_path / "g")
    save_byte_tokenizer(tmp_path / "g")
    engine = build_engine(load_model(tmp_path / "g", "cpu", "float32", progress=False),
                          EngineArgs(block_size=4, max_num_batched_tokens=16))
    prompts = {"a": list(range(30, 52)), "b": list(range(90, 101)), "c": list(range(30, 52)) + [5]}
    got = greedy_rounds(engine, prompts, [["a", "b"], ["c"]], 12)
    ops.reset()
    for name, prompt in prompts.items():
        assert got[name] == transformers_greedy(hf, prompt, 12), name


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_a_quantized_gemma3_runs_as_its_float_model(method, tmp_path):
    """`quantize` on a Gemma 3 directory: calibration runs its layers (norms of the outputs, gelu), AWQ folds its
    scales into norms of 1 + weight, the checkpoint keeps transformers' config and norm weights, and 8-bit
    weights give the float model's logits within rounding; --rotate is refused, saying why."""
    import subprocess

    from safetensors.torch import load_file

    hf = make_hf_model(gemma3_config(num_hidden_layers=2), seed=4)
    save_hf_model(hf, tmp_path / "g")
    save_byte_tokenizer(tmp_path / "g")
    out = tmp_path / f"g-{method}"
    r = subprocess.run(["quantize", "--bits", "8", "--group-size", "32", "--method", method, "--calib-samples", "4",
                        "--calib-seq-len", "32", str(tmp_path / "g"), "-o", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    import json

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    tensors = {}
    for f in out.glob("*.safetensors"):
        tensors.update(load_file(f))
    if method != "awq":  # as transformers keeps them (w, not 1 + w); AWQ changes the input norms by its scales
        want = hf.model.layers[1].post_feedforward_layernorm.weight
        assert torch.allclose(tensors["model.layers.1.post_feedforward_layernorm.weight"].float(), want, atol=1e-3)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
    got = our_logits(load_stage(open_source(out)), ids)
    assert (got - ref).abs().max().item() < 0.1 * ref.abs().max().item()
    r = subprocess.run(["quantize", "--bits", "4", "--method", "rtn", "--rotate", "hadamard", str(tmp_path / "g"),
                        "-o", str(tmp_path / "rot")], capture_output=True, text=True)
    assert r.returncode != 0 and "Gemma 2 and 3 norm the attention's and the MLP's outputs" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "rot").exists()


def test_the_text_model_of_an_image_text_gemma3_checkpoint_runs(tmp_path):
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration: its text_config (keys left out take transformers'
    defaults) and the language model's tensors; the vision tower and projector are not read."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = gemma3_config(num_hidden_layers=2)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    torch.manual_seed(0)
    from flotilla.runtime.random_model import randomize

    mm = randomize(Gemma3ForConditionalGeneration(Gemma3Config(text_config=text.to_dict(),
                                                               vision_config=vision.to_dict(), mm_tokens_per_image=4,
                                                               image_token_index=255)).eval())
    mm.save_pretrained(tmp_path / "mm")
    source = open_source(tmp_path / "mm")
    assert source.config.architecture == "Gemma3ForCausalLM" and source.config.extra["multimodal"]
    assert not any("vision" in n or "projector" in n for n in source.names())
    ids = torch.randint(0, 250, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = mm(input_ids=ids).logits
    got = our_logits(load_stage(source), ids)
    assert (got - ref).abs().max().item() < 1e-4


def test_gemma3_calibration_states_and_dtype_are_the_models(tmp_path):
    """quantize's calibration enters layer 0 with the model's own embedding (times sqrt(hidden)); a GPU runs
    Gemma 3 in bf16 unless told otherwise (its activations pass fp16's range); an image-text config's outer end
    tokens win over its text_config's."""
    from flotilla.quantize.pipeline import _activations
    from flotilla.runtime.loader import default_dtype

    hf = make_hf_model(gemma3_config(num_hidden_layers=1), seed=3)
    source = open_source(save_hf_model(hf, tmp_path / "g"))
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    acts = _activations(source, tokens, source.config, torch.device("cpu"))
    with torch.no_grad():
        assert torch.allclose(acts.hidden, hf.model.embed_tokens(tokens).float())
    assert default_dtype(torch.device("cuda", 0), source.config) == torch.bfloat16
    assert default_dtype(torch.device("cuda", 0), ModelConfig.from_hf_dict(
        {**gemma3_config().to_dict(), "architectures": ["LlamaForCausalLM"], "model_type": "llama"})) == torch.float16
    assert default_dtype(torch.device("cpu"), source.config) == torch.float32
    outer = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
             "text_config": {**gemma3_config().to_dict(), "eos_token_id": 1}}
    assert ModelConfig.from_hf_dict(outer).eos_token_ids == (1, 106)


# ------------------------------------------------------------------------------------------------ Gemma 2
def gemma2_config(**overrides):
    from transformers import Gemma2Config

    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=256, sliding_window=8,
                query_pre_attn_scalar=24, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                attn_logit_softcapping=3.0, final_logit_softcapping=4.0)  # small caps: the tanh bites
    base.update(overrides)
    return Gemma2Config(**base)


def test_gemma2_logits_match_transformers(tmp_path):
    """Gemma 2: Gemma 3's layer without q/k norms and with one rope, every second layer global, the attention
    scores and the logits soft-capped."""
    hf = make_hf_model(gemma2_config(), seed=8)
    source = open_source(save_hf_model(hf, tmp_path / "g2"))
    cfg = source.config
    assert cfg.family == "gemma2" and (cfg.attn_softcap, cfg.final_softcap) == (3.0, 4.0)
    assert [cfg.layer_window(i) for i in range(4)] == [8, 0, 8, 0] and cfg.rope_local_theta is None
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    got = our_logits(load_stage(source), ids)
    assert got.abs().max().item() <= 4.0 and (got - ref).abs().max().item() < 1e-4


def test_a_gemma2_gguf_matches_transformers(tmp_path):
    hf = make_hf_model(gemma2_config(query_pre_attn_scalar=32), seed=6)
    source = open_source(write_llama_gguf(hf, tmp_path / "g2.gguf"))
    assert source.config.family == "gemma2" and source.config.attn_softcap == 3.0
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
    assert (our_logits(load_stage(source), ids) - ref).abs().max().item() < 1e-4


def test_gemma2_soft_caps_null_and_absent():
    """A config.json's null cap is no cap (as transformers reads it), a left-out one Gemma2Config's default; a GGUF
    file written before llama.cpp stored the caps takes llama.cpp's 50 / 30 (and its window, 4096)."""
    d = {**gemma2_config().to_dict(), "architectures": ["Gemma2ForCausalLM"]}
    none = ModelConfig.from_hf_dict({**d, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert (none.attn_softcap, none.final_softcap) == (None, None)
    assert ModelConfig.from_hf_dict(none.to_hf_dict()) == none
    absent = {k: v for k, v in d.items() if not k.endswith("_softcapping")}
    assert (ModelConfig.from_hf_dict(absent).attn_softcap, ModelConfig.from_hf_dict(absent).final_softcap) == (50.0, 30.0)


def test_an_old_gemma2_gguf_takes_llama_cpps_caps(tmp_path):
    hf = make_hf_model(gemma2_config(attn_logit_softcapping=None, final_logit_softcapping=None), seed=1)
    cfg = open_source(write_llama_gguf(hf, tmp_path / "old.gguf")).config
    assert (cfg.attn_softcap, cfg.final_softcap) == (50.0, 30.0)
