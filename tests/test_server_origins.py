"""Origins as a browser sees them (scheme, host and port; another port or another name of the same
address is another site), one CORS answer for a preflight and the request it announces, a foreign
page refused before anything generates; /metrics open with --api-key; a request aiohttp cannot
parse logged in one line. A scripted fake engine (no model) behind a real server on loopback."""
from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from aiohttp.test_utils import make_mocked_request

from flotilla.server.config import ServerConfig
from flotilla.server.origins import CLOSE_ORIGIN, is_same_origin
from flotilla.server.serve import Server
from flotilla.server.state import ServerState
from test_server_fake_engine import FakeEngine


class CountingEngine(FakeEngine):
    def __init__(self):
        super().__init__()
        self.generated = 0

    async def generate(self, request_id, prompt_ids, params):
        self.generated += 1
        async for out in super().generate(request_id, prompt_ids, params):
            yield out


def serve(config: ServerConfig, coro_fn):
    engine = CountingEngine()

    async def run():
        server = Server(ServerState(config, engine))
        await server.start()
        try:
            async with aiohttp.ClientSession() as session:
                return await coro_fn(server, session, engine)
        finally:
            await server.drain()
    return asyncio.run(run())


COMPLETION = {"model": "fake", "prompt": "hi", "max_tokens": 2}
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}


async def browser(s: aiohttp.ClientSession, url: str, origin: str, key: str | None = None) -> dict:
    """What a page on `origin` gets from the server at `url`: the preflight's status and grant, the post's
    status, grant and error code, the websocket's first frame type or close code."""
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    out = {}
    async with s.options(url + "/v1/completions", headers={"Origin": origin, **PREFLIGHT}) as r:
        out["preflight"] = r.status, r.headers.get("Access-Control-Allow-Origin")
    async with s.post(url + "/v1/completions", json=COMPLETION, headers={"Origin": origin, **auth}) as r:
        body = await r.json()
        out["post"] = r.status, r.headers.get("Access-Control-Allow-Origin"), (body.get("error") or {}).get("code")
    query = f"?api_key={key}" if key else ""
    async with s.ws_connect(url.replace("http", "ws") + "/ws" + query, headers={"Origin": origin}) as ws:
        msg = await ws.receive()
        out["ws"] = "ready" if msg.type == aiohttp.WSMsgType.TEXT else ws.close_code
    return out


REFUSED = {"preflight": (403, None), "post": (403, None, "origin_not_allowed"), "ws": CLOSE_ORIGIN}


def test_another_port_scheme_or_loopback_name_is_another_origin():
    async def go(server, s, engine):
        port = int(server.url.rsplit(":", 1)[1])
        own = await browser(s, server.url, f"http://127.0.0.1:{port}")
        assert own == {"preflight": (204, f"http://127.0.0.1:{port}"), "post": (200, f"http://127.0.0.1:{port}", None),
                       "ws": "ready"}
        assert engine.generated == 1
        # the audit's case: another port of the same host; then another scheme; then the same port under
        # another name of the loopback address (a page opened at http://localhost:PORT calling 127.0.0.1)
        for origin in (f"http://127.0.0.1:{port + 1}", "http://127.0.0.1", f"https://127.0.0.1:{port}",
                       f"http://localhost:{port}", f"http://[::1]:{port}"):
            assert await browser(s, server.url, origin) == REFUSED, origin
        assert engine.generated == 1  # refused before anything generated
        async with s.post(server.url + "/v1/completions", json=COMPLETION,
                          headers={"Origin": f"http://localhost:{port}"}) as r:
            message = (await r.json())["error"]["message"]
        assert f"this server is http://127.0.0.1:{port}" in message
        assert f"--allowed-origins http://localhost:{port}" in message
        # the chat page opened under the other name talks to that name: its own origin
        async with s.post(server.url + "/v1/completions", json=COMPLETION,
                          headers={"Origin": f"http://localhost:{port}", "Host": f"localhost:{port}"}) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == f"http://localhost:{port}"
    serve(ServerConfig(port=0), go)


def test_an_allowed_origin_gets_the_same_grant_on_the_preflight_and_the_request():
    async def go(server, s, engine):
        ok = await browser(s, server.url, "http://localhost:3000", key="k")
        assert ok == {"preflight": (204, "http://localhost:3000"), "post": (200, "http://localhost:3000", None),
                      "ws": "ready"}
        assert await browser(s, server.url, "http://localhost:3001", key="k") == REFUSED
        assert engine.generated == 1
    serve(ServerConfig(port=0, api_key="k", allowed_origins=("http://localhost:3000",)), go)


