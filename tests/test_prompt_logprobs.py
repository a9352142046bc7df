"""Prompt logprobs (SamplingParams.prompt_logprobs: vLLM's prompt_logprobs, and what the completions API's
echo with logprobs shows) against transformers' log-softmax on a tiny random Llama: across prefill chunks,
with the prefix cache holding the prompt, with max_tokens 0, and in a batch beside plain requests."""
from __future__ import annotations

import pytest
import torch

from flotilla.errors import FlotillaError
from flotilla.runtime.engine_args import EngineArgs, build_engine
from flotilla.runtime.loader import load_model
from flotilla.runtime.sampling import SamplingParams

from conftest import make_hf_model, save_hf_model, tiny_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = make_hf_model(tiny_config("llama", vocab_size=256, max_position_embeddings=512))
    path = save_hf_model(hf, tmp_path_factory.mktemp("tiny") / "tiny-llama")
    return hf, load_model(path, "cpu", "float32", with_tokenizer=False, progress=False)


def oracle(hf, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax [P - 1, vocab]: row p is the distribution of the token at p + 1."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def run(eng, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    for rid, (prompt, params) in requests.items():
        eng.add_request(rid, prompt, params)
    outs: dict[str, list] = {rid: [] for rid in requests}
    while eng.has_unfinished():
        for out in eng.step():
            outs[out.request_id].append(out)
    return outs


def check(entries: list, want: torch.Tensor, prompt: list[int], k: int) -> None:
    assert entries[0] is None and len(entries) == len(prompt)
    for p, (lp, rank, top) in enumerate(entries[1:]):
        row, token = want[p], prompt[p + 1]
        assert lp == pytest.approx(row[token].item(), abs=1e-4)
        assert rank == int((row > row[token]).sum()) + 1
        ids = row.topk(k).indices.tolist()
        assert [t for t, _ in top] == ids
        assert [v for _, v in top] == pytest.approx(row[ids].tolist(), abs=1e-4)


def test_prompt_logprobs_equal_transformers_across_chunks_and_a_cached_prefix(tiny):
    hf, lm = tiny
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 256, (70,), generator=g).tolist()
    want = oracle(hf, prompt)
    # 16-token chunks: the prompt's logprobs come from five steps; the second request's prompt sits in the
    # prefix cache by then, which it must not read (a cached block gives no logits)
    eng = build_engine(lm, EngineArgs(kv_cache_memory="16MiB", max_num_batched_tokens=16))
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    first = run(eng, {"warm": (prompt, plain)})["warm"]
    assert first[0].prompt_logprobs is None  # not asked for: nothing computed
    outs = run(eng, {"a": (prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=2))})
    a = outs["a"]
    check(a[0].prompt_logprobs, want, prompt, 2)
    assert all(o.prompt_logprobs is None for o in a[1:])  # once, on the first output
    assert [t for o in a for t in o.new_token_ids] == [t for o in first for t in o.new_token_ids]
    # a later request of the same prompt without prompt logprobs reads the cache again
    again = run(eng, {"b": (prompt, plain)})["b"]
    assert again[-1].num_cached_tokens == 64


def test_max_tokens_0_scores_the_prompt_only_beside_other_requests(tiny):
    hf, lm = tiny
    g = torch.Generator().manual_seed(4)
    p1, p2, p3 = (torch.randint(3, 256, (n,), generator=g).tolist() for n in (23, 9, 40))
    eng = build_engine(lm, EngineArgs(kv_cache_memory="16MiB"))
    outs = run(eng, {
        "score": (p1, SamplingParams(max_tokens=0, prompt_logprobs=0)),
        "gen": (p2, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)),
        "both": (p3, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=5)),
    })
    (score,) = outs["score"]
    assert score.new_token_ids == [] and score.finished and score.finish_reason == "length"
    assert score.num_output_tokens == 0 and score.text == ""
    check(score.prompt_logprobs, oracle(hf, p1), p1, 0)
    check(outs["both"][0].prompt_logprobs, oracle(hf, p3), p3, 5)
    assert sum(len(o.new_token_ids) for o in outs["gen"]) == 5
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks  # every block back
    eng.check_integrity()
    # a one-token prompt has nothing to predict: [None]
    (one,) = run(eng, {"one": ([7], SamplingParams(max_tokens=0, prompt_logprobs=1))})["one"]
    assert one.prompt_logprobs == [None]


def test_an_executor_without_prompt_logprobs_refuses_them(tiny):
    _, lm = tiny
    eng = build_engine(lm, EngineArgs(kv_cache_memory="16MiB"))
    eng.executor = object()  # an executor that does not compute them
    with pytest.raises(FlotillaError, match="prompt logprobs"):
        eng.validate([5, 6, 7], SamplingParams(prompt_logprobs=1))


def test_a_prompt_that_fills_the_context_is_scored_with_max_tokens_0(tiny):
    """Nothing is generated, so the whole context may be prompt (vLLM's check: prompt + max_tokens)."""
    hf, lm = tiny
    eng = build_engine(lm, EngineArgs(kv_cache_memory="16MiB", max_model_len=48, max_num_batched_tokens=16))
    prompt = torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(5)).tolist()
    (out,) = run(eng, {"full": (prompt, SamplingParams(max_tokens=0, prompt_logprobs=0))})["full"]
    check(out.prompt_logprobs, oracle(hf, prompt), prompt, 0)
    with pytest.raises(FlotillaError, match="at most 47 prompt tokens"):
        eng.validate(prompt, SamplingParams(max_tokens=1))
