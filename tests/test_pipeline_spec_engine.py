"""Speculative decoding in the PipelineEngine, without a network (fast, exact).

The loopback pipeline of test_pipeline_engine (every step through the real StepEncoder, the wire
codec and a worker's StageSequences mirror, several micro-batches in flight, results one at a
time) with a last stage that verifies drafts on the echo model through the real rejection
sampler (spec_helpers). Every rebuilt step must equal the engine's, drafts, sampling rows and
draft distributions included; rejected drafts that gave blocks back are trimmed from the
workers' tables; a sequence in flight is never proposed for and keeps its drafts; the frame
budget for draft distributions holds; a fault re-prefills and the tokens are undisturbed.
"""
from __future__ import annotations

import random

import pytest
import torch

from fake_executor import check_echo_tokens, echo_next
from flotilla.runtime.engine import EngineConfig
from flotilla.runtime.pipeline.engine import PipelineEngine
from flotilla.runtime.pipeline.step_codec import sampler_output, step_result
from flotilla.runtime.pipeline.wire import decode, encode
from flotilla.runtime.sampling import SamplingParams
from flotilla.runtime.scheduler import SchedulerConfig
from flotilla.runtime.spec.config import SpeculativeConfig
from flotilla.runtime.spec.decoder import SpecDecoder
from flotilla.runtime.spec.proposer import Proposal
from spec_helpers import OracleProposer, SpecEchoExecutor
from test_pipeline_engine import LoopbackExecutor, run

V = 1000


class SpecLoopback(LoopbackExecutor):
    """The loopback pipeline whose last stage verifies drafts (echo model, real verifier)."""

    def __init__(self, num_blocks: int, block_size: int, depth: int = 3, max_prob_bytes: int = 16 << 20):
        super().__init__(num_blocks, block_size, depth)
        self.echo = SpecEchoExecutor(num_blocks, block_size, V)
        self.max_prob_bytes = max_prob_bytes
        self.messages = []

    def _submit(self, step, generation: int, prev_mb: int = 0, feed: bool = False) -> int:
        self._next += 1
        mb = self._next
        if generation != self.generation or not self.ready:
            return mb
        msg = decode(encode(self.encoder.encode(step, self.epoch, mb)))
        self.messages.append(msg)
        rebuilt = self.mirror.apply(msg, is_last=True)
        for name in ("token_ids", "starts", "query_lens", "block_tables", "num_decodes", "sample", "sampling",
                     "spec_token_ids"):
            assert getattr(rebuilt, name) == getattr(step, name), name
        assert (rebuilt.draft_probs is None) == (step.draft_probs is None)
        if step.draft_probs is not None:
            assert torch.equal(rebuilt.draft_probs, step.draft_probs)
        self.pending.append((mb, msg, rebuilt))
        self.submitted.append((mb, step.num_seqs))
        self.max_in_flight = max(self.max_in_flight, len(self.pending))
        return mb

    def results(self, timeout: float):
        with self._lock:
            if not self.pending:
                return []
            mb, msg, step = self.pending.popleft()
            out = self.echo.execute(step)
            self.mirror.record(msg, out.token_ids, out.accepted)
            return [(mb, sampler_output(decode(encode(step_result(msg.epoch, mb, out)))))]


