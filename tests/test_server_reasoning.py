"""serve --reasoning-parser: a reasoning model's <think> block as the chat API's `reasoning` (vLLM's parsers'
rules), whole and streamed, with the tags split across deltas at every place."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from flotilla.server.config import ServerConfig
from flotilla.server.engine_client import StepOutput
from flotilla.server.reasoning import ReasoningSplitter, split_reasoning
from flotilla.server.serve import Server
from flotilla.server.state import ServerState
from test_server_fake_engine import FakeEngine

REPLY = "<think>\nLet me think. 2 < 3.\n</think>\n\nThe answer is 3."


@pytest.mark.parametrize("parser, prompt_end, text, want", [
    ("qwen3", "", REPLY, ("\nLet me think. 2 < 3.\n", "\n\nThe answer is 3.")),
    ("qwen3", "", "The answer is 3.", (None, "The answer is 3.")),  # enable_thinking false: no block
    ("qwen3", "<think>\n\n</think>\n\n", "The answer", (None, "The answer")),  # the template closed it
    ("qwen3", "<|im_start|>assistant\n<think>\n", "abc</think>\n\nhi", ("abc", "\n\nhi")),  # Thinking-2507
    ("qwen3", "", "<think>\nstill thinking", ("\nstill thinking", None)),  # cut by max_tokens
    ("qwen3", "", "<thi", (None, "<thi")),  # a piece of a tag that never became one
    ("deepseek_r1", "<think>\n", "Let me think.\n</think>\n\nIt is 3.", ("Let me think.\n", "\n\nIt is 3.")),
    ("deepseek_r1", "", "Let me think.\n</think>It is 3.", ("Let me think.\n", "It is 3.")),  # no tag seen: inside
    ("deepseek_r1", "", REPLY, ("\nLet me think. 2 < 3.\n", "\n\nThe answer is 3.")),  # a <think> written anyway
    ("deepseek_r1", "", "no end tag", ("no end tag", None)),
    ("deepseek_r1", "", "a </thin", ("a </thin", None)),
])
def test_whole_replies_split_as_vllm_parsers_do(parser, prompt_end, text, want):
    assert split_reasoning(parser, text, prompt_end) == want


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_every_split_point_of_the_stream_gives_the_whole_split(parser):
    for cut in range(len(REPLY) + 1):
        for cut2 in range(cut, len(REPLY) + 1, 3):
            s = ReasoningSplitter(parser)
            parts = [s.feed(REPLY[:cut]), s.feed(REPLY[cut:cut2]), s.feed(REPLY[cut2:]), s.finish()]
            reasoning, content = "".join(r for r, _ in parts), "".join(c for _, c in parts)
            assert (reasoning or None, content or None) == split_reasoning(parser, REPLY), (cut, cut2)
            assert all("<" + "think>" not in r + c and "</think" not in r + c for r, c in parts)


class ScriptedEngine(FakeEngine):
    """Streams REPLY a few characters at a time."""
    max_model_len = 256

    async def generate(self, request_id, prompt_ids, params):
        pieces = [REPLY[i:i + 3] for i in range(0, len(REPLY), 3)]
        for i, piece in enumerate(pieces):
            await asyncio.sleep(0)
            yield StepOutput((65,), piece, "stop" if i == len(pieces) - 1 else None)


def test_chat_gives_reasoning_apart_whole_and_streamed():
    body = {"model": "fake", "messages": [{"role": "user", "content": "2 or 3?"}], "max_tokens": 50}

    async def run(parser):
        server = Server(ServerState(ServerConfig(port=0, reasoning_parser=parser), ScriptedEngine()))
        await server.start()
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(server.url + "/v1/chat/completions", json=body) as r:
                    whole = (await r.json())["choices"][0]["message"]
                async with s.post(server.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
                    deltas = [json.loads(line[6:])["choices"][0]["delta"] async for line in r.content
                              if line.startswith(b"data: {")]
            return whole, deltas
        finally:
            await server.drain()

    whole, deltas = asyncio.run(run("qwen3"))
    assert whole["content"] == "\n\nThe answer is 3."
    assert whole["reasoning"] == whole["reasoning_content"] == "\nLet me think. 2 < 3.\n"
    assert "".join(d.get("reasoning", "") for d in deltas) == whole["reasoning"]
    assert "".join(d.get("content", "") for d in deltas) == "\n\nThe answer is 3."
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    plain, deltas = asyncio.run(run(None))  # no parser: the block stays in the content, no reasoning field
    assert plain["content"] == REPLY and "reasoning" not in plain
    assert "".join(d.get("content", "") for d in deltas) == REPLY


def test_websocket_gives_reasoning_apart():
    """/ws under --reasoning-parser: the block's text as the deltas' "reasoning", the answer as their "text";
    without the flag the text is the whole reply."""
    frame = {"type": "chat", "messages": [{"role": "user", "content": "2 or 3?"}], "max_tokens": 50}

    async def run(parser):
        server = Server(ServerState(ServerConfig(port=0, reasoning_parser=parser), ScriptedEngine()))
        await server.start()
        try:
            async with aiohttp.ClientSession() as s, s.ws_connect(server.url + "/ws") as ws:
                assert (await ws.receive_json())["type"] == "ready"
                await ws.send_json(frame)
                deltas = []
                while (f := await ws.receive_json())["type"] != "done":
                    deltas += [f] if f["type"] == "delta" else []
            return deltas
        finally:
            await server.drain()

    deltas = asyncio.run(run("qwen3"))
    assert "".join(d.get("reasoning", "") for d in deltas) == "\nLet me think. 2 < 3.\n"
    assert "".join(d["text"] for d in deltas) == "\n\nThe answer is 3."
    assert all(d["text"] or d.get("reasoning") for d in deltas)  # no empty frames
    deltas = asyncio.run(run(None))
    assert "".join(d["text"] for d in deltas) == REPLY and not any("reasoning" in d for d in deltas)
