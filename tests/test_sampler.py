"""The batched sampler: each parameter's effect, exact distributions, seeds, logprobs."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import needs_gpu

from flotilla.errors import FlotillaError
from flotilla.runtime.sampler import Sampler, SamplingBatch, chunked_first_max, first_max
from flotilla.runtime.sampling import SamplingParams

V = 50


def logits_row(seed: int = 0) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 2


def batch(rows):
    """rows: (params, seed, step, prompt ids, output ids)"""
    built = SamplingBatch.build([(p, seed, prompt, out) for p, seed, step, prompt, out in rows])
    steps = [r[2] for r in rows]
    return SamplingBatch(**{**built.__dict__, "steps": steps})


def sample_many(logits: torch.Tensor, p: SamplingParams, n: int, seed: int = 7) -> torch.Tensor:
    """n draws of one distribution, as n rows of one batch (token index = step)."""
    b = batch([(p, seed, i, [], []) for i in range(n)])
    return torch.tensor(Sampler()(logits.expand(n, -1).clone(), b).token_ids)


def test_greedy_is_the_argmax_and_deterministic():
    logits = torch.stack([logits_row(i) for i in range(6)])
    b = batch([(SamplingParams(temperature=0), i, 0, [], []) for i in range(6)])
    first = Sampler()(logits, b).token_ids
    assert first == logits.argmax(-1).tolist() == Sampler()(logits, b).token_ids
    b1 = batch([(SamplingParams(temperature=1.5, top_k=1), i, 3, [], []) for i in range(6)])
    assert Sampler()(logits, b1).token_ids == first  # top_k=1 is greedy


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_samples_follow_softmax_of_logits_over_temperature(temperature):
    logits = logits_row(1)
    n = 20000
    draws = sample_many(logits, SamplingParams(temperature=temperature), n)
    freq = torch.bincount(draws, minlength=V).float() / n
    p = torch.softmax(logits / temperature, -1)
    sigma = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 4.5 * sigma + 1e-4).all()


def test_top_k_top_p_min_p_restrict_the_support_and_renormalise():
    logits = logits_row(2)
    p = torch.softmax(logits, -1)
    order = p.argsort(descending=True)
    n = 8000
    top3 = set(order[:3].tolist())
    draws = sample_many(logits, SamplingParams(top_k=3), n)
    assert set(draws.tolist()) == top3
    q = p[order[:3]] / p[order[:3]].sum()  # renormalised within the top 3
    freq = torch.tensor([(draws == t).float().mean().item() for t in order[:3].tolist()])
    assert (freq - q).abs().max() < 4.5 * (q * (1 - q) / n).sqrt().max() + 1e-3

    nucleus = []
    mass = 0.0
    for t in order.tolist():  # smallest prefix reaching 0.8
        nucleus.append(t)
        mass += p[t].item()
        if mass >= 0.8:
            break
    assert set(sample_many(logits, SamplingParams(top_p=0.8), n).tolist()) == set(nucleus)

    keep = set((p >= 0.2 * p.max()).nonzero().view(-1).tolist())
    assert set(sample_many(logits, SamplingParams(min_p=0.2), n).tolist()) == keep
    # top-p applies to the top-k distribution renormalised (as transformers and vLLM do)
    p5 = p[order[:5]] / p[order[:5]].sum()
    in_both = order[:int((p5.cumsum(0) - p5 < 0.8).sum())].tolist()
    assert set(sample_many(logits, SamplingParams(top_k=5, top_p=0.8), n).tolist()) == set(in_both)
    assert len(in_both) < 5


def test_seeded_draws_do_not_depend_on_the_batch():
    logits = torch.stack([logits_row(i) for i in range(8)])
    p = SamplingParams(temperature=1.0, seed=123)
    alone = [Sampler()(logits[i:i + 1], batch([(p, 123, i, [], [])])).token_ids[0] for i in range(8)]
    # the same rows inside a larger, shuffled batch with other requests around them
    rows, perm = [], [5, 2, 7, 0, 3, 6, 1, 4]
    mixed_logits = []
    for j in perm:
        rows.append((SamplingParams(temperature=0.7, top_p=0.9), 999 + j, 17, [], []))
        mixed_logits.append(logits_row(100 + j))
        rows.append((p, 123, j, [], []))
        mixed_logits.append(logits[j])
    out = Sampler()(torch.stack(mixed_logits), batch(rows)).token_ids
    assert [out[2 * k + 1] for k in range(8)] == [alone[j] for j in perm]
    other_seed = [Sampler()(logits[i:i + 1], batch([(p, 124, i, [], [])])).token_ids[0] for i in range(8)]
    assert other_seed != alone


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[3.0, 2.9, -1.0, -1.05] + [-10.0] * (V - 4)])
    greedy = SamplingParams(temperature=0, repetition_penalty=1.2)
    # token 0 (in the prompt) falls to 2.5 < 2.9
    assert Sampler()(logits, batch([(greedy, 0, 0, [0], [])])).token_ids == [1]
    # a negative logit is pushed down: -1.0 * 1.2 < -1.05
    masked = logits.clone()
    masked[0, :2] = -20
    assert Sampler()(masked, batch([(greedy, 0, 0, [], [2])])).token_ids == [3]
    assert Sampler()(masked, batch([(SamplingParams(temperature=0), 0, 0, [], [2])])).token_ids == [2]


def test_presence_and_frequency_penalties_apply_to_output_tokens_only():
    logits = torch.tensor([[5.0, 4.0, 3.5] + [-10.0] * (V - 3)])
    pres = SamplingParams(temperature=0, presence_penalty=1.2)
    assert Sampler()(logits, batch([(pres, 0, 0, [1], [0])])).token_ids == [1]  # 3.8 < 4.0
    assert Sampler()(logits, batch([(pres, 0, 0, [0], [])])).token_ids == [0]  # prompt tokens are free
    freq = SamplingParams(temperature=0, frequency_penalty=0.3)
    assert Sampler()(logits, batch([(freq, 0, 0, [], [0, 0, 0])])).token_ids == [0]  # 5 - 0.9 = 4.1
    assert Sampler()(logits, batch([(freq, 0, 0, [], [0, 0, 0, 0])])).token_ids == [1]  # 5 - 1.2 = 3.8
    # rows without penalties are untouched next to rows with them
    two = torch.cat([logits, logits])
    mixed = batch([(freq, 0, 0, [], [0] * 4), (SamplingParams(temperature=0), 0, 0, [], [0] * 4)])
    assert Sampler()(two, mixed).token_ids == [1, 0]


def test_logprobs_are_the_models_log_softmax():
    logits = torch.stack([logits_row(3), logits_row(4)])
    rows = [(SamplingParams(temperature=0, logprobs=True, top_logprobs=3), 0, 0, [], []),
            (SamplingParams(temperature=0.8, logprobs=True, top_logprobs=0, repetition_penalty=1.3), 5, 0, [1], [])]
    out = Sampler()(logits, batch(rows))
    ref = torch.log_softmax(logits, -1)
    for i in range(2):
        assert math.isclose(out.logprobs[i], ref[i, out.token_ids[i]].item(), rel_tol=1e-6)
    top = ref[0].topk(3)
    assert [t for t, _ in out.top_logprobs[0]] == top.indices.tolist()
    assert [lp for _, lp in out.top_logprobs[0]] == pytest.approx(top.values.tolist())
    assert out.top_logprobs[1] == []
    plain = Sampler()(logits, batch([(SamplingParams(temperature=0), 0, 0, [], [])] * 2))
    assert plain.logprobs is None


def test_sampling_params_are_validated():
    for bad in [dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(min_p=1.5), dict(max_tokens=-1),
                dict(prompt_logprobs=21), dict(repetition_penalty=0), dict(presence_penalty=3), dict(top_logprobs=21)]:
        with pytest.raises(FlotillaError):
            SamplingParams(**bad)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
def test_first_max_in_chunks_is_argmax_with_ties_at_the_first(device):
    """Ties inside a chunk, across chunks, at a chunk's border, and -inf rows: the first maximum."""
    V = 128256  # llama-3's vocabulary: 128 chunks of 1002
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, V, generator=gen)
    x[0, [7, 5000, 90000]] = 50.0  # across chunks
    x[1, [1002, 1003]] = 50.0  # at a chunk's first entries
    x[2, [1001, 1002]] = 50.0  # either side of a border
    x[3] = float("-inf")
    x[3, [128255, 128000]] = 1.0
    x = x.to(device)
    want = [7, 1002, 1001, 128000, int(x[4].argmax())]
    assert chunked_first_max(x, 1002).tolist() == want
    assert chunked_first_max(x, 256).tolist() == want
    assert first_max(x).tolist() == want == Sampler()(x, SamplingBatch.build([(SamplingParams(temperature=0), 0, [], [])]
                                                                              * 5)).token_ids