@pytest.mark.parametrize("headers, origin, same", [
    ({"Host": "example.com"}, "http://example.com", True),
    ({"Host": "example.com"}, "http://example.com:80", True),  # the default port implied
    ({"Host": "example.com:80"}, "http://example.com", True),
    ({"Host": "example.com"}, "http://example.com:8080", False),
    ({"Host": "example.com:8080"}, "http://example.com:8081", False),
    ({"Host": "Example.COM:8080"}, "http://example.com:8080", True),
    ({"Host": "example.com"}, "https://example.com", False),  # plain HTTP reached us
    ({"Host": "[::1]:8000"}, "http://[::1]:8000", True),
    ({"Host": "[::1]:8000"}, "http://127.0.0.1:8000", False),
    ({"Host": "127.0.0.1:8000"}, "http://localhost:8000", False),
    ({"Host": "example.com"}, "null", False),
    ({"Host": "example.com"}, "ftp://example.com", False),
    # behind a proxy (X-Forwarded-* or Forwarded): the host name only; the scheme and port a proxy reports are
    # its own listener's (nginx in a container published on another port, TLS ended before the proxy)
    ({"Host": "example.com", "X-Forwarded-Proto": "https"}, "https://example.com", True),
    ({"Host": "internal:8001", "X-Forwarded-Host": "example.com:8443", "X-Forwarded-Proto": "https"},
     "https://example.com:8443", True),
    ({"Host": "proxy", "X-Forwarded-Proto": "http", "X-Forwarded-Port": "8000"}, "http://proxy", True),  # -p 80:8000
    ({"Host": "chat.example.com", "X-Forwarded-Proto": "http"}, "https://chat.example.com", True),  # TLS before it
    ({"Host": "chat.example.com", "Forwarded": "for=10.0.0.1;proto=https"}, "https://chat.example.com", True),
    ({"Host": "example.com", "X-Forwarded-Proto": "http"}, "http://example.com:8000", True),
    ({"Host": "example.com", "X-Forwarded-Proto": "http"}, "http://evil.example:8000", False),
    # X-Forwarded-For alone (a forward proxy on the browser's side adds it): a direct request's strict check
    ({"Host": "example.com", "X-Forwarded-For": "10.0.0.1"}, "http://example.com:8000", False),
    ({"Host": "example.com:8000", "X-Forwarded-For": "10.0.0.1"}, "http://example.com:8000", True),
    ({"Host": "internal", "X-Forwarded-Host": "example.com"}, "https://internal", False),
])
def test_same_origin_is_scheme_host_and_port(headers, origin, same):
    assert is_same_origin(make_mocked_request("GET", "/ws", headers=headers), origin) is same


def test_metrics_and_health_need_no_key_the_api_and_websocket_do():
    async def go(server, s, engine):
        async with s.get(server.url + "/metrics") as r:
            assert r.status == 200 and "flotilla_requests_total" in await r.text()
        async with s.get(server.url + "/health") as r:
            assert r.status == 200
        async with s.get(server.url + "/v1/models") as r:
            assert r.status == 401
        async with s.post(server.url + "/v1/completions", json=COMPLETION) as r:
            assert r.status == 401
        async with s.ws_connect(server.url.replace("http", "ws") + "/ws") as ws:
            await ws.receive()
            assert ws.close_code == aiohttp.WSCloseCode.POLICY_VIOLATION
        async with s.get(server.url + "/v1/models", headers={"Authorization": "Bearer k"}) as r:
            assert r.status == 200
    serve(ServerConfig(port=0, api_key="k"), go)


def test_a_malformed_request_is_one_log_line_without_a_traceback(caplog):
    async def go(server, s, engine):
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        answer = await reader.read()
        writer.close()
        async with s.get(server.url + "/health") as r:  # the server goes on serving
            assert r.status == 200
        return answer

    with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
        answer = serve(ServerConfig(port=0), go)
    assert answer.split(b"\r\n")[0].endswith(b" 400 Bad Request"), answer  # aiohttp's own answer, text/plain
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert len(records) == 1, records
    record = records[0]
    assert record.levelno == logging.WARNING and record.exc_info is None and record.exc_text is None
    assert record.getMessage() == ("refused a malformed HTTP request from 127.0.0.1 (BadHttpMessage): "
                                   "Duplicate 'Content-Type' header found.")
    assert "Traceback" not in caplog.text
