"""Tensor parallel over CPU processes joined by gloo: TP=2 logits equal TP=1 within 1e-4 (fp32
activations) through both of the model's paths, greedy tokens through the engine are identical,
for fp32 and INT4 weights (groups on rank boundaries, groups straddling ranks, act-order);
`runtime generate --tp` end to end; SmolLM2 INT4 (9 heads, 3 KV heads) split 3 ways, and its
one-line error for 2."""
from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from flotilla.quantize.options import QuantizeOptions
from flotilla.quantize.pipeline import quantize_model

from conftest import REPO, make_hf_model, save_hf_model, tiny_config
from quantize_helpers import cli_env, tiny_model_dir
from tp_helpers import PROMPTS, greedy_tokens, prompt_logprobs, rank_logits, start_tp_server, write_int4

ATOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-models")
    fp32 = tiny_model_dir(root / "fp32", seed=1)  # Llama: hidden 128, 4 heads, 2 KV heads, intermediate 256
    qwen = save_hf_model(make_hf_model(tiny_config("qwen2", tie_word_embeddings=True), seed=2), root / "qwen2-tied")
    biased = save_hf_model(make_hf_model(tiny_config("llama", attention_bias=True, mlp_bias=True), seed=4),
                           root / "llama-bias")
    qwen3 = save_hf_model(make_hf_model(tiny_config("qwen3", head_dim=32), seed=6), root / "qwen3")
    return {
        "fp32": fp32,
        "qwen2-tied": qwen,  # q/k/v biases (column-parallel) and a tied, vocab-parallel embedding/lm_head
        "llama-bias": biased,  # o_proj and down_proj biases: added once, by rank 0, before the all-reduce
        "qwen3": qwen3,  # q/k norms over each rank's heads (the weight is every head's: whole on each rank)
        "int4-g32": write_int4(fp32, root / "int4-g32", group_size=32),
        "int4-g128": write_int4(fp32, root / "int4-g128", group_size=128),  # o_proj: 64 rows a rank, groups of 128
        "int4-act-order": write_int4(fp32, root / "int4-act", group_size=32, act_order=True, seed=3),
        "rotated-tied-head": rotated_tied_head(root),  # the final norm's matrix before a vocab-parallel tied head
    }


def rotated_tied_head(root: Path) -> Path:
    """quantize --rotate --rotate-tied-head of a tied tiny Llama (INT4 RTN g32)."""
    options = QuantizeOptions(method="rtn", group_size=32, rotate="hadamard", rotate_tied_head=True)
    src = tiny_model_dir(root / "tied", seed=5, tie_word_embeddings=True, tokenizer=False)
    quantize_model(src, root / "rotated-tied-head", options, progress=False)
    return root / "rotated-tied-head"


def run_ranks(world: int, dirs: list[Path], tmp_path: Path) -> dict[str, torch.Tensor]:
    init = (tmp_path / "rendezvous").as_uri()
    mp.spawn(rank_logits, args=(world, init, [str(d) for d in dirs], str(tmp_path)), nprocs=world, join=True)
    return load_file(tmp_path / "logits.safetensors")


def test_tp2_logits_equal_tp1(models, tmp_path):
    names = list(models)
    got = run_ranks(2, [models[n] for n in names], tmp_path)
    for i, name in enumerate(names):
        ref = got[f"{i}.tp1"]
        for path in ("live", "frozen"):
            assert got[f"{i}.{path}"].shape == ref.shape
            err = (got[f"{i}.{path}"] - ref).abs().max().item()
            print(f"{name} ({path}): max |TP=2 - TP=1| = {err:.2e}")
            assert err < ATOL, f"{name} ({path}): TP=2 logits differ from TP=1 by {err}"
        assert torch.equal(got[f"{i}.live"].argmax(-1), ref.argmax(-1))
    err = (got["0.stages"] - got["0.tp1"]).abs().max().item()
    assert err < ATOL, f"two pipeline stages, each TP=2: logits differ by {err}"


