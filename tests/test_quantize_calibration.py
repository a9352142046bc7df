"""Calibration data (files and model-sampled text), the lockstep KV cache, and eval-ppl."""
from __future__ import annotations

import json
import re

import pytest
import torch

from flotilla.errors import FlotillaError
from flotilla.models.attention import DenseCausalAttention, LockstepKVCache
from flotilla.models.sources import open_source
from flotilla.models.tokenizer import load_tokenizer
from flotilla.models.weights import load_stage
from flotilla.quantize.calibration import generate_tokens, read_texts, tokens_from_file
from flotilla.runtime.cli import main as runtime_main
from flotilla.runtime.eval_ppl import perplexity

from quantize_helpers import BOS, EOS, tiny_model_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("src") / "tiny", seed=21)


def test_lockstep_cache_decoding_equals_a_full_forward(tiny):
    model = load_stage(open_source(tiny))
    cfg = model.config
    B, L, P = 3, 20, 5
    ids = torch.randint(0, 256, (B, L), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids.flatten(), torch.arange(L).repeat(B), DenseCausalAttention(B, L)).view(B, L, -1)
        cache = LockstepKVCache(model.stage.layers, B, L, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
        steps = [model(ids[:, :P].flatten(), torch.arange(P).repeat(B), cache).view(B, P, -1)]
        cache.advance(P)
        for t in range(P, L):
            steps.append(model(ids[:, t], torch.full((B,), t), cache).view(B, 1, -1))
            cache.advance(1)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)


def test_generated_calibration_is_seeded_full_length_and_never_ends(tiny):
    source = open_source(tiny)
    a = generate_tokens(source, 5, 24, seed=1, device=torch.device("cpu"), progress=False)
    b = generate_tokens(source, 5, 24, seed=1, device=torch.device("cpu"), progress=False)
    c = generate_tokens(source, 5, 24, seed=2, device=torch.device("cpu"), progress=False)
    assert a.shape == (5, 24) and torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a[:, 0], torch.full((5,), BOS))
    assert not (a[:, 1:] == EOS).any()
    assert len({tuple(r.tolist()) for r in a}) == 5


def test_calibration_from_text_and_jsonl(tiny, tmp_path):
    tok = load_tokenizer(tiny)
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    windows = tokens_from_file(text, tok, 320, samples=4, seq_len=32, seed=0)
    assert windows.shape == (4, 32)
    assert tok.decode(windows[0].tolist()) in text.read_text()
    jsonl = tmp_path / "calib.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["alpha beta", "", "gamma"])))
    assert read_texts(jsonl) == ["alpha beta", "gamma"]
    short = tokens_from_file(jsonl, tok, 320, samples=8, seq_len=512, seed=0)
    assert short.shape == (1, len("alpha beta") + 1 + len("gamma"))  # one window of all tokens, EOS between
    assert EOS in short[0].tolist()


@pytest.mark.parametrize("content,fragment", [
    ('{"text": "fine"}\n{"txt": "wrong field"}\n', "line 2"),
    ('{"text": "fine"}\nnot json\n', "line 2: not JSON"),
    ("", "holds no text"),
])
def test_bad_calibration_jsonl(tmp_path, content, fragment):
    f = tmp_path / "calib.jsonl"
    f.write_text(content)
    with pytest.raises(FlotillaError, match=re.escape(fragment)):
        read_texts(f)


# ---------------------------------------------------------------------------------------- eval-ppl

def test_perplexity_with_full_context_equals_transformers_loss(tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny_model_dir(tmp_path / "m", seed=22, tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(str(src)).eval()
    ids = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        loss = hf(ids[None], labels=ids[None]).loss
    result = perplexity(load_stage(open_source(src)), ids.tolist(), ctx=64, stride=32)
    assert result.tokens == 59 and result.windows == 1
    assert result.nll == pytest.approx(float(loss), rel=1e-5)


def test_sliding_window_scores_each_token_once_with_its_window_context(tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny_model_dir(tmp_path / "m", seed=23, tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(str(src)).eval()
    ids = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(4))
    total = 0.0
    # windows [0,20) [10,30) [20,40) [30,50): the first scores tokens 1..19, the others their last 10
    for begin, first in ((0, 1), (10, 10), (20, 10), (30, 10)):
        window = ids[begin:begin + 20]
        with torch.no_grad():
            logp = torch.log_softmax(hf(window[None]).logits[0].float(), -1)
        total -= float(logp[first - 1:-1].gather(1, window[first:, None]).sum())
    result = perplexity(load_stage(open_source(src)), ids.tolist(), ctx=20, stride=10)
    assert (result.tokens, result.windows) == (49, 4)
    assert result.nll == pytest.approx(total / 49, rel=1e-5)


def test_eval_ppl_command(tiny, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("flotilla quantizes models. " * 10)
    assert runtime_main(["eval-ppl", str(tiny), "--text", str(text), "--ctx", "64", "--stride", "32"]) == 0
    printed = float(re.search(r"perplexity (\S+)", capsys.readouterr().out).group(1))
    ids = load_tokenizer(tiny).encode(text.read_text())
    expected = perplexity(load_stage(open_source(tiny)), ids, 64, 32).ppl
    assert printed == pytest.approx(expected, rel=1e-4)
    assert runtime_main(["eval-ppl", str(tiny), "--text", str(tmp_path / "missing.txt")]) == 2
    capsys.readouterr()
    assert runtime_main(["eval-ppl", str(tiny), "--text", str(text), "--stride", "0"]) == 2  # not the default
    assert capsys.readouterr().err.strip() == "error: --stride 0 must be in [1, --ctx 1024]"
    assert runtime_main(["eval-ppl", str(tiny), "--text", str(text), "--ctx", "64", "--stride", "65"]) == 2
    assert capsys.readouterr().err.strip() == "error: --stride 65 must be in [1, --ctx 64]"  # before the load
    assert runtime_main(["eval-ppl", str(tiny), "--text", str(tmp_path)]) == 2
    assert "a directory; give a text file in it" in capsys.readouterr().err


def test_generation_batch_keeps_the_lockstep_cache_within_its_budget():
    from types import SimpleNamespace

    from flotilla.quantize.calibration import GENERATION_BATCH, KV_BUDGET, generation_batch

    smol = SimpleNamespace(num_key_value_heads=3, head_dim=64)  # SmolLM2-135M: 30 layers
    assert generation_batch(smol, 30, 128, torch.bfloat16) == GENERATION_BATCH
    llama8b = SimpleNamespace(num_key_value_heads=8, head_dim=128)  # 32 layers: 128 KiB a token in bf16
    assert generation_batch(llama8b, 32, 128, torch.bfloat16) == GENERATION_BATCH  # 2 GiB for 128
    assert generation_batch(llama8b, 32, 2048, torch.bfloat16) == KV_BUDGET // (2048 << 17) == 16
    assert generation_batch(llama8b, 32, 1 << 20, torch.float32) == 1  # never zero
