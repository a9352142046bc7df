"""The verifier on its own (no model): greedy exact match, rejection sampling that reproduces the
processed target distribution (temperature, top-k, top-p, min-p, penalties), point-mass drafts,
rows without drafts identical to the plain sampler, and the n-gram lookup."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flotilla.errors import FlotillaError
from flotilla.runtime.sampler import Sampler, SamplingBatch
from flotilla.runtime.sampling import SamplingParams
from flotilla.runtime.spec.config import SpeculativeConfig
from flotilla.runtime.spec.ngram import ngram_lookup
from flotilla.runtime.spec.rejection import RejectionSampler
from spec_helpers import goodness_of_fit

V = 12


def rows_for(params, seed, output, drafts):
    """The engine's sampling rows for one sequence verifying `drafts`."""
    return [(params, seed, [1, 2, 3], output + drafts[:i]) for i in range(len(drafts) + 1)]


def test_greedy_accepts_the_drafts_that_match_the_argmax_then_takes_the_argmax():
    argmax = [4, 7, 1, 9, 2, 5, 6, 3, 8]
    logits = torch.full((9, V), -1.0)
    logits[torch.arange(9), torch.tensor(argmax)] = 1.0
    greedy = SamplingParams(temperature=0)
    drafts = [[4, 7, 0], [5], [6, 3]]  # logits rows 0-3, 4-5 and 6-8
    rows = [r for i, d in enumerate(drafts) for r in rows_for(greedy, i, [], d)]
    out = RejectionSampler(Sampler(V))(logits, SamplingBatch.build(rows), drafts)
    # 4, 7 match rows 0, 1; 0 is not row 2's argmax (1). 5 is not row 4's (2). 6, 3 match; bonus row 8
    assert out.accepted == [[4, 7], [], [6, 3]]
    assert out.token_ids == [1, 2, 8]


def test_greedy_bonus_token_when_every_draft_matches():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    want = logits.argmax(dim=-1).tolist()
    greedy = SamplingParams(temperature=0)
    out = RejectionSampler(Sampler(V))(logits, SamplingBatch.build(rows_for(greedy, 0, [], want[:3])), [want[:3]])
    assert out.accepted == [want[:3]] and out.token_ids == [want[3]]


def test_greedy_with_penalties_counts_the_drafts_before_each_row():
    # row 1's argmax is token 5, but token 5 is also draft 1: a strong presence penalty on row 1
    # (which counts draft 1 as output) moves its argmax to token 6
    logits = torch.zeros(3, V)
    logits[0, 5] = 3.0
    logits[1, 5], logits[1, 6] = 3.0, 2.0
    logits[2, 0] = 1.0
    p = SamplingParams(temperature=0, presence_penalty=2.0)
    out = RejectionSampler(Sampler(V))(logits, SamplingBatch.build(rows_for(p, 0, [], [5, 5])), [[5, 5]])
    assert out.accepted == [[5]] and out.token_ids == [6]


def test_rows_without_drafts_sample_exactly_what_the_plain_sampler_samples():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, V, generator=gen) * 2
    ps = [SamplingParams(temperature=0.7, top_p=0.9, seed=s, repetition_penalty=1.2) for s in range(6)]
    rows = [(p, 100 + i, [1, 2], [3, i]) for i, p in enumerate(ps)]
    plain = Sampler(V)(logits.clone(), SamplingBatch.build(rows)).token_ids
    spec = RejectionSampler(Sampler(V))(logits.clone(), SamplingBatch.build(rows), [[] for _ in rows])
    assert spec.token_ids == plain and spec.accepted == [[]] * 6


SETTINGS = {
    "temperature": SamplingParams(temperature=0.8),
    "top-k, top-p, min-p": SamplingParams(temperature=1.3, top_k=6, top_p=0.85, min_p=0.08),
    "penalties": SamplingParams(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.7, frequency_penalty=0.4),
}