def test_tp2_greedy_tokens_through_the_engine_equal_tp1(models):
    dirs = [str(models[n]) for n in ("fp32", "int4-g32", "int4-act-order")]
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "tp_helpers.py"), "2", *dirs], capture_output=True,
                          text=True, env=cli_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tp2 = json.loads(proc.stdout.strip().splitlines()[-1])
    for d in dirs:
        tp1 = greedy_tokens(d, 1)
        assert all(len(t) == 12 for t in tp1)
        assert tp2[d] == tp1, f"{d}: greedy tokens differ"


def test_tp2_prompt_logprobs_equal_tp1(models):
    """Prompt logprobs under TP=2 (every rank computes its share of the prompt rows' logits for the gather):
    the TP=1 values, ranks and top tokens."""
    path = str(models["int4-g32"])
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "tp_helpers.py"), "prompt", path, "2"],
                          capture_output=True, text=True, env=cli_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tp2 = json.loads(proc.stdout.strip().splitlines()[-1])
    tp1 = json.loads(json.dumps(prompt_logprobs(path, 1)))  # tuples as JSON lists, as tp2's
    assert [len(a) for a in tp2] == [len(b) for b in tp1] == [len(p) for p in PROMPTS]
    for a, b in zip(tp2, tp1):
        assert a[0] is None and b[0] is None
        for (lp2, rank2, top2), (lp1, rank1, top1) in zip(a[1:], b[1:]):
            assert abs(lp2 - lp1) < ATOL and rank2 == rank1 and [t for t, _ in top2] == [t for t, _ in top1]


def test_a_tp2_pipeline_stage_fed_hidden_states_gives_the_tp1_tokens(models):
    path = str(models["int4-g32"])
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "tp_helpers.py"), "stages", path], capture_output=True,
                          text=True, env=cli_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == greedy_tokens(path, 1)


def test_a_killed_rank_stops_rank_0_at_once(models):
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "tp_helpers.py"), "kill", str(models["fp32"])],
                          capture_output=True, text=True, env=cli_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # 16 x 240 tokens, 4 at a time: the step in flight fails as soon as the peer is gone, saying a rank died (not
    # with the collective's RuntimeError)
    assert result["outcome"] == "RankDied", result


