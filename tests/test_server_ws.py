"""Websocket chat: a multi-turn conversation, a cancel mid-stream that frees the request's KV
blocks at once, and bad frames that get an error frame or a close code with a reason (the frame size
limit, a failing engine and the API key's scheme: test_server_ws_edges.py, on a fake engine)."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from flotilla.runtime.sampling import SamplingParams
from server_harness import start_server


@pytest.fixture(scope="module")
def live(smollm2_gguf):
    server = start_server(smollm2_gguf)
    yield server
    server.stop()


async def recv(ws) -> dict:
    msg = await asyncio.wait_for(ws.receive(), 120)
    assert msg.type == aiohttp.WSMsgType.TEXT, (msg.type, msg.data, msg.extra)
    return json.loads(msg.data)


async def reply(ws, **frame) -> tuple[str, dict, list[str]]:
    """Send one chat frame and read its reply: (text, the done frame, the deltas)."""
    await ws.send_json({"type": "chat", **frame})
    start = await recv(ws)
    assert start["type"] == "start", start
    deltas = []
    while True:
        f = await recv(ws)
        if f["type"] == "done":
            assert f["id"] == start["id"]
            return "".join(deltas), f, deltas
        assert f["type"] == "delta" and f["id"] == start["id"], f
        deltas.append(f["text"])


def run(coro):
    return asyncio.run(coro)


async def connect(session, live):
    ws = await session.ws_connect(live.ws_url)
    ready = await recv(ws)
    assert ready == {"type": "ready", "model": live.engine.model_name, "max_model_len": live.engine.max_model_len,
                     "max_frame_bytes": 2 * 1024 * 1024}
    return ws


def test_multi_turn_conversation(live):
    tok = live.engine.tokenizer
    turns = ["What is the capital of France?", "And of Italy?", "Thanks! Which one is bigger?"]

    async def chat():
        messages, transcript = [{"role": "system", "content": "You answer in one short sentence."}], []
        async with aiohttp.ClientSession() as s:
            ws = await connect(s, live)
            for question in turns:
                messages.append({"role": "user", "content": question})
                text, done, deltas = await reply(ws, messages=messages, max_tokens=16, temperature=0)
                transcript.append((list(messages), text, done, deltas))
                messages.append({"role": "assistant", "content": text})
            await ws.close()
        return transcript

    for messages, text, done, deltas in run(chat()):
        prompt = tok.apply_chat_template(messages)
        expected, ids, reason = live.engine_text(prompt, SamplingParams(max_tokens=16, temperature=0))
        assert text == expected and text.strip()
        assert len(deltas) > 1  # streamed, not sent in one piece
        assert done["finish_reason"] == reason
        assert done["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                                 "total_tokens": len(prompt) + len(ids)}
    assert len(prompt) > 60  # the last turn carried the whole conversation


def test_cancel_mid_stream_frees_the_blocks(live):
    async def chat():
        async with aiohttp.ClientSession() as s:
            ws = await connect(s, live)
            await ws.send_json({"type": "chat", "messages": [{"role": "user", "content": "Count from 1 to 500."}],
                                "max_tokens": 1000, "ignore_eos": True, "temperature": 0})
            start = await recv(ws)
            for _ in range(4):
                assert (await recv(ws))["type"] == "delta"
            during = live.stats()
            await ws.send_json({"type": "cancel"})
            while (f := await recv(ws))["type"] == "delta":
                pass
            after = live.stats()  # read right at "done": the abort freed the blocks already
            text, done2, _ = await reply(ws, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
            await ws.close()
            return start, during, f, after, done2

    start, during, done, after, done2 = run(chat())
    assert during.num_running == 1 and during.kv_blocks_free < during.kv_blocks_total
    assert done["type"] == "done" and done["id"] == start["id"] and done["finish_reason"] == "cancelled"
    assert 4 <= done["usage"]["completion_tokens"] < 1000
    assert after.num_running == after.num_waiting == 0
    assert after.kv_blocks_free == after.kv_blocks_total
    assert done2["finish_reason"] in ("stop", "length")  # the same socket carries on


def test_cancel_with_no_reply_is_ignored_and_a_cancel_right_after_chat_holds(live):
    async def session():
        async with aiohttp.ClientSession() as s:
            ws = await connect(s, live)
            await ws.send_json({"type": "cancel"})  # nothing streaming: no frame at all
            await ws.send_json({"type": "ping"})
            pong = await recv(ws)
            # sent back to back: the cancel may arrive before the reply reaches the engine
            await ws.send_json({"type": "chat", "messages": [{"role": "user", "content": "Count to 500."}],
                                "max_tokens": 1000, "ignore_eos": True})
            await ws.send_json({"type": "cancel"})
            frames = [await recv(ws)]
            while frames[-1]["type"] != "done":
                frames.append(await recv(ws))
            await ws.send_json({"type": "cancel"})  # after "done": ignored too
            text, done2, _ = await reply(ws, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
            await ws.close()
            return pong, frames, done2

    pong, frames, done2 = run(session())
    assert pong == {"type": "pong"}
    assert frames[0]["type"] == "start" and frames[-1]["finish_reason"] == "cancelled"
    assert frames[-1]["usage"]["completion_tokens"] < 1000
    assert not [f for f in frames if f["type"] == "error"]
    assert done2["finish_reason"] in ("stop", "length")  # the next reply is not cancelled
    stats = live.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_blocks_free == stats.kv_blocks_total


def test_bad_frames_get_error_frames_and_the_socket_keeps_working(live):
    good = {"type": "chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

    async def session():
        errors = []
        async with aiohttp.ClientSession() as s:
            ws = await connect(s, live)
            for bad in ["hello", "[1, 2]", json.dumps({"type": "dance"}), json.dumps({"type": "chat"}),
                        json.dumps({"type": "chat", "messages": []}),
                        json.dumps({"type": "chat", "messages": [{"role": "user", "content": 5}]}),
                        json.dumps({**good, "max_tokens": -1}), json.dumps({**good, "temperature": "hot"}),
                        json.dumps({**good, "model": "gpt-4o"}),
                        '{"type": "chat", "messages": [{"role": "user", "content": "\\ud800"}]}',
                        '{"type": "chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": %s}'
                        % ("1" * 5000)]:
                await ws.send_str(bad)
                f = await recv(ws)
                assert f["type"] == "error", (bad, f)
                errors.append((bad, f))
                text, done, _ = await reply(ws, **{k: v for k, v in good.items() if k != "type"})
                assert done["finish_reason"] in ("stop", "length")
            await ws.send_json({"type": "ping"})
            assert await recv(ws) == {"type": "pong"}
            # a second chat while one streams is refused, the first one goes on
            await ws.send_json({**good, "max_tokens": 8, "ignore_eos": True})
            await ws.send_json(good)
            frames = []
            while not frames or frames[-1]["type"] != "done":
                frames.append(await recv(ws))
            busy = [f for f in frames if f["type"] == "error"]
            await ws.close()
        return errors, busy, frames

    errors, busy, frames = run(session())
    messages = [f["message"] for _, f in errors]
    assert "not valid JSON" in messages[0] and '"type": "chat"' in messages[0]
    assert "JSON object" in messages[1]
    assert "unknown frame type" in messages[2]
    assert "'messages' is required" in messages[3]
    assert "non-empty array" in messages[4]
    assert "messages[0].content" in messages[5]
    assert "'max_tokens'" in messages[6] and "'temperature'" in messages[7]
    assert errors[8][1]["code"] == 404 and "SmolLM2" in messages[8]
    assert "unpaired surrogate" in messages[9]
    assert "integer of 5000 digits" in messages[10]
    assert all(400 <= f["code"] < 500 for _, f in errors)
    assert len(busy) == 1 and busy[0]["code"] == 409 and "cancel" in busy[0]["message"]
    assert frames[-1]["usage"]["completion_tokens"] == 8


def test_binary_frame_closes_with_1003_and_a_reason(live):
    async def session():
        async with aiohttp.ClientSession() as s:
            ws = await connect(s, live)
            await ws.send_bytes(b"\x00\x01binary")
            msg = await ws.receive()
            closed = (msg.type, ws.close_code, msg.extra)
            ws2 = await connect(s, live)  # the server keeps serving
            text, done, _ = await reply(ws2, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
            await ws2.close()
            return closed, done

    (kind, code, reason), done = run(session())
    assert kind == aiohttp.WSMsgType.CLOSE and code == 1003
    assert "binary frames are not supported" in reason and "JSON text" in reason
    assert done["type"] == "done"
