"""The websocket's edges, on a scripted fake engine (no model): a reply that fails after its "start"
ends with an error frame and "done" whatever the failure, `fit_context` drops the oldest turns
exactly as far as needed, the API key's scheme in any case, and a frame over the size limit
answered with a 413 error frame on a socket that stays open."""
from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest

from flotilla.errors import FlotillaError
from flotilla.server.config import ServerConfig
from flotilla.server.engine_client import EngineUnavailable
from flotilla.server.errors import ApiError
from flotilla.server.serve import Server
from flotilla.server.state import ServerState
from flotilla.server.websocket import fit_context
from test_server_fake_engine import FakeEngine
from test_server_units import StubModel, StubTokenizer


class ByteTokenizer(StubTokenizer):
    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id])


class Engine(FakeEngine):
    """FakeEngine with every tokenizer method the server calls."""

    def __init__(self):
        super().__init__()
        self.tokenizer = ByteTokenizer()


class FailingEngine(Engine):
    """Its first request fails with `error` after `at` tokens; later ones stream as FakeEngine's."""

    def __init__(self, error: BaseException, at: int = 2):
        super().__init__()
        self.error, self.at, self.failed = error, at, False

    async def generate(self, request_id, prompt_ids, params):
        async for i, out in _enumerate(super().generate(request_id, prompt_ids, params)):
            if i == self.at and not self.failed:
                self.failed = True
                raise self.error
            yield out


async def _enumerate(stream):
    i = 0
    async for item in stream:
        yield i, item
        i += 1


def serve(engine, coro_fn, **config):
    async def run():
        server = Server(ServerState(ServerConfig(port=0, **config), engine))
        await server.start()
        try:
            async with aiohttp.ClientSession() as session:
                return await coro_fn(server, session)
        finally:
            await server.drain()
    return asyncio.run(run())


async def connect(server, session, **kwargs):
    ws = await session.ws_connect(server.url + "/ws", **kwargs)
    assert (await recv(ws))["type"] == "ready"
    return ws


async def recv(ws) -> dict:
    msg = await asyncio.wait_for(ws.receive(), 10)
    assert msg.type == aiohttp.WSMsgType.TEXT, (msg.type, msg.data, msg.extra)
    return json.loads(msg.data)


async def frames_until_done(ws) -> list[dict]:
    frames = [await recv(ws)]
    while frames[-1]["type"] != "done":
        frames.append(await recv(ws))
    return frames


