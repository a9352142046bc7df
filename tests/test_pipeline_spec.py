"""Speculative decoding over a real pipeline: a tiny random Llama (vocabulary 16, so a random
model repeats itself and the sampled distribution has few cells) on two workers on threads of
this process, in float16 on every side (activations in fp16 on the wire are lossless).

fp16 logits vary with the batch's shape by up to ~0.003 here (micro-batches group sequences
unlike the local engine's one batch), so batched runs are compared on prompts whose greedy
continuation has no near-tie: every top-2 logit gap along it is above 0.02 in fp32 (picked
from random candidates at the start; a tie would test the rounding, not the protocol).

- Greedy: pp=2 with n-gram lookup and with a draft model (the target with noise, on the head)
  gives the tokens of pp=1 without speculation, and drafts are accepted.
- Seeded sampling: one request at a time (so every pass has the local engine's shapes), pp=2
  with n-gram lookup and with a draft model gives exactly the tokens of the local speculative
  engine: drafts, their distributions and the verifier's draws go through the ring unchanged.
  Batched, the next two sampled tokens of a draft-model run follow the target's exact
  distribution (chi-square).
- A randomized run with aborts and preemptions leaves both pools at the head whole and full.
- A stage lost and restarted while drafts are in flight: the tokens are undisturbed and the
  draft model's cache stays consistent.
- `runtime serve --pp 2 --hosts … --speculative ngram`, its command line parsed as the CLI does,
  over workers of this process: the text of pp=1, and the speculative counters of /metrics move.
"""
from __future__ import annotations

import json
import random
import urllib.request

import pytest
import torch

from flotilla.runtime.engine_args import EngineArgs, build_engine, generate
from flotilla.runtime.loader import load_model
from flotilla.runtime.pipeline.head import build_pipeline_engine
from flotilla.runtime.pipeline.peer import LinkSettings
from flotilla.runtime.pipeline.pipeline import PipelineSettings
from flotilla.runtime.sampling import SamplingParams
from flotilla.runtime.simple import ContiguousKVCache

from conftest import make_hf_model, save_byte_tokenizer, save_hf_model, tiny_config
from pipeline_helpers import TOKEN, ThreadWorker, checkpoint_per_layer
from spec_helpers import goodness_of_fit
from test_server_limits import parse_exposition
from test_spec_models import PROMPT, SETTINGS, exact_next_two

VOCAB = 16
ARGS = {"kv_cache_memory": "4MiB", "max_num_seqs": 16}
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
MARGIN = 0.02
SAMPLED = [SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1, repetition_penalty=1.2,
                          presence_penalty=0.3, ignore_eos=True),
           SamplingParams(max_tokens=20, temperature=0.7, top_k=8, seed=2, frequency_penalty=0.2, ignore_eos=True),
           SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True)]


