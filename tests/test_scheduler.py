"""Scheduler and engine bookkeeping over the echo model (fast; no real weights).

The echo model reads every sequence's context back through its block table, so these tests
check the KV cache end to end: see tests/fake_executor.py.
"""
from __future__ import annotations

import random

import pytest

from flotilla.errors import FlotillaError
from flotilla.runtime.sampling import SamplingParams

from fake_executor import check_echo_tokens, echo_engine, run_all


def params(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, **kw)


def shape(step):
    return list(zip(step.request_ids, step.starts, step.query_lens, step.sample))


def test_chunked_prefill_then_decode_within_the_budget():
    eng = echo_engine(max_num_batched_tokens=8)
    eng.add_request("a", list(range(20)), params(3))
    out = run_all(eng)
    assert [shape(s) for s in eng.executor.steps] == [
        [("a", 0, 8, False)], [("a", 8, 8, False)], [("a", 16, 4, True)],
        [("a", 20, 1, True)], [("a", 21, 1, True)]]
    check_echo_tokens(list(range(20)), out["a"])


def test_decodes_go_first_and_share_the_budget_with_a_prefill():
    eng = echo_engine(max_num_batched_tokens=8)
    eng.add_request("a", [1, 2, 3], params(10))
    eng.step()
    eng.add_request("b", list(range(100, 120)), params(2))
    eng.step()
    assert shape(eng.executor.steps[-1]) == [("a", 3, 1, True), ("b", 0, 7, False)]
    eng.step()
    assert shape(eng.executor.steps[-1]) == [("a", 4, 1, True), ("b", 7, 7, False)]
    eng.step()
    assert shape(eng.executor.steps[-1]) == [("a", 5, 1, True), ("b", 14, 6, True)]


def test_max_num_seqs_bounds_the_running_set():
    eng = echo_engine(max_num_seqs=3, max_num_batched_tokens=100)
    for i in range(5):
        eng.add_request(str(i), [i + 1] * 5, params(4))
    eng.step()
    assert [s.request_id for s in eng.scheduler.running] == ["0", "1", "2"]
    out = run_all(eng)
    assert sorted(out) == ["0", "1", "2", "3", "4"]
    assert max(s.num_seqs for s in eng.executor.steps) == 3


def test_fcfs_the_waiting_head_is_never_skipped():
    # 9 usable blocks of 4 tokens. "big" needs 7 blocks and must wait for "first" to finish; the
    # later "small" would fit at once but may not jump ahead of it.
    eng = echo_engine(num_blocks=10, block_size=4, max_num_batched_tokens=64)
    eng.add_request("first", list(range(1, 13)), params(4))  # 4 blocks by its end
    eng.step()
    eng.add_request("big", list(range(100, 125)), params(2))  # 7 blocks
    eng.add_request("small", [7, 7], params(2))
    run_all(eng)
    order = []
    for step in eng.executor.steps:
        for rid in step.request_ids:
            if rid not in order:
                order.append(rid)
    assert order == ["first", "big", "small"]


def test_preemption_recomputes_to_the_same_tokens_and_finishes():
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(5, 30))] for _ in range(12)]

    def run(num_blocks):
        eng = echo_engine(num_blocks=num_blocks, block_size=4, max_num_seqs=12, max_num_batched_tokens=64)
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, params(40))
        out = run_all(eng, max_steps=5000)
        eng.check_integrity()
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        return out, eng.stats()

    free_run, free_stats = run(400)
    tight_run, tight_stats = run(24)  # 23 blocks = 92 tokens; one sequence needs up to 18 blocks
    assert free_stats.preemptions_total == 0 and tight_stats.preemptions_total > 0
    assert tight_run == free_run
    for i, p in enumerate(prompts):
        check_echo_tokens(p, tight_run[str(i)])


