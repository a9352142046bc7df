"""Load: 200 concurrent streaming requests on SmolLM2 on the CPU all complete with the right token
counts and no errors, and leave nothing behind (no request in flight, every KV block free)."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from server_harness import start_server

CONCURRENCY = 200
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def live(smollm2_gguf):
    server = start_server(smollm2_gguf)
    yield server
    server.stop()


async def stream_one(session: aiohttp.ClientSession, live, i: int) -> dict:
    chat = i % 2 == 0
    body = {"model": live.engine.model_name, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.8, "seed": i}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Request {i}: count to ten."}]
    else:
        body["prompt"] = f"Request {i}: one, two,"
    url = live.api + ("/chat/completions" if chat else "/completions")
    async with session.post(url, json=body) as resp:
        events = []
        async for line in resp.content:
            if line.startswith(b"data: "):
                events.append(line[6:].strip())
        return {"status": resp.status, "chat": chat, "events": events}


def test_200_concurrent_streams(live):
    async def run():
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=900)) as s:
            return await asyncio.gather(*(stream_one(s, live, i) for i in range(CONCURRENCY)))

    results = asyncio.run(run())
    assert [r["status"] for r in results] == [200] * CONCURRENCY
    for r in results:
        assert r["events"][-1] == b"[DONE]"
        chunks = [json.loads(e) for e in r["events"][:-1]]
        assert not [c for c in chunks if "error" in c]
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert [f for f in finishes if f] == ["length"]
        pieces = [(c["choices"][0]["delta"].get("content", "") if r["chat"] else c["choices"][0]["text"])
                  for c in chunks if c["choices"]]
        assert "".join(pieces).strip() and sum(1 for p in pieces if p) <= MAX_TOKENS
    # a handler lets its slot go just after writing `[DONE]`, so the last one may still be on its way out
    deadline = time.monotonic() + 10
    while live.state.admission.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert live.state.admission.in_flight == 0
    stats = live.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    m = live.state.metrics
    assert m.requests.get("/v1/chat/completions", "200") + m.requests.get("/v1/completions", "200") >= CONCURRENCY
    assert m.generation_tokens.get() >= CONCURRENCY * MAX_TOKENS