def noisy_copy(model, scale: float, seed: int):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(the target as a per-layer checkpoint, a draft: the target with noise)"""
    root = tmp_path_factory.mktemp("spec-pp")
    config = tiny_config("llama", vocab_size=VOCAB, max_position_embeddings=256)
    hf = save_hf_model(make_hf_model(config), root / "hf")
    draft = save_hf_model(noisy_copy(make_hf_model(config), 0.03, 7), root / "draft")
    return checkpoint_per_layer(hf, root / "ckpt"), draft


@pytest.fixture(scope="module")
def local(models):
    return load_model(models[0], "cpu", "float16", with_tokenizer=False, progress=False)


@torch.inference_mode()
def greedy_margin(model, prompt: list[int], n: int) -> float:
    """The smallest top-2 logit gap along the fp32 greedy continuation of a prompt."""
    ids, gaps = list(prompt), []
    for _ in range(n):
        cache = ContiguousKVCache(model, len(ids))
        cache.begin(len(ids))
        logits = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), cache)[-1:])[0]
        top = logits.topk(2).values
        gaps.append(float(top[0] - top[1]))
        ids.append(int(logits.argmax()))
    return min(gaps)


@pytest.fixture(scope="module")
def prompts(models):
    """Five random prompts and one that repeats a phrase, each without a near-tie (see above)."""
    model = load_model(models[0], "cpu", "float32", with_tokenizer=False, progress=False).model
    rng = random.Random(0)
    found: list[list[int]] = []
    for _ in range(300):
        found += [p for p in [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 20))]]
                  if len(found) < 5 and greedy_margin(model, p, GREEDY.max_tokens) > MARGIN]
        phrase = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 6))]
        if len(found) == 5 and greedy_margin(model, phrase * 4, GREEDY.max_tokens) > MARGIN:
            return found + [phrase * 4]
    raise AssertionError(f"no prompts without a near-tie among 300 candidates (found {len(found)})")


@pytest.fixture(scope="module")
def workers(models, tmp_path_factory):
    ws = [ThreadWorker(tmp_path_factory.mktemp(f"cache{i}"), models[0]) for i in range(2)]
    yield ws
    for w in ws:
        w.stop()


def pipeline(ckpt, workers, speculative=None, **args):
    settings = PipelineSettings(tuple(w.address for w in workers), LinkSettings(TOKEN), (2, 1), dtype="float16")
    engine_args = EngineArgs(**{**ARGS, **args}, speculative=speculative)
    return build_pipeline_engine(ckpt, engine_args, settings, lambda line: None, with_tokenizer=False, device="cpu")


def method(name, models) -> str:
    return "ngram" if name == "ngram" else f"draft:{models[1]}"


def check_pools(engine) -> None:
    """Both pools at the head whole, and every block of them free."""
    engine.check_integrity()
    s = engine.stats()
    assert s.num_free_blocks == s.num_total_blocks
    draft = getattr(engine.spec.proposer, "blocks", None)
    if draft is not None:
        assert draft.num_free_blocks == draft.num_blocks and not engine.spec.proposer.states


@pytest.mark.parametrize("name", ["ngram", "draft"])
def test_greedy_with_speculation_equals_pp1_without(name, models, local, workers, prompts):
    want = generate(build_engine(local, EngineArgs(**ARGS)), prompts, GREEDY)
    engine = pipeline(models[0], workers, method(name, models))
    try:
        assert generate(engine, prompts, GREEDY) == want
        s = engine.stats()
        assert 0 < s.spec_accepted_tokens_total < s.spec_draft_tokens_total
        assert s.steps_total < len(prompts) * GREEDY.max_tokens  # accepted drafts saved steps
        check_pools(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("name", ["ngram", "draft"])
def test_seeded_sampling_equals_the_local_speculative_engine(name, models, local, workers, prompts):
    loc = build_engine(local, EngineArgs(**ARGS, speculative=method(name, models)))
    engine = pipeline(models[0], workers, method(name, models))
    try:
        for prompt in prompts[-3:]:
            for params in SAMPLED:
                assert generate(engine, [prompt], params) == generate(loc, [prompt], params)
        s, ls = engine.stats(), loc.stats()
        assert s.spec_accepted_tokens_total == ls.spec_accepted_tokens_total > 0
        assert s.spec_draft_tokens_total == ls.spec_draft_tokens_total > s.spec_accepted_tokens_total
        check_pools(engine)
    finally:
        engine.close()


def test_draft_model_sampling_follows_the_target_distribution(models, workers):
    """The next two tokens of 1,000 seeded requests (penalties, top-k, top-p, min-p), drawn in
    verify steps with the draft's distributions sent down the ring."""
    n, params = 1000, SETTINGS["truncation+penalties"]
    exact = exact_next_two(load_model(models[0], "cpu", "float32", with_tokenizer=False, progress=False),
                           PROMPT, params)
    engine = pipeline(models[0], workers, method("draft", models), max_num_seqs=256, max_num_batched_tokens=2048,
                      kv_cache_memory="8MiB")
    try:
        plist = [SamplingParams(**{**params.__dict__, "seed": 500_000 + i}) for i in range(n)]
        pairs = [tuple(o[1:3]) for o in generate(engine, [PROMPT] * n, plist)]
        s = engine.stats()
        assert s.spec_verify_steps_total >= n
        assert 50 < s.spec_accepted_tokens_total < s.spec_draft_tokens_total - 50
        assert goodness_of_fit({c: pairs.count(c) for c in set(pairs)}, exact) > 0.01
        check_pools(engine)
    finally:
        engine.close()


