"""Speculative decoding inside the engine, on the echo model (fast, exact): rejected drafts roll
back KV slots and blocks, prefix-cache hashes cover real tokens only, stops inside an accepted
run end the request exactly where plain decoding ends it, and a randomized run with aborts and
preemptions leaks no block."""
from __future__ import annotations

import random

import pytest

from fake_executor import check_echo_tokens, echo_next, run_all
from flotilla.models.tokenizer import load_tokenizer
from flotilla.runtime.sampling import SamplingParams
from spec_helpers import OracleProposer, plain_echo_engine, spec_echo_engine

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def echo_continuation(prompt: list[int], n: int, vocab: int = 1000) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(echo_next(ctx, vocab))
    return ctx[len(prompt):]


def test_tokens_equal_plain_decoding_and_some_drafts_are_rejected():
    prompts = [[i, i + 1, i + 2] * (1 + i % 3) for i in range(1, 7)]
    eng = spec_echo_engine(OracleProposer(hit=0.7, seed=1, random_length=True), k=4)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, GREEDY)
    out = run_all(eng)
    ref = plain_echo_engine()
    for i, p in enumerate(prompts):
        ref.add_request(f"r{i}", p, GREEDY)
    assert out == run_all(ref)
    for i, p in enumerate(prompts):
        check_echo_tokens(p, out[f"r{i}"])
    s = eng.stats()
    assert 0 < s.spec_accepted_tokens_total < s.spec_draft_tokens_total
    assert s.steps_total < ref.stats().steps_total  # accepted drafts saved steps
    assert s.num_free_blocks == s.num_total_blocks
    eng.check_integrity()


def test_rejected_drafts_give_back_their_blocks_and_the_table_shrinks():
    class Wrong(OracleProposer):  # four drafts, all wrong
        def propose(self, seqs, ks, seeds):
            from flotilla.runtime.spec.proposer import Proposal
            return [Proposal([(echo_next(s.token_ids, 1000) + 1) % 1000] * k) for s, k in zip(seqs, ks)]

    eng = spec_echo_engine(Wrong(hit=0), k=4, num_blocks=16, block_size=4, min_acceptance=0.0)
    eng.add_request("a", [5, 6, 7], GREEDY)
    eng.step()  # prefill: 3 tokens in block 1, one token sampled
    seq = eng.seqs["a"]
    assert seq.block_table == [1] and seq.num_tokens == 4 and seq.num_computed_tokens == 3
    steps = eng.executor.steps
    eng.step()  # verify: token 4 + 4 drafts at positions 3..7 need blocks 1 and 2
    assert steps[-1].block_tables == [[1, 2]] and steps[-1].spec_token_ids == [[steps[-1].token_ids[1]] * 4]
    # all 4 rejected: one token appended; positions 0..3 computed; block 2 back at the free queue's front
    assert seq.num_tokens == 5 and seq.num_computed_tokens == 4 and seq.block_table == [1]
    assert eng.block_manager.pool.free_queue.head.next.block_id == 2
    assert eng.stats().spec_draft_tokens_total == 4 and eng.stats().spec_accepted_tokens_total == 0
    eng.check_integrity()
    out = run_all(eng)
    check_echo_tokens([5, 6, 7], [seq.token_ids[3], seq.token_ids[4]] + out["a"])


