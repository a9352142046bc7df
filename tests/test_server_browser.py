"""The chat page in a real browser (Debian's chromium, headless, driven by Playwright): a message
streams in and grows, the stop button ends it, new chat clears it, the next message works; on a fake
engine, a reply failing midway returns the page to ready, a chat past the context drops its
oldest turns, and a reasoning reply's <think> block is folded above its answer."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import time

import pytest

from flotilla.server.engine_client import StepOutput
from server_harness import LiveServer, start_server
from test_server_ws_edges import Engine

CHROMIUM = "/usr/bin/chromium"
SCREENSHOT = os.environ.get("FLOTILLA_TEST_SCREENSHOT")  # a path: keep a picture of the page
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason=".ci/run installs Debian's chromium")


@pytest.fixture(scope="module")
def live(smollm2_gguf):
    server = start_server(smollm2_gguf)
    yield server
    server.stop()


class PageEngine(Engine):
    """A 256-token context and a letter a millisecond; `fail_next`: the next reply fails after 5 letters."""
    max_model_len = 256

    def __init__(self):
        super().__init__()
        self.fail_next = False

    async def generate(self, request_id, prompt_ids, params):
        fail, self.fail_next = self.fail_next, False
        for i in range(params.max_tokens):
            if fail and i == 5:
                raise RuntimeError("a bug in the engine")
            await asyncio.sleep(0.001)
            yield StepOutput((65 + i % 26,), chr(65 + i % 26), "length" if i == params.max_tokens - 1 else None)


@pytest.fixture
def fake():
    with LiveServer(PageEngine()) as server:
        yield server


def chat_frames(page) -> list[dict]:
    """The chat frames the page sends from now on (the list fills as it sends them)."""
    sent = []
    page.on("websocket", lambda ws: ws.on("framesent", lambda payload: sent.append(payload)))
    return sent


def open_page(page, server) -> None:
    page.goto(server.url + "/")
    page.wait_for_function("document.querySelector('#model').textContent === %r" % server.engine.model_name)


def say(page, text: str, replies: int) -> None:
    """Send a message and wait until `replies` replies have ended."""
    page.fill("#input", text)
    page.press("#input", "Enter")
    page.wait_for_function("document.querySelectorAll('.msg.assistant[data-finish]').length === %d" % replies,
                           timeout=30_000)


@pytest.fixture
def page(tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM,
                                                   headless=True, args=ARGS)
        page = ctx.new_page()
        page.errors = []
        page.on("pageerror", lambda e: page.errors.append(str(e)))
        page.on("console", lambda m: m.type == "error" and page.errors.append(m.text))
        yield page
        ctx.close()


def test_chat_page_streams_stops_and_starts_over(live, page):
    page.goto(live.url + "/")
    page.wait_for_function("document.querySelector('#model').textContent === %r" % live.engine.model_name)
    assert page.title() == "flotilla chat"

    page.click("#settings-toggle")
    page.fill("#system", "You are a storyteller who writes long stories.")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "400")
    page.fill("#input", "Tell me a long story about a dragon and a lighthouse.")
    page.press("#input", "Enter")

    reply = page.locator(".msg.assistant .body").last
    assert page.locator(".msg.user").last.inner_text() == "Tell me a long story about a dragon and a lighthouse."
    assert page.is_visible("#stop") and not page.is_visible("#send")
    lengths = []
    deadline = time.monotonic() + 120
    while len(set(lengths)) < 4 and time.monotonic() < deadline:  # watch the text grow
        n = len(reply.inner_text())
        if n and (not lengths or n > lengths[-1]):
            lengths.append(n)
        page.wait_for_timeout(50)
    assert len(lengths) >= 4 and lengths == sorted(lengths), lengths
    assert "tok/s" in page.inner_text("#stats")

    page.click("#stop")
    page.wait_for_selector('.msg.assistant[data-finish="cancelled"]', timeout=30_000)
    stopped = reply.inner_text()
    page.wait_for_timeout(500)
    assert reply.inner_text() == stopped  # nothing more arrives
    assert "stopped" in page.inner_text(".msg.assistant .meta")
    assert page.is_visible("#send") and not page.is_visible("#stop")
    assert live.stats().num_running == 0 and live.state.admission.in_flight == 0

    page.click("#new-chat")
    assert page.locator(".msg").count() == 0 and page.is_visible("#empty")
    page.fill("#max-tokens", "6")
    page.dispatch_event("#max-tokens", "change")
    page.fill("#input", "Say hello.")
    page.click("#send")
    page.wait_for_selector('.msg.assistant[data-finish="length"], .msg.assistant[data-finish="stop"]',
                           timeout=60_000)
    assert page.locator(".msg").count() == 2
    assert page.locator(".msg.assistant .body").inner_text().strip()
    assert page.errors == []
    page.screenshot(path=str(SCREENSHOT)) if SCREENSHOT else None


def test_a_refused_message_leaves_the_chat_history(live, page):
    """A message the server refuses (too long for the context) is marked refused and is not sent again with
    the next message (it was, so one refusal refused the rest of the chat until "New chat")."""
    sent = []
    page.on("websocket", lambda ws: ws.on("framesent", lambda payload: sent.append(payload)))
    page.goto(live.url + "/")
    page.wait_for_function("document.querySelector('#model').textContent === %r" % live.engine.model_name)
    page.click("#settings-toggle")
    page.fill("#max-tokens", "4")
    page.dispatch_event("#max-tokens", "change")
    page.fill("#input", "word " * 9000)  # past SmolLM2's 8192-token context
    page.press("#input", "Enter")
    page.wait_for_selector('.msg.assistant[data-finish="error"]', timeout=60_000)
    assert page.input_value("#input") == "word " * 9000  # the refused text is back in the box, to shorten
    assert page.locator(".msg.user").count() == 0  # and not left in the chat as if it had been asked
    page.fill("#input", "Say hello.")
    page.press("#input", "Enter")
    page.wait_for_selector('.msg.assistant[data-finish="length"], .msg.assistant[data-finish="stop"]',
                           timeout=60_000)
    import json

    chats = [json.loads(f) for f in sent if '"chat"' in f]
    assert len(chats) == 2 and [m["content"] for m in chats[1]["messages"]] == ["Say hello."]


def test_a_reply_failing_midway_returns_the_page_to_ready(fake, page):
    """The server ends a failed reply with an error frame and then "done"; the page ends the reply at the
    error: the text so far stays with the error under it, Send is back, and the next message works."""
    sent = chat_frames(page)
    open_page(page, fake)
    fake.engine.fail_next = True
    say(page, "Hello", 1)
    reply = page.locator(".msg.assistant").last
    assert reply.get_attribute("data-finish") == "error" and "error" in reply.get_attribute("class")
    assert reply.locator(".body").inner_text() == "ABCDE"
    assert "failed: internal server error" in reply.locator(".meta").inner_text()
    assert "internal server error" in page.inner_text("#banner")
    assert page.is_visible("#send") and not page.is_visible("#stop")
    say(page, "Again", 2)
    assert page.locator(".msg.assistant").last.get_attribute("data-finish") == "length"
    chats = [json.loads(f) for f in sent if '"chat"' in f]
    assert [m["content"] for m in chats[1]["messages"]] == ["Hello", "ABCDE", "Again"]
    assert fake.state.admission.in_flight == 0 and page.errors == []


def test_a_chat_past_the_context_drops_its_oldest_turns(fake, page):
    """With a 256-token context the page asks for 128-token replies (not its default 512, which the server
    would refuse), and once the conversation outgrows the context the server drops the oldest turns: the
    page says so, dims them and stops sending them."""
    sent = chat_frames(page)
    open_page(page, fake)
    questions = ["First question", "Second question", "Third question"]
    for i, text in enumerate(questions):
        say(page, text, i + 1)
    finishes = [el.get_attribute("data-finish") for el in page.locator(".msg.assistant").all()]
    assert finishes == ["length"] * 3
    chats = [json.loads(f) for f in sent if '"chat"' in f]
    assert [(c["max_tokens"], c["fit_context"]) for c in chats] == [(128, True)] * 3
    answer = "".join(chr(65 + i % 26) for i in range(128))
    assert [[m["content"] for m in c["messages"]] for c in chats] == [
        questions[:1], [questions[0], answer, questions[1]], [questions[1], answer, questions[2]]]
    # each turn's 139 tokens of answer leave no room for the next turn's 128: the turn before it goes
    assert page.locator(".msg.dropped").count() == 4
    notices = page.locator(".notice").all_inner_texts()
    assert len(notices) == 2 and all("2 oldest messages" in n and "256-token context" in n for n in notices)
    assert page.errors == []
    page.click("#new-chat")
    assert page.locator(".msg, .notice").count() == 0


class ThinkingEngine(PageEngine):
    """Replies with a <think> block, then the answer, a few characters a delta."""
    REPLY = "<think>\nThe user greets me.\n</think>\n\nHello!"

    async def generate(self, request_id, prompt_ids, params):
        pieces = [self.REPLY[i:i + 4] for i in range(0, len(self.REPLY), 4)]
        for i, piece in enumerate(pieces):
            await asyncio.sleep(0.001)
            yield StepOutput((65,), piece, "stop" if i == len(pieces) - 1 else None)


def test_reasoning_is_folded_above_the_answer_and_not_sent_back(page):
    """serve --reasoning-parser: the page shows the <think> block in a fold above the answer (closed once the
    answer came) and sends only the answer back with the conversation."""
    from flotilla.server.config import ServerConfig

    sent = chat_frames(page)
    with LiveServer(ThinkingEngine(), ServerConfig(port=0, reasoning_parser="qwen3")) as server:
        open_page(page, server)
        say(page, "Hi", 1)
        reply = page.locator(".msg.assistant").last
        assert reply.locator(".body").inner_text().strip() == "Hello!"
        fold = reply.locator("details.thinking")
        assert fold.count() == 1 and fold.get_attribute("open") is None
        assert fold.locator("summary").inner_text() == "Thought"
        assert fold.locator("div").text_content() == "\nThe user greets me.\n"
        say(page, "Again", 2)
    chats = [json.loads(f) for f in sent if '"chat"' in f]
    assert [m["content"] for m in chats[1]["messages"]] == ["Hi", "\n\nHello!", "Again"]
    assert page.errors == []


def test_a_message_over_the_frame_limit_is_not_sent(page):
    """The page knows the server's frame limit from "ready" and refuses a larger message itself, with a banner,
    leaving the text in the box (the server would answer 413, or drop the socket for one past twice the limit)."""
    from flotilla.server.config import ServerConfig

    with LiveServer(PageEngine(), ServerConfig(port=0, max_body_bytes=4096)) as server:
        sent = chat_frames(page)
        open_page(page, server)
        big = "word " * 2000
        page.fill("#input", big)
        page.press("#input", "Enter")
        page.wait_for_function("!document.querySelector('#banner').hidden")
        assert "too large for this server" in page.text_content("#banner")
        assert page.input_value("#input") == big and not page.query_selector_all(".msg.user")
        say(page, "Hi", 1)
        assert [json.loads(f)["messages"][-1]["content"] for f in sent if '"chat"' in f] == ["Hi"]
        assert page.errors == []