def test_a_run_with_aborts_and_preemptions_leaks_no_block_at_the_head(models, workers):
    engine = pipeline(models[0], workers, method("draft", models), kv_cache_memory="48KiB", max_num_seqs=8,
                      max_num_batched_tokens=48, num_speculative_tokens=5)
    rng = random.Random(0)
    try:
        for i in range(30):
            params = SamplingParams(max_tokens=rng.randint(1, 40), temperature=rng.choice([0, 0.8]), seed=i,
                                    ignore_eos=True)
            engine.add_request(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))], params)
        aborted = 0
        while engine.has_unfinished():
            engine.step()
            if rng.random() < 0.05 and engine.seqs:
                engine.abort(rng.choice(sorted(engine.seqs)))
                aborted += 1
            engine.check_integrity()  # the target's pool and the draft's
        s = engine.stats()
        assert aborted > 3 and s.preemptions_total > 0 and s.spec_accepted_tokens_total > 0
        check_pools(engine)
    finally:
        engine.close()


def test_a_stage_restarted_while_drafts_are_in_flight(models, local, prompts, tmp_path):
    want = generate(build_engine(local, EngineArgs(**ARGS)), prompts, GREEDY)
    ws = [ThreadWorker(tmp_path / f"c{i}", models[0]) for i in range(2)]
    engine = pipeline(models[0], ws, method("draft", models))
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"f{i}", p, GREEDY)
        got: dict[str, list[int]] = {}
        steps = 0
        while engine.has_unfinished():
            steps += 1
            if steps == 6:
                assert any(s.num_spec for piece in engine._inflight.values() for s in piece.scheduled)
                port = ws[1].port
                ws[1].stop()
                ws[1] = ThreadWorker(tmp_path / "c1", models[0], port=port)
            for o in engine.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
            engine.check_integrity()
        assert engine.num_rewinds == 1
        assert [got[f"f{i}"] for i in range(len(prompts))] == want
        check_pools(engine)
    finally:
        engine.close()
        for w in ws:
            w.stop()


# ------------------------------------------------------------------------------------ serve

def test_serve_pp_speculative_ngram_text_and_metrics(tmp_path, monkeypatch):
    """`runtime serve MODEL --pp 2 --hosts … --speculative ngram` as its command line parses, over
    two workers of this process: the greedy text of pp=1, and the speculative counters move."""
    import argparse

    from flotilla.server.cli import _serve_args
    from flotilla.server.engine_client import EngineClient
    from server_harness import LiveServer

    hf = save_hf_model(make_hf_model(tiny_config("llama", vocab_size=256, max_position_embeddings=512)), tmp_path / "hf")
    save_byte_tokenizer(hf)
    ckpt = checkpoint_per_layer(hf, tmp_path / "ckpt")
    lm = load_model(ckpt, "cpu", "float16", progress=False)
    ids = lm.tokenizer.encode("abcabcabc abc abcabc")
    plain = build_engine(lm, EngineArgs(kv_cache_memory="8MiB"))
    plain.add_request("plain", ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    want = ""
    while plain.has_unfinished():
        want += "".join(o.text for o in plain.step())

    ws = [ThreadWorker(tmp_path / f"c{i}", ckpt) for i in range(2)]
    monkeypatch.setenv("FLOTILLA_TOKEN", TOKEN.decode())
    parser = argparse.ArgumentParser()
    _serve_args(parser)
    args = parser.parse_args([str(ckpt), "--pp", "2", "--hosts", ",".join(f"{h}:{p}" for h, p in (w.address for w in ws)),
                              "--device", "cpu", "--dtype", "float16", "--kv-cache-memory", "8MiB", "--max-num-seqs", "4",
                              "--speculative", "ngram", "--num-speculative-tokens", "3", "--served-model-name", "tiny"])
    client = EngineClient.from_args(args)
    server = LiveServer(client).__enter__()
    try:
        assert client._llm.spec is not None and client._llm.spec.config.num_speculative_tokens == 3
        body = {"model": "tiny", "prompt": ids, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert json.loads(r.read())["choices"][0]["text"] == want
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
            m = parse_exposition(r.read().decode())
        drafts, accepted = m[("flotilla_spec_draft_tokens_total", ())], m[("flotilla_spec_accepted_tokens_total", ())]
        assert m[("flotilla_spec_verify_steps_total", ())] > 0
        assert 0 < accepted < drafts
        assert m[("flotilla_spec_acceptance_rate", ())] == pytest.approx(accepted / drafts, abs=1e-6)
    finally:
        server.stop()
        client._llm.close()
        for w in ws:
            w.stop()
