"""Bad input gets a 4xx in OpenAI's error shape with a message that says what to fix, and the
server keeps serving; the queue bound answers 429 with Retry-After; the API key; /metrics."""
from __future__ import annotations

import asyncio
import http.client
import json
import re
import urllib.parse

import aiohttp
import openai
import pytest

import flotilla

from server_harness import start_server

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}


@pytest.fixture(scope="module")
def live(smollm2_gguf):
    server = start_server(smollm2_gguf)
    yield server
    server.stop()


def request(url: str, method: str, path: str, body: bytes | dict | None = None,
            headers: dict | None = None) -> tuple[int, dict, dict | str]:
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    raw = json.dumps(body).encode() if isinstance(body, dict) else body
    conn.request(method, path, body=raw, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    data = r.read().decode()
    conn.close()
    try:
        data = json.loads(data)
    except json.JSONDecodeError:
        pass
    return r.status, dict(r.getheaders()), data


def assert_good(live, path="/v1/chat/completions", body=CHAT):
    status, _, data = request(live.url, "POST", path, body)
    assert status == 200, data
    assert data["usage"]["completion_tokens"] == 1


def hello(n: int) -> str:
    return "hello " * n


BAD = [  # (path, body, status, param, words in the message)
    ("chat", b'{"model": "x", "messages": [', 400, None, ["not valid JSON", "line 1"]),
    ("chat", b"", 400, None, ["empty"]),
    ("chat", b"\xff\xfe{}", 400, None, ["UTF-8"]),
    ("chat", b"[1, 2, 3]", 400, None, ["must be a JSON object", "an array"]),
    ("chat", b'{"messages": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, None, ["nested too deeply"]),
    ("chat", b'{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": %s}'
     % (MODEL.encode(), b"1" * 5000), 400, None, ["integer of 5000 digits"]),
    ("completion", b'{"model": "%s", "prompt": "Hi", "max_tokens": %s}' % (MODEL.encode(), b"1" * 5000), 400, None,
     ["integer of 5000 digits"]),
    ("completion", b'{"model": "%s", "prompt": "Hi", "seed": -%s}' % (MODEL.encode(), b"9" * 65), 400, None,
     ["integer of 65 digits"]),
    ("chat", b'{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800b"}]}' % MODEL.encode(), 400,
     "messages[0].content", ["unpaired surrogate", "valid Unicode"]),
    ("chat", b'{"model": "%s", "messages": [{"role": "user", "content": "a"}], "stop": ["\\udc00"]}' % MODEL.encode(),
     400, "stop", ["unpaired surrogate"]),
    ("completion", b'{"model": "%s", "prompt": "\\ud83d"}' % MODEL.encode(), 400, "prompt", ["unpaired surrogate"]),
    ("chat", {"model": MODEL}, 400, "messages", ["'messages' is required"]),
    ("chat", {"model": MODEL, "messages": []}, 400, "messages", ["non-empty array", "got an empty array"]),
    ("chat", {"model": MODEL, "messages": "Hi"}, 400, "messages", ["non-empty array", "a string"]),
    ("chat", {"model": MODEL, "messages": [{"content": "Hi"}]}, 400, "messages[0].role", ["must be one of"]),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": {"a": 1}}]}, 400, "messages[0].content",
     ["string or an array of text parts"]),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content", ["only text content"]),
    ("chat", {**CHAT, "model": "gpt-4o"}, 404, "model", ["'gpt-4o' does not exist", MODEL]),
    ("chat", {**CHAT, "model": 7}, 400, "model", ["must be a string"]),
    ("chat", {**CHAT, "max_tokens": -5}, 400, "max_tokens", ["integer >= 1", "-5"]),
    ("chat", {**CHAT, "max_tokens": 0}, 400, "max_tokens", ["integer >= 1"]),
    ("chat", {**CHAT, "max_tokens": "10"}, 400, "max_tokens", ["an integer", "a string"]),
    ("chat", {**CHAT, "max_tokens": True}, 400, "max_tokens", ["an integer", "a boolean"]),
    ("chat", {**CHAT, "max_tokens": 10**9}, 400, "max_tokens", ["ask for at most"]),
    ("chat", {**CHAT, "max_completion_tokens": 10**6}, 400, "max_completion_tokens", ["ask for at most"]),
    ("chat", {**CHAT, "temperature": "hot"}, 400, "temperature", ["a number between 0 and 2"]),
    ("chat", {**CHAT, "temperature": 3}, 400, "temperature", ["between 0 and 2"]),
    ("chat", {**CHAT, "top_p": 0}, 400, "top_p", ["(0, 1]"]),
    ("chat", {**CHAT, "presence_penalty": 5}, 400, "presence_penalty", ["between -2 and 2"]),
    ("chat", {**CHAT, "seed": 2**64}, 400, "seed", ["integer between -9223372036854775808", "-1 for a random one"]),
    ("chat", {**CHAT, "stop": 5}, 400, "stop", ["a string or an array"]),
    ("chat", {**CHAT, "stop": ["a", ""]}, 400, "stop", ["non-empty strings"]),
    ("chat", {**CHAT, "n": 0}, 400, "n", ["between 1 and 8"]),
    ("chat", {**CHAT, "n": 100}, 400, "n", ["between 1 and 8"]),
    ("chat", {**CHAT, "stream": "yes"}, 400, "stream", ["true or false"]),
    ("chat", {**CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options", ["only allowed with"]),
    ("chat", {**CHAT, "logprobs": "yes"}, 400, "logprobs", ["true or false"]),
    ("chat", {**CHAT, "top_logprobs": 3}, 400, "top_logprobs", ["needs 'logprobs'"]),
    ("chat", {**CHAT, "top_logprobs": 50, "logprobs": True}, 400, "top_logprobs", ["between 0 and 20"]),
    ("chat", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools", ["not supported"]),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
              "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     400, "messages[1].tool_calls", ["not supported", "no tools"]),
    ("chat", {**CHAT, "response_format": {"type": "json_object"}}, 400, "response_format", ["not supported"]),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": hello(9000)}]}, 400, "messages",
     ["tokens of messages, but the context holds 8192", "shorten"]),
    ("completion", {**COMPLETION, "prompt": hello(9000)}, 400, "prompt", ["context holds 8192"]),
    ("completion", {"model": MODEL}, 400, "prompt", ["'prompt' is required"]),
    ("completion", {**COMPLETION, "prompt": ""}, 400, "prompt", ["empty"]),
    ("completion", {**COMPLETION, "prompt": []}, 400, "prompt", ["must be a string"]),
    ("completion", {**COMPLETION, "prompt": [1.5]}, 400, "prompt", ["prompt[0]"]),
    ("completion", {**COMPLETION, "prompt": [1, 10**7]}, 400, "prompt", ["out of range"]),
    ("completion", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens", ["0 only with echo"]),
    ("chat", {**CHAT, "echo": True}, 400, "echo", ["not supported for chat"]),
    ("completion", {**COMPLETION, "best_of": 3}, 400, "best_of", ["equals 'n'"]),
    ("completion", {**COMPLETION, "logprobs": 99}, 400, "logprobs", ["between 0 and 20"]),
    ("completion", {**COMPLETION, "max_tokens": -1}, 400, "max_tokens", ["integer >= 1"]),
]


@pytest.mark.parametrize("path,body,status,param,words", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_a_4xx_that_says_what_to_fix(live, path, body, status, param, words):
    url = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    got, _, data = request(live.url, "POST", url, body)
    assert got == status, data
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert err["param"] == param
    for word in words:
        assert word in err["message"], (word, err["message"])
    assert_good(live, url, CHAT if path == "chat" else COMPLETION)


def test_oversized_body_gets_413(live):
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * (3 * 1024 * 1024)}]}).encode()
    status, _, data = request(live.url, "POST", "/v1/chat/completions", big)
    assert status == 413 and "limit is 2097152 bytes" in data["error"]["message"]
    assert_good(live)


def test_unknown_paths_and_methods(live):
    status, _, data = request(live.url, "GET", "/v1/chat/completion")
    assert status == 404 and "POST /v1/chat/completions" in data["error"]["message"]
    status, _, data = request(live.url, "GET", "/v1/chat/completions")
    assert status == 405 and "use POST" in data["error"]["message"]
    _, _, metrics = request(live.url, "GET", "/metrics")  # counted under its route, not as an unknown path
    assert re.search(r'flotilla_requests_total\{endpoint="/v1/chat/completions",status="405"\} [1-9]', metrics)
    assert re.search(r'flotilla_requests_total\{endpoint="unmatched",status="404"\} [1-9]', metrics)
    assert_good(live)


def test_the_openai_client_surfaces_our_errors(live):
    with openai.OpenAI(base_url=live.api, api_key="x", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=-1)
        assert e.value.status_code == 400 and e.value.param == "max_tokens"
        assert "'max_tokens' must be an integer >= 1" in e.value.message
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
        assert e.value.code == "model_not_found"


def test_health_and_metrics(live):
    status, _, data = request(live.url, "POST", "/v1/completions", {**COMPLETION, "max_tokens": 4, "ignore_eos": True})
    assert status == 200 and data["usage"]["completion_tokens"] == 4
    request(live.url, "POST", "/v1/chat/completions", {"model": MODEL})
    status, _, health = request(live.url, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["problems"] == [] and health["model"] == MODEL
    u = urllib.parse.urlparse(live.url)
    conn = http.client.HTTPConnection(u.hostname, u.port)
    conn.request("GET", "/metrics")
    r = conn.getresponse()
    text = r.read().decode()
    assert r.getheader("Content-Type").startswith("text/plain; version=0.0.4")
    samples = parse_exposition(text)
    assert samples[('flotilla_requests_total', (("endpoint", "/v1/chat/completions"), ("status", "200")))] >= 1
    assert samples[('flotilla_requests_total', (("endpoint", "/v1/chat/completions"), ("status", "400")))] >= 1
    assert samples[("flotilla_generation_tokens_total", ())] >= 1
    assert samples[("flotilla_prompt_tokens_total", ())] >= 1
    for name in ("flotilla_queue_depth", "flotilla_running_sequences", "flotilla_kv_cache_usage_ratio"):
        assert (name, ()) in samples
    for hist in ("flotilla_time_to_first_token_seconds", "flotilla_inter_token_latency_seconds"):
        buckets = sorted((float(dict(k[1])["le"]), v) for k, v in samples.items() if k[0] == hist + "_bucket")
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and buckets[-1][0] == float("inf")
        assert counts[-1] == samples[(hist + "_count", ())] > 0
    # the completion above ran out of max_tokens: a finished "length" sequence of 4 generated tokens
    assert samples[("flotilla_request_success_total", (("finished_reason", "length"),))] >= 1
    assert ("flotilla_request_success_total", (("finished_reason", "abort"),)) in samples
    assert samples[("flotilla_request_generation_tokens_bucket", (("le", "5"),))] >= 1
    queried = samples[("flotilla_prefix_cache_queries_total", ())]
    assert queried >= samples[("flotilla_request_prompt_tokens_sum", ())] > 0
    assert 0 <= samples[("flotilla_prefix_cache_hits_total", ())] <= queried
    assert ("flotilla_preemptions_total", ()) in samples
    finished = sum(v for (n, _), v in samples.items() if n == "flotilla_request_success_total")
    for phase in ("prefill", "decode", "inference"):  # every finished sequence that had a token
        assert 1 <= samples[(f"flotilla_request_{phase}_time_seconds_count", ())] <= finished
    assert samples[("flotilla_request_queue_time_seconds_count", ())] >= 1


LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')


def parse_exposition(text: str) -> dict:
    """Prometheus text format -> {(name, ((label, value), ...)): value}; every line must parse."""
    out, typed = {}, set()
    for line in text.strip().split("\n"):
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
            continue
        if line.startswith("#"):
            continue
        m = LINE.match(line)
        assert m, line
        labels = tuple(re.findall(r'([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        assert re.sub(r"_(bucket|sum|count)$", "", m.group(1)) in typed, line
        out[(m.group(1), labels)] = float(m.group(4))
    return out


def test_queue_bound_gets_429_with_retry_after(smollm2_gguf):
    server = start_server(smollm2_gguf, engine={"max_num_seqs": 2}, max_queue=2)
    capacity = server.engine.max_num_seqs + 2

    async def run():
        async with aiohttp.ClientSession() as s:
            body = {**COMPLETION, "max_tokens": 500, "ignore_eos": True, "stream": True}
            never = await s.post(server.api + "/completions", json={**body, "n": capacity + 1})  # an idle server
            assert never.status == 400 and "Retry-After" not in never.headers
            assert (await never.json())["error"]["code"] == "too_many_sequences"
            held = [await s.post(server.api + "/completions", json=body) for _ in range(capacity)]
            assert [r.status for r in held] == [200] * capacity  # admitted: headers came back
            assert server.state.admission.in_flight == capacity
            over = await s.post(server.api + "/completions", json=body)
            over_ws = await s.ws_connect(server.ws_url)
            await over_ws.receive()  # ready
            await over_ws.send_json({"type": "chat", "messages": [{"role": "user", "content": "Hi"}]})
            ws_error = json.loads((await over_ws.receive()).data)
            result = over.status, over.headers.get("Retry-After"), await over.json(), ws_error
            for r in held:
                r.close()  # the clients leave: their requests are aborted
            await over_ws.close()
            for _ in range(400):
                if server.state.admission.in_flight == 0:
                    break
                await asyncio.sleep(0.05)
            return result

    try:
        status, retry_after, body, ws_error = asyncio.run(run())
        assert status == 429 and retry_after == "1"
        assert body["error"]["code"] == "queue_full" and "retry after" in body["error"]["message"]
        assert ws_error["type"] == "error" and ws_error["code"] == 429
        assert server.state.admission.in_flight == 0
        assert_good(server)
    finally:
        server.stop()


def test_api_key(smollm2_gguf):
    server = start_server(smollm2_gguf, api_key="sekrit")
    try:
        status, _, data = request(server.url, "POST", "/v1/chat/completions", CHAT)
        assert status == 401 and "Authorization: Bearer" in data["error"]["message"]
        assert data["error"]["type"] == "authentication_error"
        status, _, data = request(server.url, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert status == 401 and "wrong API key" in data["error"]["message"]
        assert request(server.url, "GET", "/metrics")[0] == 200  # as vLLM's: Prometheus scrapes with no token
        status, _, health = request(server.url, "GET", "/health")
        assert status == 200 and health["status"] == "ok" and health["auth_required"] is True
        for method in ("GET", "POST"):  # vLLM's /ping: the same answer
            status, _, ping = request(server.url, method, "/ping")
            assert status == 200 and ping["status"] == "ok"
        status, _, version = request(server.url, "GET", "/version")
        assert status == 200 and version == {"version": flotilla.__version__}
        assert request(server.url, "GET", "/")[0] == 200  # the page itself holds no secret
        with openai.OpenAI(base_url=server.api, api_key="sekrit", max_retries=0) as client:
            r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
            assert r.usage.completion_tokens >= 1
        with openai.OpenAI(base_url=server.api, api_key="nope", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError):
                client.models.list()

        async def ws():
            async with aiohttp.ClientSession() as s:
                bad = await s.ws_connect(server.ws_url)
                msg = await bad.receive()
                good = await s.ws_connect(server.ws_url + "?api_key=sekrit")
                ready = json.loads((await good.receive()).data)
                await good.close()
                return msg, bad.close_code, ready
        msg, code, ready = asyncio.run(ws())
        assert msg.type == aiohttp.WSMsgType.CLOSE and code == 1008 and "api_key" in msg.extra
        assert ready["type"] == "ready"
    finally:
        server.stop()


def test_model_may_be_left_out_and_seed_minus_one_is_random(live):
    body = {k: v for k, v in CHAT.items() if k != "model"}
    status, _, data = request(live.url, "POST", "/v1/chat/completions", {**body, "seed": -1})
    assert status == 200 and data["model"] == MODEL, data
    status, _, data = request(live.url, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 1})
    assert status == 200 and data["model"] == MODEL, data
    status, _, data = request(live.url, "POST", "/v1/chat/completions", {**body, "model": ""})  # "the default"
    assert status == 200 and data["model"] == MODEL, data


def test_any_64_bit_seed_is_a_seed(live):
    """OpenAI and vLLM take any 64-bit integer; a negative one (but -1, llama.cpp's "random") is a fixed seed."""
    body = {**CHAT, "temperature": 1.0, "max_tokens": 8}
    texts = [request(live.url, "POST", "/v1/chat/completions", {**body, "seed": s})[2]["choices"][0]["message"]["content"]
             for s in (-5, -5, 2**64 - 1)]
    assert texts[0] == texts[1], texts


def test_a_body_that_is_not_json_gets_415(live):
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        status, headers, data = request(live.url, "POST", "/v1/chat/completions", CHAT, {"Content-Type": ctype})
        assert status == 415, (ctype, data)
        assert data["error"]["code"] == "unsupported_media_type"
        assert "Content-Type: application/json" in data["error"]["message"] and ctype in data["error"]["message"]
    status, _, _ = request(live.url, "POST", "/v1/chat/completions", CHAT,
                           {"Content-Type": "application/json; charset=utf-8"})
    assert status == 200


def test_404_lists_every_endpoint_the_server_has(live):
    status, _, data = request(live.url, "GET", "/v1/embeddings")
    assert status == 404 and data["error"]["code"] == "not_found", data
    msg = data["error"]["message"]
    for endpoint in ("POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /v1/models/{model}",
                     "GET /ws", "GET /health", "GET /ping", "POST /ping", "GET /version", "GET /metrics",
                     "POST /tokenize", "POST /detokenize", "GET /tokenizer_info", "GET /"):
        assert endpoint in msg, (endpoint, msg)
    assert "HEAD" not in msg and "/static" not in msg


def test_405_names_the_allowed_methods_in_allow(live):
    status, headers, data = request(live.url, "POST", "/v1/models")
    assert status == 405 and set(headers["Allow"].split(",")) == {"GET", "HEAD"}, headers
    assert data["error"]["code"] == "method_not_allowed"


def test_static_files_and_a_missing_one(live):
    status, headers, body = request(live.url, "GET", "/static/chat.js")
    assert status == 200 and "websocket" in body.lower()
    status, headers, body = request(live.url, "GET", "/")  # the page: never inside another site's frame
    assert status == 200 and headers["X-Frame-Options"] == "DENY"
    assert headers["Content-Security-Policy"] == "frame-ancestors 'none'"
    for path in ("/static/nope.js", "/static/", "/static/..%2Fapp.py"):
        status, headers, data = request(live.url, "GET", path)
        assert status == 404 and data["error"]["type"] == "not_found_error", (path, data)
    _, _, metrics = request(live.url, "GET", "/metrics")
    assert re.search(r'flotilla_requests_total\{endpoint="/static/\{name\}",status="404"\} [1-9]', metrics)


def ws_handshake(url: str, origin: str | None, query: str = "", headers: dict | None = None) -> tuple[int, str]:
    """(101, the first frame's type), or (the close code, its reason) where the server closes at once."""
    async def go():
        h = {**({"Origin": origin} if origin else {}), **(headers or {})}
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(url + "/ws" + query, headers=h) as ws:
                msg = await ws.receive()
                if msg.type == aiohttp.WSMsgType.TEXT:
                    return 101, json.loads(msg.data)["type"]
                return ws.close_code, msg.extra
    return asyncio.run(go())


def test_websocket_refuses_pages_of_other_origins(live):
    u = urllib.parse.urlparse(live.url)
    assert ws_handshake(live.url, None) == (101, "ready")  # not a browser
    assert ws_handshake(live.url, f"http://{u.hostname}:{u.port}") == (101, "ready")  # the chat page
    # behind a proxy that passes the Host and the scheme on (deploy/nginx.conf): the page's scheme is the proxy's
    https = {"X-Forwarded-Proto": "https"}
    assert ws_handshake(live.url, "https://chat.example.com", headers={**https, "Host": "chat.example.com"}) \
        == (101, "ready")
    assert ws_handshake(live.url, "https://chat.example.com", headers={**https, "X-Forwarded-Host": "chat.example.com"}) \
        == (101, "ready")
    assert ws_handshake(live.url, "https://chat.example.com", headers={"Host": "chat.example.com"})[0] == 4003
    code, reason = ws_handshake(live.url, "https://evil.example.com")
    assert code == 4003 and "--allowed-origins https://evil.example.com" in reason
    code, reason = ws_handshake(live.url, "null")
    assert code == 4003 and "no origin" in reason
    # the HTTP API: a preflight from another site is refused, so is a post that needs none (no Content-Type),
    # and no answer carries Access-Control-Allow-Origin
    evil = {"Origin": "https://evil.example.com"}
    status, headers, data = request(live.url, "OPTIONS", "/v1/chat/completions", None,
                                    {**evil, "Access-Control-Request-Method": "POST"})
    assert status == 403 and "--allowed-origins https://evil.example.com" in data["error"]["message"]
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.putrequest("POST", "/v1/completions", skip_accept_encoding=True)
    body = json.dumps(COMPLETION).encode()
    for k, v in {**evil, "Content-Length": str(len(body))}.items():
        conn.putheader(k, v)
    conn.endheaders(body)
    r = conn.getresponse()
    assert r.status == 403 and b"origin_not_allowed" in r.read()
    conn.close()
    status, headers, _ = request(live.url, "GET", "/v1/models", None, evil)
    assert status == 200 and "Access-Control-Allow-Origin" not in headers and headers["Vary"] == "Origin"


def test_allowed_origins_get_cors_and_the_websocket(smollm2_gguf):
    server = start_server(smollm2_gguf, allowed_origins=("http://LocalHost:3000/",), api_key="k3y")
    try:
        ok = {"Origin": "http://localhost:3000"}
        status, headers, _ = request(server.url, "OPTIONS", "/v1/chat/completions", None, {
            **ok, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"})
        assert status == 204 and headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
        assert "POST" in headers["Access-Control-Allow-Methods"]
        assert headers["Access-Control-Allow-Headers"] == "authorization,content-type"
        status, headers, _ = request(server.url, "POST", "/v1/chat/completions", CHAT,
                                     {**ok, "Authorization": "Bearer k3y"})
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
        status, headers, _ = request(server.url, "POST", "/v1/chat/completions", CHAT, ok)  # errors say so too
        assert status == 401 and headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
        assert ws_handshake(server.url, "http://localhost:3000", "?api_key=k3y") == (101, "ready")
        assert ws_handshake(server.url, "http://localhost:3001", "?api_key=k3y")[0] == 4003
    finally:
        server.stop()


def test_allowed_origins_are_checked_at_start():
    from flotilla.errors import FlotillaError
    from flotilla.server.config import ServerConfig, parse_origins

    assert parse_origins(" http://a.example:3000/ ,*") == ("http://a.example:3000", "*")
    for bad in ("http://*.example.com", "example.com", "http://u@example.com", "ftp://example.com", "http://x/y"):
        with pytest.raises(FlotillaError, match="is not an origin"):
            ServerConfig(allowed_origins=(bad,))