def test_prefix_cache_hashes_cover_real_tokens_only():
    # Drafts fill block 2 completely; had their block been hashed, a later request with the same
    # tokens as the drafts would hit it. It must not: those tokens were never generated.
    bs = 4
    prompt = [9, 8, 7, 6]  # block 1, full

    class Propose(OracleProposer):
        def propose(self, seqs, ks, seeds):
            from flotilla.runtime.spec.proposer import Proposal
            return [Proposal([11, 12, 13, 14][:k]) for k in ks]  # wrong (echo tokens are hashes)

    eng = spec_echo_engine(Propose(hit=0), k=4, num_blocks=16, block_size=bs, min_acceptance=0.0)
    eng.add_request("a", prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    eng.step()  # prefill
    t1 = eng.seqs["a"].token_ids[4]
    assert t1 != 11
    eng.step()  # verify t1 + [11, 12, 13, 14]: positions 4..7 fill block 2 with t1, 11, 12, 13
    assert eng.executor.steps[-1].token_ids == [t1, 11, 12, 13, 14]
    hashed = {b.block_id for b in eng.block_manager.pool.cached.values()}
    assert hashed == {1}  # the prompt's block; never the drafts' block
    eng.abort("a")
    eng.add_request("b", prompt + [t1, 11, 12, 13, 14], GREEDY)
    outs = eng.step()
    assert eng.scheduler.running[0].num_cached_tokens == 4  # the prompt block only
    check_echo_tokens(prompt + [t1, 11, 12, 13, 14], outs[0].new_token_ids)


@pytest.mark.parametrize("stop_at", [2, 5, 9])
def test_eos_inside_an_accepted_run_ends_the_request_where_plain_decoding_does(stop_at):
    prompt = [3, 1, 4, 1, 5]
    want = echo_continuation(prompt, 20)
    eos = want[stop_at]
    stop = want.index(eos)  # the first occurrence ends it
    params = SamplingParams(max_tokens=20, temperature=0)
    eng = spec_echo_engine(OracleProposer(hit=1.0), k=6, eos=(eos,))
    eng.add_request("r", prompt, params)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [t for o in outs for t in o.new_token_ids] == want[:stop + 1]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason is None  # the model's eos: None, as vLLM
    assert any(len(o.new_token_ids) > 1 for o in outs)  # several tokens a step: drafts were accepted
    assert eng.stats().num_free_blocks == eng.stats().num_total_blocks


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7, 13])
def test_max_tokens_is_exact(max_tokens):
    prompt = [2, 7, 1, 8]
    eng = spec_echo_engine(OracleProposer(hit=1.0), k=4)
    eng.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [t for o in outs for t in o.new_token_ids] == echo_continuation(prompt, max_tokens)
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == max_tokens
    # the executor never verified a draft past max_tokens
    assert all(len(d) <= max_tokens - 1 for st in eng.executor.steps for d in (st.spec_token_ids or []))


def test_stop_strings_inside_an_accepted_run_cut_the_text_as_plain_decoding_does(smollm2_gguf):
    tok = load_tokenizer(smollm2_gguf)
    prompt = tok.encode("Once upon a time")
    vocab = 49152  # echo tokens are random tokens of the real tokenizer
    want = echo_continuation(prompt, 30, vocab)
    stop = tok.decode(want[6:8]).strip()[:4]
    assert stop
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=(stop,))
    results = []
    for eng in (plain_echo_engine(tokenizer=tok, vocab_size=vocab),
                spec_echo_engine(OracleProposer(hit=1.0, vocab_size=vocab), k=5, tokenizer=tok, vocab_size=vocab)):
        eng.add_request("r", prompt, params)
        outs = []
        while eng.has_unfinished():
            outs += eng.step()
        results.append(([t for o in outs for t in o.new_token_ids], "".join(o.text for o in outs),
                         outs[-1].finish_reason, outs[-1].stop_reason))
        assert eng.stats().num_free_blocks == eng.stats().num_total_blocks
    plain, spec = results
    assert spec == plain
    assert plain[2] == "stop" and plain[3] == stop and stop not in plain[1]
    assert len(plain[0]) < 30


