"""Speculative decoding on real weights.

- Greedy: SmolLM2-135M (fp32 from the GGUF) gives the same tokens for 32 prompts with an INT4
  draft of itself and with n-gram lookup as without speculation.
- Sampling: on a tiny random model, the next two tokens (drawn inside verify steps) follow the
  target's exact distribution — computed here by enumeration — with n-gram and with a draft
  model, for 2,000 seeded requests (chi-square p > 0.01), as plain sampling does; and the two
  samples agree with each other.
- A randomized run with aborts and a draft model gives every block of both pools back.
"""
from __future__ import annotations

import random

import pytest
import torch

from flotilla.runtime.engine_args import EngineArgs, build_engine, generate
from flotilla.runtime.loader import load_model
from flotilla.runtime.sampler import Sampler, SamplingBatch
from flotilla.runtime.sampling import SamplingParams
from flotilla.runtime.simple import ContiguousKVCache

from conftest import make_hf_model, save_hf_model, tiny_config
from spec_helpers import goodness_of_fit, two_sample

TOPICS = ["the ocean", "a robot", "Paris", "mathematics", "a cat", "the moon", "coffee", "winter",
          "a library", "music", "trains", "volcanoes", "bread", "chess", "rain", "the internet"]
LINES = ["The quick brown fox jumps over the lazy dog.", "All that glitters is not gold.",
         "To be or not to be, that is the question.", "The early bird catches the worm.",
         "A picture is worth a thousand words.", "Knowledge is power, and power is knowledge.",
         "The pen is mightier than the sword.", "Fortune favors the bold and the brave.",
         "Rome was not built in a day, nor in a week.", "Actions speak louder than words ever could.",
         "Time flies like an arrow; fruit flies like a banana.", "Every cloud has a silver lining somewhere.",
         "Where there is smoke, there is usually fire.", "The best things in life are free.",
         "Practice makes perfect, or at least better.", "Beauty is in the eye of the beholder."]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def fp32(smollm2_gguf):
    return load_model(smollm2_gguf, "cpu", "float32", progress=False)


@pytest.fixture(scope="module")
def prompts(fp32):
    tok = fp32.tokenizer
    chat = [[{"role": "user", "content": f"Write one sentence about {t}."}] for t in TOPICS]
    chat += [[{"role": "user", "content": f"Repeat this sentence twice: {line}"}] for line in LINES]
    return [tok.apply_chat_template(m) for m in chat]


@pytest.fixture(scope="module")
def plain_greedy(fp32, prompts):
    return generate(build_engine(fp32, EngineArgs(kv_cache_memory="128MiB")), prompts, GREEDY)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_greedy_is_token_identical_for_32_prompts(method, fp32, prompts, plain_greedy, smollm2_int4):
    speculative = f"draft:{smollm2_int4}" if method == "draft" else "ngram"
    eng = build_engine(fp32, EngineArgs(kv_cache_memory="128MiB", speculative=speculative))
    assert generate(eng, prompts, GREEDY) == plain_greedy
    s = eng.stats()
    assert s.spec_accepted_tokens_total > 100 and s.spec_draft_tokens_total > s.spec_accepted_tokens_total
    assert s.num_free_blocks == s.num_total_blocks
    eng.check_integrity()


# ------------------------------------------------------------------------------ sampling, tiny

