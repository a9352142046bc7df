"""Server paths that need a misbehaving engine, with a scripted fake one (no model): /health
naming the engine's problems, a dead engine as 503, a bug mid-stream ending the stream with an
error event, and the drain closing websockets with 1001."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from flotilla.server.config import ServerConfig
from flotilla.server.engine_client import EngineStats, EngineUnavailable, StepOutput
from flotilla.server.serve import Server
from flotilla.server.state import ServerState
from test_server_units import StubTokenizer


class FakeEngine:
    model_name = "fake"
    max_model_len = 64
    max_num_seqs = 2

    def __init__(self, fail_start: Exception | None = None, fail_at: int | None = None, problems=()):
        self.tokenizer = StubTokenizer()
        self.fail_start, self.fail_at, self._problems = fail_start, fail_at, list(problems)

    async def start(self):
        pass

    async def shutdown(self):
        pass

    async def generate(self, request_id, prompt_ids, params):
        if self.fail_start is not None:
            raise self.fail_start
        for i in range(params.max_tokens):
            if i == self.fail_at:
                raise RuntimeError("a bug in the engine")
            await asyncio.sleep(0.01)
            yield StepOutput((65 + i,), chr(65 + i), "length" if i == params.max_tokens - 1 else None)

    async def abort(self, request_id):
        pass

    async def abort_all(self):
        pass

    def stats(self):
        return EngineStats(0, 0, 10, 10)

    def problems(self):
        return self._problems


def serve(engine, coro_fn, **config):
    async def run():
        server = Server(ServerState(ServerConfig(port=0, **config), engine))
        await server.start()
        try:
            async with aiohttp.ClientSession() as session:
                return await coro_fn(server, session)
        finally:
            if server.runner.server is not None:
                await server.drain()
    return asyncio.run(run())


BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_health_names_the_engine_problems():
    async def go(server, s):
        async with s.get(server.url + "/health") as r:
            return r.status, await r.json()
    status, body = serve(FakeEngine(problems=["pipeline stage 2 (host b:7070) is not answering"]), go)
    assert status == 503 and body["status"] == "unhealthy"
    assert body["problems"] == ["pipeline stage 2 (host b:7070) is not answering"]


def test_a_dead_engine_is_a_503_not_a_500():
    async def go(server, s):
        async with s.post(server.url + "/v1/chat/completions", json=BODY) as r:
            return r.status, await r.json()
    status, body = serve(FakeEngine(fail_start=EngineUnavailable("the engine loop died")), go)
    assert status == 503 and body["error"]["code"] == "engine_unavailable"
    assert "the engine loop died" in body["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_bug_mid_request_is_reported_in_openai_shape(stream):
    async def go(server, s):
        async with s.post(server.url + "/v1/chat/completions", json={**BODY, "stream": stream}) as r:
            return r.status, await r.text()
    status, text = serve(FakeEngine(fail_at=2), go)
    if not stream:
        assert status == 500 and json.loads(text)["error"]["code"] == "internal_error"
        return
    assert status == 200
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "internal_error"
    assert "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-2]) == "AB"


def test_drain_closes_websockets_with_1001():
    async def go(server, s):
        ws = await s.ws_connect(server.url + "/ws")
        assert json.loads((await ws.receive()).data)["type"] == "ready"
        drain = asyncio.create_task(server.drain())
        msg = await ws.receive()
        await drain
        return msg.type, ws.close_code, msg.extra
    kind, code, reason = serve(FakeEngine(), go)
    assert kind == aiohttp.WSMsgType.CLOSE and code == 1001 and "shutting down" in reason


def test_a_body_that_stalls_gets_408_and_the_server_answers_others():
    """A client that announces 100 bytes and sends 10 (a slowloris) gets a 408 once the body timeout passes,
    not a connection held for ever (ServerConfig.body_timeout, 60 s)."""
    async def go(server, s):
        host, port = server.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")
        await writer.drain()
        async with s.post(server.url + "/v1/chat/completions", json=BODY) as r:  # served meanwhile
            other = r.status
        head = await asyncio.wait_for(reader.read(4096), 10)
        writer.close()
        return other, head.decode()
    other, head = serve(FakeEngine(), go, body_timeout=0.5)
    assert other == 200
    assert head.startswith("HTTP/1.1 408") and "did not arrive within 0.5 s" in head, head


@pytest.mark.parametrize("aiohttp_timer", [True, False], ids=["with-aiohttps-timer", "ours-alone"])
def test_a_connection_without_a_whole_request_is_closed_after_the_idle_timeout(aiohttp_timer, monkeypatch):
    """Headers that never end, a connection that sends nothing, a kept-alive one between requests: each is closed
    once idle_timeout passes (an audit held 20 000 such connections open until the server ran out of descriptors),
    while a stream longer than that timeout runs to its end. Also where aiohttp closes only kept-alive
    connections (its releases before late 2026): the server's own timer closes those that never brought a
    request."""
    if not aiohttp_timer:
        from flotilla.server import serve as serve_module

        real = serve_module.web.AppRunner
        monkeypatch.setattr(serve_module.web, "AppRunner",
                            lambda app, **kw: real(app, **{**kw, "keepalive_timeout": 3600}))
    async def go(server, s):
        host, port = server.url.removeprefix("http://").split(":")
        partial = await asyncio.open_connection(host, int(port))
        partial[1].write(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # no blank line: the headers never end
        silent = await asyncio.open_connection(host, int(port))
        kept = await asyncio.open_connection(host, int(port))
        kept[1].write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        loop = asyncio.get_running_loop()
        start = loop.time()
        body = {**BODY, "max_tokens": 40, "stream": True}  # 40 tokens 10 ms apart: longer than the timeout
        async with s.post(server.url + "/v1/chat/completions", json=body) as r:
            streamed = (await r.text()).count("data: ")
        closed = []
        for reader, writer in (partial, silent, kept) if aiohttp_timer else (partial, silent):
            while await asyncio.wait_for(reader.read(4096), 5):  # the kept one's response first, then EOF
                pass
            closed.append(loop.time() - start)
            writer.close()
        kept[1].close()
        return streamed, closed
    streamed, closed = serve(FakeEngine(), go, idle_timeout=0.2)
    assert streamed >= 41 and len(closed) == 2 + aiohttp_timer and all(t < 4 for t in closed), (streamed, closed)


def test_failing_accepts_are_reported_once_a_minute_with_their_count(capsys):
    from flotilla.server.serve import quiet_accept_errors

    async def go():
        loop = asyncio.get_running_loop()
        others = []
        loop.set_exception_handler(lambda loop, context: others.append(context["message"]))
        quiet_accept_errors(loop, 60.0)
        error = OSError(24, "Too many open files")
        for _ in range(1000):
            loop.call_exception_handler({"message": "socket.accept() out of system resource", "exception": error})
        loop.call_exception_handler({"message": "something else"})
        return others
    assert asyncio.run(go()) == ["something else"]
    err = capsys.readouterr().err
    assert err.count("cannot accept connections (Too many open files; 1 times") == 1 and err.count("\n") == 1, err


def test_a_quiet_websocket_outlives_the_idle_timeout():
    async def go(server, s):
        ws = await s.ws_connect(server.url + "/ws")
        assert json.loads((await ws.receive()).data)["type"] == "ready"
        await asyncio.sleep(0.6)  # three idle timeouts without a word
        await ws.send_json({"type": "ping"})
        reply = await asyncio.wait_for(ws.receive(), 5)
        await ws.close()
        return reply.type
    assert serve(FakeEngine(), go, idle_timeout=0.2) == aiohttp.WSMsgType.TEXT


def test_too_many_prompts_are_refused_before_any_is_tokenized(monkeypatch):
    """prompts x n past what the server holds at once is a 400 said before the prompts are tokenized (an audit's
    450 000 one-letter prompts took 22 s of tokenizing to reach that answer)."""
    encoded = []
    engine = FakeEngine()
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text, *a, **k: encoded.append(text) or [65])

    async def go(server, s):
        body = {"model": "fake", "prompt": ["a"] * 300, "n": 2, "max_tokens": 1}  # 600 > 2 slots + 512 queued
        async with s.post(server.url + "/v1/completions", json=body) as r:
            return r.status, (await r.json())["error"]["code"]
    assert serve(engine, go) == (400, "too_many_sequences") and encoded == []
