"""The engine on real weights: SmolLM2-135M (fp32 from the GGUF, and RTN INT4) and a tiny
random Llama. Greedy against the single-sequence reference, batching invariance, prefix caching,
preemption, chunked prefill, aborts, seeded sampling."""
from __future__ import annotations

import asyncio

import pytest
import torch

from flotilla.runtime.async_engine import AsyncEngine
from flotilla.runtime.engine_args import EngineArgs, build_engine, generate
from flotilla.runtime.loader import load_model
from flotilla.runtime.sampling import SamplingParams
from flotilla.runtime.simple import generate_tokens

from conftest import make_hf_model, save_hf_model, tiny_config

TOPICS = ["the ocean", "a robot", "Paris", "mathematics", "a cat", "the moon", "coffee", "winter",
          "a library", "music", "trains", "volcanoes", "bread", "chess", "rain", "the internet"]
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def fp32(smollm2_gguf):
    return load_model(smollm2_gguf, "cpu", "float32", progress=False)


@pytest.fixture(scope="module")
def int4(smollm2_int4):
    return load_model(smollm2_int4, "cpu", "float32", progress=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_hf_model(make_hf_model(tiny_config("llama", vocab_size=256, max_position_embeddings=512)),
                         tmp_path_factory.mktemp("tiny") / "tiny-llama")
    return load_model(path, "cpu", "float32", with_tokenizer=False, progress=False)


def chat_prompts(lm, n=16):
    return [lm.tokenizer.apply_chat_template([{"role": "user", "content": f"Write one sentence about {t}."}])
            for t in TOPICS[:n]]


def engine(lm, **kw):
    return build_engine(lm, EngineArgs(**{"kv_cache_memory": "96MiB", **kw}))


def test_greedy_equals_the_single_sequence_reference(fp32):
    prompts = [fp32.tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):", "1, 2, 3,")]
    want = [list(generate_tokens(fp32.model, p, GREEDY)) for p in prompts]
    assert generate(engine(fp32), prompts, GREEDY) == want


@pytest.mark.parametrize("which", ["fp32", "int4"])
def test_sixteen_prompts_together_equal_each_alone(which, request):
    lm = request.getfixturevalue(which)
    prompts = chat_prompts(lm)
    p = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    together_engine = engine(lm)
    sizes = []
    inner = together_engine.executor.execute
    together_engine.executor.execute = lambda step: sizes.append(step.num_seqs) or inner(step)
    together = generate(together_engine, prompts, p)
    assert sizes[0] == 16 and sizes.count(16) == len(sizes)  # every step ran all 16 sequences
    alone_engine = engine(lm, enable_prefix_caching=False)
    alone = [generate(alone_engine, [pr], p)[0] for pr in prompts]
    assert together == alone
    assert len({tuple(t) for t in together}) > 8  # 16 different prompts, mostly different answers


def test_prefix_cache_hit_computes_only_the_new_tokens(int4):
    tok = int4.tokenizer
    text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(60))
    prefix = tok.encode(text)[:256]  # 16 full blocks
    a = prefix + tok.encode(" Question: what jumps?")
    b = prefix + tok.encode(" Question: what is lazy? Answer:")
    eng = engine(int4)
    generate(eng, [a], GREEDY)
    computed_before = eng.stats().prompt_tokens_total
    eng.add_request("b", b, GREEDY)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[0].num_cached_tokens == 256
    assert eng.stats().prompt_tokens_total - computed_before == len(b) - 256
    assert eng.stats().cached_tokens_total == 256
    fresh = generate(engine(int4, enable_prefix_caching=False), [b], GREEDY)[0]
    assert [t for o in outs for t in o.new_token_ids] == fresh


def test_preemption_under_a_tiny_pool_gives_the_same_tokens(int4):
    prompts = chat_prompts(int4, 6)  # ~40 tokens each; with 24 new tokens, 4 blocks each
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    free = generate(engine(int4), prompts, p)
    tight_engine = engine(int4, kv_cache_memory=str(10 * 720 * 1024))  # 10 blocks: room for ~2 at once
    assert tight_engine.block_manager.num_blocks == 9
    tight = generate(tight_engine, prompts, p)
    stats = tight_engine.stats()
    assert stats.preemptions_total > 0
    assert tight == free
    assert stats.num_free_blocks == stats.num_total_blocks
    tight_engine.check_integrity()


def test_chunked_prefill_gives_the_same_tokens(fp32):
    prompts = chat_prompts(fp32, 3)
    whole = generate(engine(fp32), prompts, GREEDY)
    chunked_engine = engine(fp32, max_num_batched_tokens=13)
    chunked = generate(chunked_engine, prompts, GREEDY)
    assert chunked == whole


def test_abort_of_50_in_flight_requests_returns_every_block(tiny):
    async def main():
        inner = build_engine(tiny, EngineArgs(kv_cache_memory="8MiB", max_num_seqs=32))
        eng = AsyncEngine(inner)
        streams = [eng.add_request(f"r{i}", [1 + i % 200] * 40, SamplingParams(max_tokens=400, ignore_eos=True))
                   for i in range(50)]
        await streams[0].__anext__()
        assert eng.stats().num_free_blocks < eng.stats().num_total_blocks
        await asyncio.gather(*(eng.abort(f"r{i}") for i in range(50)))
        assert inner.block_manager.num_free_blocks == inner.block_manager.num_blocks
        inner.check_integrity()
        await eng.shutdown()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_seeded_sampling_does_not_depend_on_the_batch(tiny):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 17, 30, 9)]
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=42, ignore_eos=True)
    alone = generate(build_engine(tiny, EngineArgs(kv_cache_memory="8MiB")), [prompts[0]], seeded)[0]
    others = [SamplingParams(max_tokens=12, temperature=0.7, ignore_eos=True)] * 3
    mixed = generate(build_engine(tiny, EngineArgs(kv_cache_memory="8MiB")), prompts[1:3] + [prompts[0]] + prompts[3:],
                     others[:2] + [seeded] + others[2:])
    assert mixed[2] == alone
    other_seed = generate(build_engine(tiny, EngineArgs(kv_cache_memory="8MiB")), [prompts[0]],
                          SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=43, ignore_eos=True))[0]
    assert other_seed != alone