VOCAB = 16  # small, so that the joint distribution of two tokens has few cells
N = 2000


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny random target and a tiny random draft with the same vocabulary."""
    root = tmp_path_factory.mktemp("spec-tiny")
    paths = [save_hf_model(make_hf_model(tiny_config("llama", vocab_size=VOCAB, max_position_embeddings=256), seed=s),
                           root / f"m{s}") for s in (0, 1)]
    return load_model(paths[0], "cpu", "float32", with_tokenizer=False, progress=False), paths[1]


# every token occurs in the prompt, so n-gram lookup always finds a continuation to propose.
# max_tokens 4: the step after the prefill verifies 2 drafts and yields tokens 2 and 3 (and 4)
PROMPT = [5, 9, 1, 14, 3, 7, 11, 0, 6, 12, 15, 4, 8, 2, 13, 10, 5, 9, 1, 14, 3, 7]
SETTINGS = {
    "temperature": SamplingParams(max_tokens=4, temperature=0.9, ignore_eos=True),
    "truncation+penalties": SamplingParams(max_tokens=4, temperature=1.1, top_k=8, top_p=0.9, min_p=0.03,
                                           presence_penalty=0.6, repetition_penalty=1.3, ignore_eos=True),
}


@torch.inference_mode()
def exact_next_two(lm, prompt: list[int], params: SamplingParams) -> dict[tuple[int, int], float]:
    """P(t2, t3): the target's distribution of the 2nd and 3rd generated tokens (summed over the
    1st), each step processed as the sampler processes it, by enumerating every path."""
    sampler = Sampler(VOCAB)

    def dist(output: list[int]) -> torch.Tensor:
        ids = prompt + output
        cache = ContiguousKVCache(lm.model, len(ids))
        cache.begin(len(ids))
        logits = lm.model.compute_logits(lm.model(torch.tensor(ids), torch.arange(len(ids)), cache)[-1:])
        batch = SamplingBatch.build([(params, 0, prompt, output)])
        logits = sampler.process_logits(logits, batch) if batch.any_penalty else logits
        p = sampler.processed_probs(logits, batch)[0].double()
        return p / p.sum()

    out: dict[tuple[int, int], float] = {}
    p1 = dist([])
    for t1 in p1.nonzero()[:, 0].tolist():
        p2 = dist([t1])
        for t2 in p2.nonzero()[:, 0].tolist():
            p3 = dist([t1, t2])
            for t3 in p3.nonzero()[:, 0].tolist():
                out[(t2, t3)] = out.get((t2, t3), 0.0) + float(p1[t1] * p2[t2] * p3[t3])
    return out


def sample_next_two(lm, params: SamplingParams, seed0: int, speculative: str | None):
    eng = build_engine(lm, EngineArgs(kv_cache_memory="16MiB", max_num_seqs=512, max_num_batched_tokens=4096,
                                      speculative=speculative))
    plist = [SamplingParams(**{**params.__dict__, "seed": seed0 + i}) for i in range(N)]
    outs = generate(eng, [PROMPT] * N, plist)
    pairs = [tuple(o[1:3]) for o in outs]
    return {c: pairs.count(c) for c in set(pairs)}, eng.stats()


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_sampled_next_two_tokens_follow_the_target_distribution(setting, tiny_pair):
    lm, draft_path = tiny_pair
    params = SETTINGS[setting]
    exact = exact_next_two(lm, PROMPT, params)
    plain, _ = sample_next_two(lm, params, 0, None)
    assert goodness_of_fit(plain, exact) > 0.01
    for i, speculative in enumerate(["ngram", f"draft:{draft_path}"]):
        counts, stats = sample_next_two(lm, params, 100_000 * (i + 1), speculative)
        # every request verified drafts; many were accepted, many rejected
        assert stats.spec_verify_steps_total >= N
        assert 100 < stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total - 100
        assert goodness_of_fit(counts, exact) > 0.01, speculative
        assert two_sample(counts, plain) > 0.01, speculative


def test_draft_model_run_with_aborts_gives_back_every_block_of_both_pools(tiny_pair):
    lm, draft_path = tiny_pair
    eng = build_engine(lm, EngineArgs(kv_cache_memory="256KiB", max_num_seqs=8, max_num_batched_tokens=64,
                                      speculative=f"draft:{draft_path}", num_speculative_tokens=5))
    rng = random.Random(0)
    for i in range(40):
        params = SamplingParams(max_tokens=rng.randint(1, 60), temperature=rng.choice([0, 0.8]), seed=i,
                                ignore_eos=True)
        eng.add_request(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))], params)
    aborted = 0
    while eng.has_unfinished():
        eng.step()
        if rng.random() < 0.1 and eng.seqs:
            eng.abort(rng.choice(list(eng.seqs)))
            aborted += 1
        eng.check_integrity()  # the target's pool and the draft's
    draft_blocks = eng.spec.proposer.blocks
    s = eng.stats()
    assert aborted > 3 and s.preemptions_total > 0 and s.spec_accepted_tokens_total > 0
    assert s.num_free_blocks == s.num_total_blocks
    assert draft_blocks.num_free_blocks == draft_blocks.num_blocks and not eng.spec.proposer.states