class DistProposer(OracleProposer):
    """The oracle's drafts; a sampled request's are drawn from a distribution (mass `hit` on the
    echo token, the rest spread evenly) that goes with the proposal. Checks that no sequence it
    is asked about waits for a token from a step in flight."""

    needs_probs = True

    def __init__(self, hit: float, seed: int = 0):
        super().__init__(hit, V, seed, random_length=True)
        self.engine: PipelineEngine | None = None
        self.ks: list[tuple[bool, int]] = []  # (greedy, k) of every sequence asked about

    def propose(self, seqs, ks, seeds):
        # (a prompt's last chunk may follow the one in flight: it is the first to sample)
        flying = {s.seq.request_id for piece in self.engine._inflight.values() for s in piece.scheduled if s.samples}
        assert not flying & {s.request_id for s in seqs}, "proposed for a sequence whose token is in flight"
        assert all(s.num_uncomputed_tokens == 1 for s in seqs)
        self.ks += [(seq.params.greedy, k) for seq, k in zip(seqs, ks)]
        out = []
        for seq, k in zip(seqs, ks):
            if seq.params.greedy:
                out += super().propose([seq], [k], seeds)
                continue
            ctx, drafts, rows = list(seq.token_ids), [], []
            for _ in range(self.rng.randint(0, k)):
                q = torch.full((V,), (1 - self.hit) / (V - 1))
                q[echo_next(ctx, V)] = self.hit
                t = int(torch.multinomial(q, 1, generator=torch.Generator().manual_seed(self.rng.getrandbits(62))))
                drafts.append(t)
                rows.append(q)
                ctx.append(t)
            self.proposed += len(drafts)
            out.append(Proposal(drafts, torch.stack(rows) if rows else None))
        return out


def spec_pipeline(proposer, k=4, num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, depth=3,
                  max_prob_bytes=16 << 20, caching=True) -> PipelineEngine:
    config = EngineConfig(num_blocks=num_blocks, block_size=block_size, max_model_len=1 << 20,
                          scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens), enable_prefix_caching=caching)
    spec = SpecDecoder(SpeculativeConfig("ngram", k, min_acceptance=0.0), proposer)
    eng = PipelineEngine(SpecLoopback(num_blocks, block_size, depth, max_prob_bytes), config, vocab_size=V,
                         spec=spec)
    proposer.engine = eng
    return eng


def drive(eng, reqs, rng, abort_rate=0.0, check=None):
    """Add the requests a few at a time, abort some, step to the end; tokens per request and the
    aborted ids."""
    pending, aborted, out = list(reqs), set(), {}
    for _ in range(20_000):
        while pending and rng.random() < 0.5:
            rid = pending.pop(0)
            eng.add_request(rid, *reqs[rid])
        if eng.seqs and rng.random() < abort_rate:
            rid = rng.choice(sorted(eng.seqs))
            eng.abort(rid)
            aborted.add(rid)
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        eng.check_integrity()
        if check is not None:
            check(eng)
        if not pending and not eng.has_unfinished():
            return out, aborted
    raise AssertionError(f"not finished: {eng.stats()}")


def in_flight_keep_their_drafts(eng):
    for piece in eng._inflight.values():
        for s in piece.scheduled:
            assert s.seq.spec_token_ids[:s.num_spec] == s.spec_token_ids, "drafts of a step in flight overwritten"