def test_logit_bias_shifts_the_logits_and_an_extreme_one_decides():
    logits = torch.stack([logits_row(1), logits_row(1)])
    top = int(logits[0].argmax())
    plain = SamplingParams(temperature=0)
    banned = SamplingParams(temperature=0, logit_bias=((top, -100.0),))
    forced = SamplingParams(temperature=0, logit_bias=((3, 100.0),))
    out = Sampler()(logits, batch([(banned, 0, 0, [], []), (forced, 0, 0, [], [])])).token_ids
    assert out[0] != top and out[0] == int(logits[0].clone().index_fill_(0, torch.tensor([top]), -1e9).argmax())
    assert out[1] == 3
    # reported logprobs stay the model's, before the bias (as every processing step)
    lp = SamplingParams(temperature=0, logit_bias=((3, 100.0),), logprobs=True)
    got = Sampler()(logits[:1], batch([(lp, 0, 0, [], [])]))
    assert got.token_ids == [3] and math.isclose(got.logprobs[0], float(torch.log_softmax(logits[0], -1)[3]),
                                                 rel_tol=1e-5)
    # a sampled row: the bias changes the distribution exactly as the logits would
    p = SamplingParams(temperature=1.0, logit_bias=((top, -3.0), (5, 1.5)))
    shifted = logits[0].clone()
    shifted[top] -= 3.0
    shifted[5] += 1.5
    draws = sample_many(logits[0], p, 4000)
    assert Sampler()(logits[:1], batch([(plain, 0, 0, [], [])])).token_ids == [top]
    want = torch.softmax(shifted, -1)
    freq = torch.bincount(draws, minlength=V).float() / len(draws)
    assert (freq - want).abs().max() < 0.03