def test_runtime_generate_tp2_prints_the_tp1_text(models):
    from flotilla.runtime.cli import _stream
    from flotilla.runtime.engine_args import EngineArgs, build_engine
    from flotilla.runtime.loader import load_model
    from flotilla.runtime.sampling import SamplingParams

    path, prompt = models["int4-g32"], "tensor parallel"
    lm = load_model(path, "cpu")
    engine = build_engine(lm, EngineArgs(kv_cache_memory="4MiB", max_num_seqs=1))
    out = io.StringIO()  # what `runtime generate` writes, TP=1, in this process
    _stream(engine, "tp1", lm.tokenizer.encode(prompt), SamplingParams(max_tokens=16, temperature=0.0), out)
    proc = subprocess.run([sys.executable, "-m", "flotilla.server.cli", "generate", str(path), "-p", prompt,
                           "--max-tokens", "16", "--kv-cache-memory", "4MiB", "--tp", "2"], capture_output=True,
                          env=cli_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.decode() == out.getvalue() + "\n" and out.getvalue().strip()
    # each rank caches its own KV heads: half the bytes a block
    per_block = [float(re.search(r"([0-9.]+) KiB a block", line).group(1))
                 for line in (engine.kv_cache_report, proc.stderr.decode())]
    assert per_block[1] == per_block[0] / 2, per_block


def test_runtime_generate_tp2_with_ngram_speculation_prints_the_tp1_text(models):
    """Speculative decoding inside a tensor-parallel group: rank 0 verifies the drafts, the other ranks
    compute their share of the logits and sample nothing (they crashed on the drafts before)."""
    from flotilla.runtime.cli import _stream
    from flotilla.runtime.engine_args import EngineArgs, build_engine
    from flotilla.runtime.loader import load_model
    from flotilla.runtime.sampling import SamplingParams

    path, prompt = models["int4-g32"], "tensor parallel tensor parallel tensor parallel tensor parallel"
    lm = load_model(path, "cpu")
    engine = build_engine(lm, EngineArgs(kv_cache_memory="4MiB", max_num_seqs=1))
    out = io.StringIO()
    _stream(engine, "tp1", lm.tokenizer.encode(prompt), SamplingParams(max_tokens=16, temperature=0.0), out)
    proc = subprocess.run([sys.executable, "-m", "flotilla.server.cli", "generate", str(path), "-p", prompt,
                           "--max-tokens", "16", "--kv-cache-memory", "4MiB", "--tp", "2", "--speculative", "ngram"],
                          capture_output=True, env=cli_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.decode() == out.getvalue() + "\n" and out.getvalue().strip()


def test_smollm2_tp2_is_one_line_naming_the_heads(smollm2_gguf):
    proc = subprocess.run([sys.executable, "-m", "flotilla.server.cli", "generate", str(smollm2_gguf), "-p", "hi",
                           "--tp", "2"], capture_output=True, text=True, env=cli_env(), timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "tensor parallel size 2 does not divide" in lines[0]
    assert "9 attention heads (num_attention_heads) % 2 = 1" in lines[0] and "sizes that do: 1, 3" in lines[0]


@pytest.mark.slow
def test_smollm2_int4_tp3_equals_tp1(smollm2_int4, tmp_path):
    got = run_ranks(3, [smollm2_int4], tmp_path)
    ref = got["0.tp1"]
    for path in ("live", "frozen"):
        err = (got[f"0.{path}"] - ref).abs().max().item()
        print(f"SmolLM2 INT4 ({path}): max |TP=3 - TP=1| = {err:.2e} (logits up to {ref.abs().max().item():.1f})")
        # 30 layers of INT4 products summed in another order, logits up to ~35: measured 6e-5
        assert err < 2 * ATOL, f"SmolLM2 INT4 TP=3 ({path}) differs from TP=1 by {err}"
    assert torch.equal(got["0.live"].argmax(-1), ref.argmax(-1))
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "tp_helpers.py"), "3", str(smollm2_int4)],
                          capture_output=True, text=True, env=cli_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])[str(smollm2_int4)] == greedy_tokens(str(smollm2_int4), 1)


def test_serve_exits_when_a_rank_dies(models):
    """A server whose tensor-parallel rank died can never answer again: it says so and exits with status 1 (as
    vLLM's does), so that a supervisor restarts it and a load balancer sees refused connects, instead of
    answering 503 for ever while /health said ok."""
    import os
    import signal
    import urllib.request

    proc, url = start_tp_server(models["fp32"])
    try:
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            assert r.status == 200
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        ranks = [int(c) for c in children  # the spawned rank (not multiprocessing's resource tracker)
                 if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(ranks) == 1, children
        for pid in ranks:
            os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        err = proc.stderr.read()
        assert "the engine cannot serve again (tensor-parallel rank 1 exited" in err, err[-3000:]
        assert "error: the engine died: tensor-parallel rank 1 exited" in err and "Traceback" not in err, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_gemma_under_tp2_keeps_the_hybrid_cache_and_gives_the_tp1_tokens(tmp_path):
    """Gemma 3's sliding and global layers in groups of their own blocks on every rank (the setup message carries
    the groups; each step's tables of every group reach the ranks): TP=2's greedy tokens are TP=1's, past the
    8-token window."""
    from conftest import save_byte_tokenizer
    from test_gemma import gemma3_config

    path = save_hf_model(make_hf_model(gemma3_config(), seed=8), tmp_path / "gemma3")
    save_byte_tokenizer(path)
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "tp_helpers.py"), "2", str(path)], capture_output=True,
                          text=True, env=cli_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tp2 = json.loads(proc.stdout.strip().splitlines()[-1])[str(path)]
    assert tp2 == greedy_tokens(str(path), 1) and all(len(t) == 12 for t in tp2)