@pytest.mark.parametrize("seed", range(3))
def test_randomized_speculative_run_through_the_diff_protocol(seed):
    """Greedy and sampled requests (penalties, seeds, logprobs), shared prefixes, chunked prefill,
    preemptions under a small pool and aborts of sequences in flight: every rebuilt step equals
    the engine's, every token is the echo model's, no block leaks and every handle is dropped."""
    rng = random.Random(seed)
    shared = [rng.randrange(V) for _ in range(9)]
    reqs = {}
    for i in range(30):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(V) for _ in range(rng.randrange(1, 12))]
        reqs[f"q{i}"] = (prompt, SamplingParams(
            max_tokens=rng.randrange(1, 30), temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(100),
            repetition_penalty=rng.choice([1.0, 1.2]), presence_penalty=rng.choice([0.0, 0.5]),
            logprobs=rng.random() < 0.2, top_logprobs=2, ignore_eos=True))
    proposer = DistProposer(hit=0.7, seed=seed)
    eng = spec_pipeline(proposer, k=rng.randint(3, 6), num_blocks=24, max_num_seqs=6, max_num_batched_tokens=24)
    out, aborted = drive(eng, reqs, rng, abort_rate=0.03, check=in_flight_keep_their_drafts)
    s = eng.stats()
    assert s.preemptions_total > 0 and aborted and eng.executor.max_in_flight >= 3
    assert 0 < s.spec_accepted_tokens_total < s.spec_draft_tokens_total
    msgs = eng.executor.messages
    assert any(m.draft_probs is not None for m in msgs)  # sampled drafts' distributions went on the wire
    assert any(m.trims for m in msgs)  # rejected drafts gave a block back: trimmed, not a new handle
    for rid, (prompt, params) in reqs.items():
        check_echo_tokens(prompt, out.get(rid, []))
        if rid not in aborted:
            assert len(out[rid]) == params.max_tokens
    assert s.num_free_blocks == s.num_total_blocks
    eng.add_request("last", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    run(eng)
    assert len(eng.executor.mirror) <= 1  # every finished or aborted handle was dropped at the workers


def test_a_verify_step_is_one_frame_with_the_drafts_and_greedy_rows_send_no_distribution():
    eng = spec_pipeline(DistProposer(hit=1.0), k=3, depth=1)
    eng.add_request("g", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    eng.add_request("s", [4, 5, 6], SamplingParams(max_tokens=8, temperature=0.7, seed=3, ignore_eos=True))
    out = run(eng)
    check_echo_tokens([1, 2, 3], out["g"])
    check_echo_tokens([4, 5, 6], out["s"])
    verify = [m for m in eng.executor.messages if m.spec_token_ids and all(m.spec_token_ids)]
    assert verify, "no step verified drafts for both"
    m = verify[0]
    assert m.query_lens == [1 + len(d) for d in m.spec_token_ids]  # 1 + k tokens each, like a short prefill
    assert m.draft_probs.dtype == torch.float32
    assert m.draft_probs.shape == (len(m.spec_token_ids[1]), V)  # the sampled request's rows only


def test_draft_distributions_stay_within_the_frame_budget():
    budget = 3 * V * 4  # three rows of distributions a frame
    rng = random.Random(5)
    reqs = {f"r{i}": ([rng.randrange(V) for _ in range(5)],
                      SamplingParams(max_tokens=20, temperature=0.9 if i % 4 else 0.0, seed=i, ignore_eos=True))
            for i in range(8)}
    eng = spec_pipeline(DistProposer(hit=0.9, seed=1), k=5, num_blocks=128, max_num_batched_tokens=128,
                        max_prob_bytes=budget, depth=2)
    out, _ = drive(eng, reqs, rng)
    for rid, (prompt, _) in reqs.items():
        check_echo_tokens(prompt, out[rid])
    msgs = eng.executor.messages
    # micro-batches of four sequences (8 running / depth 2), most of them sampling with up to three
    # drafts: only cutting them short keeps every frame within the budget
    assert max(len(m.handles) for m in msgs) == 4
    assert max(m.draft_probs.numel() * 4 for m in msgs if m.draft_probs is not None) == budget
    assert eng.spec.max_prob_rows == 3
    ks = eng.spec.proposer.ks
    assert max(k for greedy, k in ks if greedy) == 5  # point-mass drafts: the full K
    assert max(k for greedy, k in ks if not greedy) == 3  # sampled drafts: what the budget holds


def test_a_fault_drops_the_proposals_in_flight_and_the_tokens_are_undisturbed():
    prompts = {f"r{i}": [i + 1, 2 * i + 3] * (2 + i) for i in range(8)}
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    def start():
        eng = spec_pipeline(DistProposer(hit=0.6, seed=2), num_blocks=96)
        for rid, p in prompts.items():
            eng.add_request(rid, p, params)
        return eng

    undisturbed = run(start())
    eng, out, steps = start(), {}, 0
    dropped = []
    forget = eng.spec.forget_drafts
    eng.spec.forget_drafts = lambda rid: (dropped.append(rid), forget(rid))
    while eng.has_unfinished():
        steps += 1
        if steps == 9:
            assert any(s.num_spec for piece in eng._inflight.values() for s in piece.scheduled)
            eng.executor.fail()
        if steps == 15:
            eng.executor.recover()
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        eng.check_integrity()
    assert out == undisturbed
    assert eng.num_rewinds == 1 and sorted(dropped) == sorted(prompts)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