def test_min_tokens_masks_the_end_tokens_below_it():
    logits = torch.full((3, V), -5.0)
    logits[:, 2] = 10.0  # eos, by far the likeliest
    logits[:, 9] = 8.0  # a stop token
    logits[:, 4] = 1.0
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(9,))
    rows = SamplingBatch.build([(p, 0, [], [])] * 3, steps=[1, 2, 3], eos_token_ids=(2,))
    assert rows.ends == [[2, 9]] * 3
    assert Sampler()(logits, rows).token_ids == [4, 4, 2]  # steps 1, 2 are short of 3; step 3 may end
    ignore = SamplingParams(temperature=0, min_tokens=3, ignore_eos=True)
    rows = SamplingBatch.build([(ignore, 0, [], [])], steps=[0], eos_token_ids=(2,))
    assert rows.ends == [[]] and Sampler()(logits[:1], rows).token_ids == [2]  # eos does not end it anyway
    with pytest.raises(FlotillaError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(FlotillaError, match="logit_bias"):
        SamplingParams(logit_bias=((1, 101.0),))
    # a list or a dict from Python callers: kept as a tuple, as the sampler keys its tensors by it
    for given in ([(3, 100.0)], {3: 100.0}):
        p = SamplingParams(temperature=0, logit_bias=given)
        assert p.logit_bias == ((3, 100.0),)
        assert Sampler()(torch.zeros(1, V), SamplingBatch.build([(p, 0, [], [])])).token_ids == [3]