def test_drafts_are_dropped_before_anyone_is_preempted():
    # 5 usable blocks of 4: two sequences of 8 tokens fit with their next token, not with 4 drafts each
    eng = spec_echo_engine(OracleProposer(hit=1.0), k=4, num_blocks=6, block_size=4, caching=False)
    eng.add_request("a", [1] * 7, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    eng.add_request("b", [2] * 7, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    eng.step()
    assert eng.block_manager.num_free_blocks == 1
    eng.step()  # a: token 7 + 4 drafts takes the last free block; b: token 7 fits its block 2, drafts don't
    step = eng.executor.steps[-1]
    drafts = dict(zip(step.request_ids, step.spec_token_ids))
    assert len(drafts["a"]) == 4 and drafts["b"] == []
    assert eng.stats().preemptions_total == 0
    run_all(eng)
    assert eng.stats().num_free_blocks == eng.stats().num_total_blocks


def test_a_sequence_whose_drafts_keep_failing_stops_speculating():
    eng = spec_echo_engine(OracleProposer(hit=0.0), k=4)
    eng.add_request("r", [4, 4, 4], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    run_all(eng)
    s = eng.stats()
    # without the backoff every one of ~200 steps would verify drafts
    assert s.spec_verify_steps_total < 40 and s.spec_accepted_tokens_total < s.spec_draft_tokens_total
    good = spec_echo_engine(OracleProposer(hit=1.0, seed=3), k=4)
    good.add_request("r", [4, 4, 4], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    run_all(good)
    assert good.stats().spec_acceptance_rate == 1.0 and good.stats().steps_total < 200 / 2


@pytest.mark.parametrize("seed", range(5))
def test_randomized_run_with_aborts_and_preemption_leaks_no_block(seed):
    rng = random.Random(seed)
    vocab = 40  # small: eos (token 0) ends some requests early, inside accepted runs too
    shared = [rng.randrange(1, vocab) for _ in range(9)]
    reqs = {}
    for i in range(24):
        prompt = shared[:rng.randint(0, 9)] + [rng.randrange(1, vocab) for _ in range(rng.randint(1, 10))]
        reqs[f"r{i}"] = (prompt, SamplingParams(max_tokens=rng.randint(1, 40), temperature=0,
                                                ignore_eos=rng.random() < 0.5))
    kw = dict(num_blocks=20, block_size=4, max_num_seqs=8, max_num_batched_tokens=24, eos=(0,), vocab_size=vocab)
    eng = spec_echo_engine(OracleProposer(hit=rng.choice([0.4, 0.8, 0.95]), vocab_size=vocab, seed=seed,
                                          random_length=True),
                           k=rng.randint(1, 6), **kw)
    pending = list(reqs)
    aborted, out = set(), {}
    for _ in range(5000):
        while pending and rng.random() < 0.6:
            rid = pending.pop(0)
            eng.add_request(rid, *reqs[rid])
        live = list(eng.seqs)
        if live and rng.random() < 0.08:
            rid = rng.choice(live)
            eng.abort(rid)
            aborted.add(rid)
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        eng.check_integrity()
        if not pending and not eng.has_unfinished():
            break
    s = eng.stats()
    assert s.num_free_blocks == s.num_total_blocks and not eng.seqs
    assert s.preemptions_total > 0 and 0 < s.spec_accepted_tokens_total < s.spec_draft_tokens_total
    ref = plain_echo_engine(**kw)
    for rid, (prompt, params) in reqs.items():
        ref.add_request(rid, prompt, params)
    want = run_all(ref)
    done = [rid for rid in reqs if rid not in aborted]
    assert len(done) > 12
    assert {rid: out.get(rid, []) for rid in done} == {rid: want[rid] for rid in done}


def test_a_logprobs_request_does_not_speculate_but_shares_verify_steps_with_one_that_does():
    eng = spec_echo_engine(OracleProposer(hit=1.0), k=4)
    eng.add_request("lp", [7, 7, 7], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True,
                                                    top_logprobs=2))
    eng.add_request("sp", [8, 8, 8], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    lp = [o for o in outs if o.request_id == "lp"]
    assert [len(o.new_token_ids) for o in lp] == [1] * 6  # one token a step: no drafts
    assert all(len(o.logprobs) == 1 and o.logprobs[0] == pytest.approx(0.0, abs=1e-6) for o in lp)
    assert all(len(o.top_logprobs[0]) == 2 and o.top_logprobs[0][0][0] == o.new_token_ids[0] for o in lp)
    check_echo_tokens([7, 7, 7], [t for o in lp for t in o.new_token_ids])
    assert any(st.spec_token_ids and st.spec_token_ids[st.request_ids.index("sp")] and "lp" in st.request_ids
               for st in eng.executor.steps)  # a mixed verify step happened
    assert all(d == [] for st in eng.executor.steps if st.spec_token_ids
               for rid, d in zip(st.request_ids, st.spec_token_ids) if rid == "lp")


def test_commit_is_given_the_sequences_that_sampled_this_step():
    # `ScheduledSeq.samples` reads the sequence's length, which the step's appends change: the
    # engine must take the list before appending, or the proposer never settles through commit
    class Recording(OracleProposer):
        def __init__(self):
            super().__init__(hit=0.5, seed=3)
            self.committed: list[list[str]] = []

        def commit(self, seqs, running) -> None:
            self.committed.append([s.request_id for s in seqs])

    proposer = Recording()
    eng = spec_echo_engine(proposer, k=2)
    eng.add_request("a", [5, 6, 7], GREEDY)
    eng.add_request("b", [9, 10], GREEDY)
    run_all(eng)
    assert proposer.committed and all(sorted(c) == ["a", "b"] for c in proposer.committed[:3])