def first_tokens(params: SamplingParams, draft: str, n: int = 4000, k: int = 3):
    """n sequences verifying k drafts against the same target logits: the first token each
    emits, the processed target distribution of row 0, and the drafts' first tokens."""
    gen = torch.Generator().manual_seed(7)
    target = torch.randn(k + 1, V, generator=gen) * 1.5  # one row per position, shared by all sequences
    output = [3, 3, 8]
    sampler = Sampler(V)
    row0 = SamplingBatch.build([(params, 0, [1, 2, 3], output)])
    p0 = sampler.processed_probs(sampler.process_logits(target[:1].clone(), row0) if row0.any_penalty
                                 else target[:1].clone(), row0)[0]
    p0 = p0 / p0.sum()
    if draft == "model":  # a draft distribution unlike the target's, and drafts drawn from it
        q = torch.softmax(torch.randn(k, V, generator=gen), dim=-1)
        drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen) for i in range(k)], 1)
        draft_probs = q.repeat(n, 1)  # [n * k, V]
    else:  # point masses (n-gram): fixed drafts, here the target's third most likely token
        drafts = torch.full((n, k), int(p0.argsort(descending=True)[2]))
        draft_probs = None
    drafts = drafts.tolist()
    rows = [r for i in range(n) for r in rows_for(params, 1000 + i, output, drafts[i])]
    out = RejectionSampler(sampler)(target.repeat(n, 1), SamplingBatch.build(rows), drafts, draft_probs)
    first = [acc[0] if acc else tok for acc, tok in zip(out.accepted, out.token_ids)]
    return first, p0, [d[0] for d in drafts], out


@pytest.mark.parametrize("draft", ["model", "point mass"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_rejection_sampling_reproduces_the_processed_target_distribution(setting, draft):
    first, p0, draft_first, out = first_tokens(SETTINGS[setting], draft)
    probs = {t: float(p) for t, p in enumerate(p0)}
    counts = {t: first.count(t) for t in set(first)}
    assert goodness_of_fit(counts, probs) > 0.01
    rejected = sum(1 for acc in out.accepted if not acc)
    assert 0 < rejected < len(first)  # both paths taken: accepted drafts and residual draws
    # the test has power: the drafts themselves (what always accepting would emit) fail it
    assert goodness_of_fit({t: draft_first.count(t) for t in set(draft_first)},
                           {t: max(float(p), 1e-12) for t, p in enumerate(p0)}) < 1e-6


def test_a_seeded_sequence_verifies_the_same_whatever_else_is_in_the_batch():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(9, V, generator=gen)
    p = SamplingParams(temperature=1.0, seed=5)
    q = torch.softmax(torch.randn(6, V, generator=gen), dim=-1)
    drafts = [[1, 2], [3, 4, 5], [6]]
    rows = rows_for(p, 11, [], drafts[0]) + rows_for(p, 12, [], drafts[1]) + rows_for(p, 13, [], drafts[2])
    together = RejectionSampler(Sampler(V))(logits, SamplingBatch.build(rows), drafts, q)
    alone = RejectionSampler(Sampler(V))(logits[3:7], SamplingBatch.build(rows_for(p, 12, [], drafts[1])),
                                         [drafts[1]], q[2:5])
    assert (together.accepted[1], together.token_ids[1]) == (alone.accepted[0], alone.token_ids[0])


def test_ngram_lookup_proposes_the_continuation_of_the_longest_latest_match():
    t = np.array([5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 2, 3])
    # suffix [2, 3]: matches end at 3 and 8; [4, 2, 3] matches nowhere; the latest [2, 3] wins
    assert ngram_lookup(t, 3).tolist() == [7, 8, 4]
    t2 = np.array([1, 2, 3, 4, 0, 0, 2, 3, 5, 6, 1, 2, 3])
    # [1, 2, 3] (at 0..2) is longer than the later [2, 3] (at 6..7): the longest wins
    assert ngram_lookup(t2, 2).tolist() == [4, 0]
    assert ngram_lookup(np.array([1, 2, 3, 4]), 3).tolist() == []  # 4 never occurred before
    assert ngram_lookup(np.array([7, 7, 7, 7]), 5).tolist() == [7]  # the match can end one before the end
    assert ngram_lookup(t2, 2, ngram_min=4).tolist() == []


def test_speculative_flag_errors_list_the_valid_forms():
    with pytest.raises(FlotillaError, match="ngram, draft:PATH"):
        SpeculativeConfig.parse("medusa")
    with pytest.raises(FlotillaError, match="needs the path"):
        SpeculativeConfig.parse("draft:")
    with pytest.raises(FlotillaError, match=r"\[1, 32\], got 0"):
        SpeculativeConfig.parse("ngram", 0)
    assert SpeculativeConfig.parse("draft:/m/x:y", 3) == SpeculativeConfig("draft", 3, draft_path="/m/x:y")
