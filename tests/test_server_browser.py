"""The chat page in a real browser (Debian's chromium, headless, driven by Playwright): a message
streams in and grows, the stop button ends it, new chat clears it, the next message works."""
from __future__ import annotations

import os
import shutil
import time

import pytest

from server_harness import start_server

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
    page.fill("#input", "Say hello.")
    page.press("#input", "Enter")
    page.wait_for_selector('.msg.assistant[data-finish="length"], .msg.assistant[data-finish="stop"]',
                           timeout=60_000)
    import json

    chats = [json.loads(f) for f in sent if '"chat"' in f]
    assert len(chats) == 2 and [m["content"] for m in chats[1]["messages"]] == ["Say hello."]
