"""The PipelineEngine and the step diff protocol, without a network.

A loopback executor stands in for the workers: every step goes through the real StepEncoder, the
wire codec (to bytes and back), a worker-side StageSequences mirror, and the echo model of
fake_executor (which reads each sequence's whole context back through its block table, so a
wrong table, a wrong prefix hit or a lost KV write changes the tokens). The rebuilt StepInput
must equal the engine's own, field by field, sampling parameters included. Results come back
one micro-batch at a time, so several are in flight.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time
from collections import deque

import pytest

from flotilla.runtime.async_engine import AsyncEngine, RequestFailed
from flotilla.runtime.engine import EngineConfig
from flotilla.runtime.pipeline.engine import PipelineEngine
from flotilla.runtime.pipeline.step_codec import StageSequences, StepEncoder, fill_tokens, sampler_output, step_result
from flotilla.runtime.pipeline.wire import decode, encode
from flotilla.runtime.sampling import SamplingParams
from flotilla.runtime.scheduler import SchedulerConfig

from fake_executor import EchoKVExecutor, check_echo_tokens, echo_next


class LoopbackExecutor:
    """`overlap`: steps may be sent ahead (PipelineEngine's overlap); the "last stage" feeds the
    ids of steps sent with `feed` to "stage 0", which fills in the next step's tokens from them."""

    def __init__(self, num_blocks: int, block_size: int, depth: int = 3, overlap: bool = False,
                 vocab_size: int = 1000):
        self.depth = depth
        self.prefers_overlap = overlap
        self.max_launch_rows = 1 << 30 if overlap else 0
        self.fed: dict[int, list[int]] = {}
        self.discarded: list[int] = []
        self.generation = 0
        self.ready = True
        self.down_since: float | None = None
        self.epoch = 1
        self.encoder = StepEncoder()
        self.mirror = StageSequences()
        self.echo = EchoKVExecutor(num_blocks, block_size, vocab_size)
        self.pending: deque = deque()
        self.submitted: list[tuple[int, int]] = []  # (micro-batch id, sequences)
        self.max_in_flight = 0
        self.bytes = 0
        self._next = 0
        self.ran = 0  # the last step "stage 0" ran
        self._lock = threading.Lock()  # the async test fails the "network" from another thread

    # the PipelineExecutor interface
    def submit(self, step, generation: int, prev_mb: int = 0, feed: bool = False) -> int:
        with self._lock:
            return self._submit(step, generation, prev_mb, feed)

    def same_rows(self, num_rows: int, fewer: int) -> bool:
        return False

    def discard(self, mb: int) -> None:
        self.discarded.append(mb)

    def _submit(self, step, generation: int, prev_mb: int, feed: bool) -> int:
        self._next += 1
        mb = self._next
        if generation != self.generation or not self.ready:
            return mb
        data = encode(self.encoder.encode(step, self.epoch, mb, prev_mb, feed))
        self.bytes += len(data)
        msg = decode(data)
        rebuilt = self.mirror.apply(msg, is_last=True)
        for name in ("token_ids", "starts", "query_lens", "block_tables", "num_decodes", "sample"):
            assert getattr(rebuilt, name) == getattr(step, name), name
        assert rebuilt.sampling == step.sampling
        self.pending.append((mb, msg, rebuilt))
        self.submitted.append((mb, step.num_seqs))
        self.max_in_flight = max(self.max_in_flight, len(self.pending))
        return mb

    def results(self, timeout: float):
        with self._lock:
            if not self.pending:
                return []
            mb, msg, step = self.pending.popleft()  # one at a time: the rest stay in flight
            if msg.prev_rows is not None:  # stage 0 takes the tokens the step before sampled
                assert msg.prev_mb == self.ran and step.prev_rows is None
                msg = fill_tokens(msg, self.fed.pop(msg.prev_mb))
                step = dataclasses.replace(step, token_ids=msg.token_ids)
            self.ran = mb
            self.fed = {k: v for k, v in self.fed.items() if k >= mb}  # as a worker forgets them
            out = self.echo.execute(step)
            if msg.feed:
                self.fed[mb] = out.token_ids
            self.mirror.record(msg, out.token_ids)
            return [(mb, sampler_output(decode(encode(step_result(msg.epoch, mb, out)))))]

    def wait_ready(self, timeout: float) -> bool:
        time.sleep(min(timeout, 0.01))
        return self.ready

    def release(self, request_id: str) -> None:
        self.encoder.release(request_id)

    def reset(self) -> None:
        self.encoder.reset()

    def describe_down(self) -> str:
        return "pipeline stage 1 (10.0.0.2:7070) is unreachable: connection refused"

    def problems(self) -> list[str]:
        return [] if self.ready else [self.describe_down()]

    # what the network would do
    def fail(self) -> None:
        """A stage dies: what was in flight is lost, and its KV cache and mirror are gone."""
        with self._lock:
            self.generation += 1
            self.ready = False
            self.down_since = time.monotonic()
            self.pending.clear()
            self.echo.cache.fill_(-1)
            self.mirror = StageSequences()

    def recover(self) -> None:
        with self._lock:
            self.epoch += 1
            self.ready, self.down_since = True, None


def pipeline_engine(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, depth=3,
                    stage_timeout=60.0, caching=True, overlap=False, vocab_size=1000, eos=()) -> PipelineEngine:
    config = EngineConfig(num_blocks=num_blocks, block_size=block_size, max_model_len=1 << 20,
                          scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens), enable_prefix_caching=caching,
                          overlap=overlap)
    return PipelineEngine(LoopbackExecutor(num_blocks, block_size, depth, overlap, vocab_size), config,
                          eos_token_ids=eos, vocab_size=vocab_size, stage_timeout=stage_timeout)


