"""AsyncEngine: streams, aborts that free blocks, cancellation, a responsive event loop."""
from __future__ import annotations

import asyncio
import threading

import pytest

from flotilla.errors import FlotillaError
from flotilla.runtime.async_engine import AsyncEngine, EngineDeadError
from flotilla.runtime.sampling import SamplingParams

from fake_executor import check_echo_tokens, echo_engine, run_all


def params(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, **kw)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


async def collect(stream):
    tokens, last = [], None
    async for out in stream:
        tokens += out.new_token_ids
        last = out
    return tokens, last


def test_streams_give_the_same_tokens_as_the_sync_engine():
    prompts = {f"r{i}": [i + 1] * (3 + i) for i in range(10)}
    sync = echo_engine()
    for rid, p in prompts.items():
        sync.add_request(rid, p, params(12))
    want = run_all(sync)

    async def main():
        engine = AsyncEngine(echo_engine())
        streams = {rid: engine.add_request(rid, p, params(12)) for rid, p in prompts.items()}
        results = await asyncio.gather(*(collect(s) for s in streams.values()))
        await engine.shutdown()
        return dict(zip(streams, results))

    got = run(main())
    for rid, (tokens, last) in got.items():
        assert tokens == want[rid] and last.finished and last.finish_reason == "length"
        check_echo_tokens(prompts[rid], tokens)


def test_abort_of_50_in_flight_requests_frees_every_block():
    async def main():
        inner = echo_engine(num_blocks=300, block_size=4, max_num_seqs=32, max_num_batched_tokens=64)
        engine = AsyncEngine(inner)
        streams = [engine.add_request(f"r{i}", [i % 5 + 1] * 30, params(10_000, ignore_eos=True)) for i in range(50)]
        for s in streams[:32]:  # the first 32 are running: each has produced a token
            first = await s.__anext__()
            assert first.new_token_ids and not first.finished
        stats = engine.stats()
        assert stats.num_running + stats.num_waiting == 50 and stats.num_free_blocks < stats.num_total_blocks
        await asyncio.gather(*(engine.abort(f"r{i}") for i in range(50)))
        assert inner.block_manager.num_free_blocks == inner.block_manager.num_blocks == 299
        inner.check_integrity()
        for s in streams:  # every stream ends with an abort
            tokens, last = await collect(s)
            assert last is None or last.finish_reason == "abort"
        await engine.shutdown()

    run(main())


def test_cancelling_the_consumer_aborts_the_request():
    async def main():
        inner = echo_engine(num_blocks=100)
        engine = AsyncEngine(inner)
        stream = engine.add_request("c", [1, 2, 3, 4, 5], params(10_000, ignore_eos=True))
        started = asyncio.Event()

        async def consume():
            async for _ in stream:
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.abort("sentinel")  # one round trip through the engine thread
        assert inner.block_manager.num_free_blocks == inner.block_manager.num_blocks
        assert engine.stats().requests_finished_total["abort"] == 1
        await engine.shutdown()

    run(main())


def test_leaving_a_stream_early_aborts_it():
    async def main():
        inner = echo_engine(num_blocks=100)
        engine = AsyncEngine(inner)
        async with engine.add_request("e", [1, 2, 3], params(10_000, ignore_eos=True)) as stream:
            async for out in stream:
                break
        assert inner.block_manager.num_free_blocks == inner.block_manager.num_blocks
        assert not inner.has_unfinished()
        await engine.shutdown()

    run(main())


class GateExecutor:
    """Blocks inside every step until the test opens the gate."""

    def __init__(self, inner):
        self.inner, self.entered, self.gate = inner, threading.Event(), threading.Event()

    def execute(self, step):
        self.entered.set()
        assert self.gate.wait(timeout=30)
        return self.inner.execute(step)


def test_the_event_loop_runs_while_a_step_computes():
    async def main():
        inner = echo_engine()
        gate = GateExecutor(inner.executor)
        inner.executor = gate
        engine = AsyncEngine(inner)
        stream = engine.add_request("g", [1, 2, 3], params(2))
        await asyncio.get_running_loop().run_in_executor(None, gate.entered.wait)
        # the engine thread is now stuck inside a step: the loop still serves other work
        ticks = 0
        for _ in range(5):
            await asyncio.sleep(0)
            ticks += 1
        other = engine.add_request("h", [4, 5], params(1))  # accepted while the step runs
        assert ticks == 5 and engine.stats().steps_total == 0 and not stream.finished
        gate.gate.set()
        assert len((await collect(stream))[0]) == 2 and len((await collect(other))[0]) == 1
        await engine.shutdown()

    run(main())


def test_bad_requests_fail_at_once_and_errors_reach_streams():
    async def main():
        inner = echo_engine(num_blocks=5, block_size=4)
        engine = AsyncEngine(inner)
        with pytest.raises(FlotillaError, match="prompt tokens"):
            engine.add_request("long", list(range(40)), params(1))
        with pytest.raises(FlotillaError, match="needs a tokenizer"):
            engine.add_request("text", "hello", params(1))
        s = engine.add_request("dup", [1, 2], params(50, ignore_eos=True))
        with pytest.raises(FlotillaError, match="already in use"):
            engine.add_request("dup", [1, 2], params(1))
        await collect(s)

        def boom(step):
            raise RuntimeError("device lost")

        inner.executor.execute = boom
        doomed = engine.add_request("doomed", [1, 2], params(3))
        with pytest.raises(EngineDeadError, match="device lost"):
            await collect(doomed)
        with pytest.raises(EngineDeadError):
            engine.add_request("after", [1], params(1))
        await engine.abort("doomed")  # returns, does not hang

    run(main())