CHAT = {"type": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


# ------------------------------------------------------------------------- a reply that fails midway
@pytest.mark.parametrize("error, code, says", [
    (EngineUnavailable("pipeline stage 1 (host b:7070) died"), 503, "pipeline stage 1 (host b:7070) died"),
    (FlotillaError("the engine refused it"), 400, "the engine refused it"),
    (ApiError(429, "the engine is at capacity", code="queue_full"), 429, "the engine is at capacity"),
    (RuntimeError("secret internals"), 500, "internal server error"),
    (KeyError("secret internals"), 500, "internal server error"),
])
def test_a_reply_failing_after_start_ends_with_error_then_done(error, code, says, caplog):
    async def go(server, s):
        ws = await connect(server, s)
        await ws.send_json(CHAT)
        frames = await frames_until_done(ws)
        await ws.send_json({"type": "cancel"})  # the reply is over: no frame
        await ws.send_json({"type": "ping"})
        pong = await recv(ws)
        await ws.send_json(CHAT)  # the socket carries on
        after = await frames_until_done(ws)
        in_flight = server.state.admission.in_flight
        await ws.close()
        return frames, pong, after, in_flight

    with caplog.at_level(logging.ERROR, logger="flotilla.server"):
        frames, pong, after, in_flight = serve(FailingEngine(error, at=2), go)
    start, *deltas, err, done = frames
    rid = start["id"]
    assert start["type"] == "start" and [(d["type"], d["id"], d["text"]) for d in deltas] == [
        ("delta", rid, "A"), ("delta", rid, "B")]
    assert err == {"type": "error", "id": rid, "code": code, "message": err["message"], "param": None}
    assert says in err["message"]
    assert done["type"] == "done" and done["id"] == rid and done["finish_reason"] == "error"
    assert done["usage"] == {"prompt_tokens": start["prompt_tokens"], "completion_tokens": 2,
                             "total_tokens": start["prompt_tokens"] + 2}
    assert pong == {"type": "pong"}
    assert after[0]["type"] == "start" and after[-1]["finish_reason"] == "length"
    assert "".join(f["text"] for f in after if f["type"] == "delta") == "ABCD"
    assert in_flight == 0
    bugs = [r for r in caplog.records if r.exc_info and r.exc_info[1] is error]
    if code == 500:  # a bug: its traceback in the log, never on the wire
        assert "secret" not in err["message"] and len(bugs) == 1 and rid in bugs[0].getMessage()
    else:
        assert bugs == []


def test_a_refusal_before_start_is_an_error_frame_alone():
    async def go(server, s):
        ws = await connect(server, s)
        await ws.send_json({**CHAT, "max_tokens": 1000})  # past the fake's 64-token context
        refused = await recv(ws)
        await ws.send_json({"type": "ping"})
        return refused, await recv(ws)

    refused, pong = serve(Engine(), go)
    assert refused["type"] == "error" and "id" not in refused and refused["code"] == 400
    assert pong == {"type": "pong"}


def test_logprobs_on_the_websocket_are_refused_not_ignored():
    async def go(server, s):
        ws = await connect(server, s)
        got = []
        for extra in ({"logprobs": True}, {"top_logprobs": 3}, {"prompt_logprobs": 0}, {"logprobs": False}):
            await ws.send_json({**CHAT, "max_tokens": 2, **extra})
            got.append(await recv(ws))
        return got

    lp, top, prompt, off = serve(Engine(), go)
    assert prompt["type"] == "error" and prompt["param"] == "prompt_logprobs"  # 0 asks for the prompt's own
    assert lp["type"] == "error" and lp["code"] == 400 and lp["param"] == "logprobs"
    assert "POST /v1/chat/completions" in lp["message"]
    assert top["type"] == "error" and top["param"] == "top_logprobs"
    assert off["type"] == "start"  # logprobs: false asks for nothing


# --------------------------------------------------------------------------------------- fit_context
# The stub tokenizer is one token a byte, '<role>content' per message and '<assistant>' after:
# '<system>S' is 9 tokens, each user turn 10, each assistant turn 15, the closing '<assistant>' 11.
TURNS = [{"role": "system", "content": "S"},
         {"role": "user", "content": "aaaa"}, {"role": "assistant", "content": "bbbb"},
         {"role": "user", "content": "cccc"}, {"role": "assistant", "content": "dddd"},
         {"role": "user", "content": "eeee"}]


def prompt_len(messages) -> int:
    return len(StubTokenizer().apply_chat_template(messages))


def test_fit_context_drops_the_oldest_turns_as_far_as_needed():
    model = StubModel()  # a 64-token context
    assert prompt_len(TURNS) == 80
    assert prompt_len(TURNS[:1] + TURNS[3:]) == 55 and prompt_len(TURNS[:1] + TURNS[5:]) == 30
    # room for 9: 55 + 9 fits 64 exactly, so one turn (user + reply) goes
    fitted, dropped = fit_context({"messages": TURNS, "max_tokens": 9}, model)
    assert dropped == 2 and fitted["messages"] == TURNS[:1] + TURNS[3:] and fitted["max_tokens"] == 9
    fitted, dropped = fit_context({"messages": TURNS, "max_tokens": 10}, model)  # one more: both go
    assert dropped == 4 and fitted["messages"] == TURNS[:1] + TURNS[5:]
    # past half the context: room for 32, and max_tokens lowered to what the kept prompt leaves
    fitted, dropped = fit_context({"messages": TURNS, "max_completion_tokens": 40}, model)
    assert dropped == 4 and fitted["max_completion_tokens"] == 64 - 30
    fitted, dropped = fit_context({"messages": TURNS}, model)  # no max_tokens: half the context
    assert dropped == 4 and "max_tokens" not in fitted
    fitted, dropped = fit_context({"messages": TURNS[3:], "max_tokens": 20}, model)  # no system prompt: 46 + 20
    assert dropped == 2 and fitted["messages"] == TURNS[5:]
    short = {"messages": TURNS[:2], "max_tokens": 9}
    assert fit_context(short, model) == (short, 0)  # fits: left as it is


def test_fit_context_refuses_a_last_message_that_alone_leaves_no_room():
    too_long = TURNS[:-1] + [{"role": "user", "content": "x" * 40}]  # 9 + 46 + 11 = 66 tokens alone
    with pytest.raises(ApiError) as e:
        fit_context({"messages": too_long, "max_tokens": 4}, StubModel())
    assert e.value.status == 400 and e.value.code == "context_length_exceeded" and e.value.param == "messages"
    assert "the last message with the system prompt is 66 tokens" in e.value.message
    assert "64-token context" in e.value.message and "shorter" in e.value.message


def test_fit_context_over_the_socket():
    async def go(server, s):
        ws = await connect(server, s)
        await ws.send_json({"type": "chat", "messages": TURNS, "max_tokens": 9})
        refused = await recv(ws)  # without the flag: refused as before
        await ws.send_json({"type": "chat", "messages": TURNS, "max_tokens": 9, "fit_context": True})
        fitted = await frames_until_done(ws)
        await ws.send_json({"type": "chat", "messages": TURNS, "fit_context": "yes"})
        bad = await recv(ws)
        return refused, fitted, bad

    refused, fitted, bad = serve(Engine(), go)
    assert refused["type"] == "error" and refused["message"].startswith("80 tokens of messages, but the context")
    start, done = fitted[0], fitted[-1]
    assert start["dropped_messages"] == 2 and start["prompt_tokens"] == 55
    assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 9
    assert bad["type"] == "error" and bad["param"] == "fit_context"


# ------------------------------------------------------------------------------------------- API key
def test_the_api_key_scheme_is_case_insensitive_on_the_websocket_as_over_http():
    async def go(server, s):
        opened = {}
        for header in ["Bearer sekrit", "bearer sekrit", "BEARER sekrit", "Bearer    sekrit", "bEaReR sekrit "]:
            ws = await connect(server, s, headers={"Authorization": header})
            opened[header] = True
            await ws.close()
            async with s.get(server.url + "/v1/models", headers={"Authorization": header}) as r:
                assert r.status == 200, header
        closed = {}
        for header in ["Bearer wrong", "Basic sekrit", "Bearersekrit"]:
            ws = await s.ws_connect(server.url + "/ws", headers={"Authorization": header})
            msg = await ws.receive()
            closed[header] = (msg.type, ws.close_code)
        ws = await connect(server, s, params={"api_key": "sekrit"})  # the page's way still works
        await ws.close()
        return opened, closed

    opened, closed = serve(Engine(), go, api_key="sekrit")
    assert len(opened) == 5
    assert set(closed.values()) == {(aiohttp.WSMsgType.CLOSE, 1008)}


# ---------------------------------------------------------------------------------------- frame size
def test_a_frame_over_the_limit_gets_413_and_the_socket_stays_open():
    limit = 4096

    def frame(content: str) -> str:
        return json.dumps({"type": "chat", "messages": [{"role": "user", "content": content}]}, ensure_ascii=False)

    pad = len(frame(""))
    exact = frame("x" * (limit - pad))  # at the limit: read as usual (the fake's context refuses it)
    assert len(exact.encode()) == limit
    wide = frame("é" * 2100)  # fewer characters than the limit, but 2 bytes each

    async def go(server, s):
        ws = await connect(server, s)
        answers = []
        for text in [frame("x" * 5000), wide, exact]:
            await ws.send_str(text)
            answers.append(await recv(ws))
        await ws.send_json({"type": "ping"})
        pong = await recv(ws)
        await ws.send_json(CHAT)
        reply = await frames_until_done(ws)
        await ws.send_str(frame("x" * (2 * limit)))  # past what is buffered at all
        msg = await ws.receive()
        return answers, pong, reply, (msg.type, ws.close_code)

    answers, pong, reply, closed = serve(Engine(), go, max_body_bytes=limit)
    over, wide_answer, at_limit = answers
    assert over["type"] == "error" and over["code"] == 413
    assert over["message"] == (f"the frame is {5000 + pad} bytes; the limit is {limit} bytes (--max-body-bytes): "
                               f"send a shorter message")
    assert wide_answer["code"] == 413 and f"the frame is {len(wide.encode())} bytes" in wide_answer["message"]
    assert at_limit["type"] == "error" and at_limit["code"] == 400  # not a size refusal
    assert pong == {"type": "pong"} and reply[-1]["finish_reason"] == "length"
    assert closed == (aiohttp.WSMsgType.CLOSE, 1009)


def test_a_ping_from_a_client_that_has_left_is_no_server_error():
    """A pong (or the ready frame) to a socket reset under it: the client left, nothing to answer; before, the
    reset escaped the handler, logged a traceback and counted the socket as a 500."""
    from flotilla.server.websocket import _Conversation

    class ResetSocket:
        closed = False

        async def send_json(self, frame):
            raise ConnectionResetError("Cannot write to closing transport")

    conversation = _Conversation(None, ResetSocket())
    asyncio.run(conversation.on_text('{"type": "ping"}'))  # returns quietly


def test_a_misspelt_field_on_the_websocket_is_named_in_the_log(caplog):
    async def go(server, s):
        ws = await connect(server, s)
        await ws.send_json({**CHAT, "max_token": 2, "max_tokens": 2})
        return await recv(ws)

    with caplog.at_level(logging.WARNING, logger="flotilla.server"):
        assert serve(Engine(), go)["type"] == "start"  # it runs, as over HTTP, without the field
    assert any("fields ignored" in r.getMessage() and "'max_token'" in r.getMessage() for r in caplog.records)