def run(engine, max_steps=20_000) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return out
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError(f"not finished: {engine.stats()}")


def test_micro_batches_keep_every_stage_busy():
    eng = pipeline_engine(num_blocks=128, max_num_seqs=9, max_num_batched_tokens=256)
    prompts = {f"r{i}": [i + 1] * (3 + i) for i in range(9)}
    for rid, p in prompts.items():
        eng.add_request(rid, p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    out = run(eng)
    ex = eng.executor
    assert ex.max_in_flight == 3  # one micro-batch per stage
    assert [n for _, n in ex.submitted[:3]] == [3, 3, 3]  # nine sequences cut into three
    assert all(n <= 3 for _, n in ex.submitted)
    for rid, p in prompts.items():
        assert len(out[rid]) == 6
        check_echo_tokens(p, out[rid])


def test_random_workload_through_the_diff_protocol():
    """Shared prefixes, chunked prefill, preemption under a small pool, penalties, logprobs,
    seeds and aborts of sequences in flight: every rebuilt step equals the engine's."""
    rng = random.Random(0)
    eng = pipeline_engine(num_blocks=20, block_size=4, max_num_seqs=6, max_num_batched_tokens=20)
    shared = [rng.randrange(1000) for _ in range(9)]
    expected: dict[str, tuple[list[int], int]] = {}
    aborted, outs, step = set(), {}, 0
    for i in range(40):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(1000) for _ in range(rng.randrange(1, 14))]
        params = SamplingParams(max_tokens=rng.randrange(1, 16), temperature=rng.choice([0.0, 0.8]),
                                repetition_penalty=rng.choice([1.0, 1.2]), presence_penalty=rng.choice([0.0, 0.5]),
                                logprobs=rng.random() < 0.3, top_logprobs=2, seed=rng.randrange(100), ignore_eos=True)
        eng.add_request(f"q{i}", prompt, params)
        expected[f"q{i}"] = (prompt, params.max_tokens)
    while eng.has_unfinished():
        step += 1
        if step % 23 == 0 and eng.scheduler.running:
            victim = rng.choice(eng.scheduler.running).request_id
            eng.abort(victim)
            aborted.add(victim)
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert eng.stats().preemptions_total > 0 and aborted
    for rid, (prompt, max_tokens) in expected.items():
        check_echo_tokens(prompt, outs.get(rid, []))
        if rid not in aborted:
            assert len(outs[rid]) == max_tokens
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    eng.check_integrity()
    eng.add_request("last", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    run(eng)
    assert len(eng.executor.mirror) <= 1  # every finished or aborted handle was dropped at the workers


def test_a_fault_pauses_rewinds_and_resumes_with_the_same_tokens():
    prompts = {f"r{i}": [i + 1, 2 * i + 3] * (2 + i) for i in range(8)}
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def start():
        eng = pipeline_engine(num_blocks=96)
        for rid, p in prompts.items():
            eng.add_request(rid, p, params)
        return eng

    undisturbed = run(start())
    eng, out, steps = start(), {}, 0
    while eng.has_unfinished():
        steps += 1
        if steps == 25:
            eng.executor.fail()
        if steps == 35:
            eng.executor.recover()
        outs = eng.step()
        if 25 <= steps < 35:
            assert outs == []  # paused
        for o in outs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert out == undisturbed
    assert eng.num_rewinds == 1
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_past_the_stage_timeout_requests_end_with_an_error_and_later_ones_succeed():
    eng = pipeline_engine(stage_timeout=0.3)
    for i in range(4):
        eng.add_request(f"r{i}", [i + 1] * 5, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(6):
        eng.step()
    eng.executor.fail()
    start, finished = time.monotonic(), {}
    while eng.has_unfinished() and time.monotonic() - start < 5:
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o
    assert sorted(finished) == ["r0", "r1", "r2", "r3"]
    assert time.monotonic() - start >= 0.3
    for o in finished.values():
        assert o.finish_reason == "abort" and "pipeline stage 1 (10.0.0.2:7070) is unreachable" in o.error
        assert "--stage-timeout 0.3s" in o.error
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    eng.add_request("while-down", [9, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    (o,) = eng.step()
    assert o.finished and o.error  # still down: an answer at once, no wait
    assert "the pipeline has been down for" in o.error and "the request was refused" in o.error  # not "stopped"
    eng.executor.recover()
    eng.add_request("after", [9, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    out = run(eng)
    assert out["after"] == [echo_next([9, 9], 1000), echo_next([9, 9, out["after"][0]], 1000),
                            echo_next([9, 9, *out["after"][:2]], 1000)]


def test_async_streams_get_the_error_and_the_engine_lives_on():
    async def main():
        inner = pipeline_engine(stage_timeout=0.2)
        eng = AsyncEngine(inner)
        stream = eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=10_000, ignore_eos=True))
        await stream.__anext__()
        inner.executor.fail()
        with pytest.raises(RequestFailed, match="unreachable"):
            async for _ in stream:
                pass
        inner.executor.recover()
        got = [o async for o in eng.add_request("b", [4, 5], SamplingParams(max_tokens=3, ignore_eos=True))]
        assert sum(len(o.new_token_ids) for o in got) == 3 and eng.is_running
        await eng.shutdown()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_results_of_aborted_sequences_in_flight_are_skipped():
    eng = pipeline_engine()
    eng.add_request("keep", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    eng.add_request("drop", [4, 5, 6], SamplingParams(max_tokens=5, ignore_eos=True))
    first = eng.step()  # two micro-batches went out; the first ("keep") came back
    assert [o.request_id for o in first] == ["keep"] and len(eng.executor.pending) == 1
    eng.abort("drop")  # its prefill is still in flight
    out = run(eng)
    assert "drop" not in out and len(first[0].new_token_ids + out["keep"]) == 5
    check_echo_tokens([1, 2, 3], first[0].new_token_ids + out["keep"])


def overlap_workload(eng, rng_seed: int, fail_at: int = 0) -> dict[str, tuple[list[int], str | None]]:
    """Requests in two waves with stop tokens (vocab 40: stops come often), EOS, max_tokens,
    seeded sampling, a penalty now and then (the plain path), an abort of a sequence in flight,
    and, with `fail_at`, a fault at that step: tokens and finish reasons per request."""
    rng = random.Random(rng_seed)
    reqs = []
    for i in range(14):
        params = SamplingParams(max_tokens=rng.randrange(1, 40), stop_token_ids=(rng.randrange(3, 40),),
                                temperature=rng.choice([0.0, 0.9]), seed=rng.randrange(100), ignore_eos=i % 3 == 0)
        if i == 9:
            params = SamplingParams(max_tokens=20, ignore_eos=True)
        if i == 10:  # a penalty: the plain path while it runs
            params = SamplingParams(max_tokens=4, presence_penalty=0.5)
        reqs.append((f"r{i}", [rng.randrange(3, 40) for _ in range(rng.randrange(1, 10))], params))
    out: dict[str, tuple[list[int], str | None]] = {rid: ([], None) for rid, _, _ in reqs}
    for rid, prompt, params in reqs[:8]:
        eng.add_request(rid, prompt, params)
    for n in range(5000):
        if n == 12:
            for rid, prompt, params in reqs[8:]:
                eng.add_request(rid, prompt, params)
        if len(out["r9"][0]) >= 3 and "r9" in eng.seqs:  # in flight, and sent ahead once overlapping
            eng.abort("r9")
            out["r9"] = (out["r9"][0], "abort")
        if fail_at and n == fail_at:
            eng.executor.fail()
        if fail_at and n == fail_at + 5:
            eng.executor.recover()
        for o in eng.step():
            tokens, _ = out[o.request_id]
            out[o.request_id] = (tokens + o.new_token_ids, o.finish_reason)
        eng.check_integrity()
        if n > 12 and not eng.has_unfinished():
            break
    assert not eng.has_unfinished()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    return out


@pytest.mark.parametrize("fail_at", [0, 40], ids=["plain", "fault"])
def test_overlapped_ring_gives_the_plain_rings_tokens(fail_at):
    """One micro-batch in flight, decodes sent ahead with their tokens filled in by "stage 0"
    from the fed ids: the same tokens and finish reasons as without overlap, stops and an abort
    dropping steps sent ahead, a fault losing them."""
    kw = dict(num_blocks=96, max_num_seqs=16, depth=1, vocab_size=40, eos=(7,))
    want = overlap_workload(pipeline_engine(**kw), 3)
    eng = pipeline_engine(**kw, overlap=True)
    assert eng.overlap
    got = overlap_workload(eng, 3, fail_at)
    assert got == want
    ex = eng.executor
    assert {"stop", "length", "abort"} <= {r for _, r in want.values()}
    assert len(ex.fed) <= 1 and ex.discarded and eng.num_dropped == len(ex.discarded)
    assert sum(1 for _, n in ex.submitted) > 30
    assert pipeline_engine(**dict(kw, depth=2), overlap=True).overlap is False  # only with one micro-batch