def test_abort_of_50_in_flight_requests_returns_every_block():
    eng = echo_engine(num_blocks=200, block_size=4, max_num_seqs=32, max_num_batched_tokens=64)
    for i in range(50):
        eng.add_request(f"r{i}", [i % 7 + 1] * 20 + [i], params(100))
    for _ in range(6):
        eng.step()
    stats = eng.stats()
    assert stats.num_running > 0 and stats.num_waiting > 0 and stats.num_free_blocks < 199
    outs = [eng.abort(f"r{i}") for i in range(50)]
    assert all(o.finished and o.finish_reason == "abort" for o in outs)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks == 199
    assert not eng.has_unfinished() and eng.step() == []
    eng.check_integrity()
    assert eng.abort("r0") is None


def test_requests_that_cannot_fit_are_rejected_up_front():
    eng = echo_engine(num_blocks=5, block_size=4)  # 4 usable blocks: a 16-token context
    with pytest.raises(FlotillaError, match="at most 15 prompt tokens"):
        eng.add_request("x", list(range(16)), params(1))
    with pytest.raises(FlotillaError, match="empty"):
        eng.add_request("y", [], params(1))
    with pytest.raises(FlotillaError, match="outside the vocabulary"):
        eng.add_request("z", [5000], params(1))
    eng.add_request("ok", list(range(15)), params(50))
    out = run_all(eng)
    assert len(out["ok"]) == 1 and eng.stats().requests_finished_total["length"] == 1


def test_stop_token_ids_and_eos():
    eng = echo_engine(eos=())
    eng.add_request("probe", [1, 2, 3], params(6))
    tokens = run_all(eng)["probe"]
    eng.add_request("stop", [1, 2, 3], params(6, stop_token_ids=(tokens[2],)))
    eng2 = echo_engine(eos=(tokens[1],))
    eng2.add_request("eos", [1, 2, 3], params(6))
    eng2.add_request("ignore", [1, 2, 3], params(6, ignore_eos=True))
    assert run_all(eng)["stop"] == tokens[:3]
    out = run_all(eng2)
    assert out["eos"] == tokens[:2] and out["ignore"] == tokens


def test_prefix_hits_skip_computation():
    eng = echo_engine(num_blocks=64, block_size=4, max_num_batched_tokens=64)
    shared = list(range(1, 18))  # 4 full blocks + 1
    eng.add_request("a", shared + [50, 51], params(3))
    first = run_all(eng)
    eng.add_request("b", shared + [60], params(3))
    second = run_all(eng)
    b_first_step = [s for s in eng.executor.steps if "b" in s.request_ids][0]
    assert shape(b_first_step) == [("b", 16, 2, True)]  # 16 cached tokens, only 2 computed
    assert eng.stats().cached_tokens_total == 16
    check_echo_tokens(shared + [50, 51], first["a"])
    check_echo_tokens(shared + [60], second["b"])


def test_randomized_2000_requests_with_aborts_and_shared_prefixes():
    rng = random.Random(1234)
    eng = echo_engine(num_blocks=120, block_size=4, max_num_seqs=24, max_num_batched_tokens=96)
    prefixes = [[rng.randrange(1, 1000) for _ in range(rng.randrange(4, 40))] for _ in range(12)]
    prompts, outputs, aborted, pending = {}, {}, set(), 2000
    next_id = 0
    for step in range(200_000):
        while pending and rng.random() < 0.5:  # arrivals
            prefix = rng.choice(prefixes) if rng.random() < 0.6 else []
            prompt = prefix + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 40))]
            rid = f"q{next_id}"
            next_id += 1
            pending -= 1
            prompts[rid] = prompt
            eng.add_request(rid, prompt, params(rng.randrange(1, 30)))
        if eng.seqs and rng.random() < 0.08:  # aborts of random live requests
            victim = rng.choice(sorted(eng.seqs))
            eng.abort(victim)
            aborted.add(victim)
        for o in eng.step():
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
        if step % 97 == 0:
            eng.check_integrity()
        if not pending and not eng.has_unfinished():
            break
    stats = eng.stats()
    eng.check_integrity()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks, "blocks leaked"
    assert next_id == 2000 and len(aborted) > 100
    assert stats.cached_tokens_total > 0 and stats.preemptions_total > 0
    finished = sum(stats.requests_finished_total.values())
    assert finished == 2000
    for rid, prompt in prompts.items():
        check_echo_tokens(prompt, outputs.get(rid, []))
