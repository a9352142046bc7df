"""Fuzzing the OpenAI endpoints' request bodies with hypothesis, over real HTTP against a fast fake
engine: whatever the body, the answer is never a 5xx (nor a streamed error event, a 5xx in
disguise), every 4xx has OpenAI's error shape, and the server still answers a good request after.

Three bodies in four start valid (the model and a prompt), then get a few of the fields the
endpoints read set to values a client might send, one or two set to any JSON value (huge integers,
NaN and infinities, unpaired surrogates, nesting) and maybe one taken out; the fourth is raw bytes
that are barely JSON at all."""
from __future__ import annotations

import http.client
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_harness import LiveServer
from test_server_fake_engine import FakeEngine

from flotilla.server.config import ServerConfig
from flotilla.server.engine_client import StepOutput

EXAMPLES = 300  # per endpoint: 600 bodies a run

HUGE = "\x00huge"  # stands for an integer of 5000 digits (json.dumps refuses to write one)


def dumps(value) -> bytes:
    return json.dumps(value).encode().replace(json.dumps(HUGE).encode(), b"9" * 5000)


# any JSON value, with the numbers and strings that break naive parsers
SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.sampled_from([HUGE, 2**53 + 1, -2**63, 2**64, 10**300, -0.0, 1e-320]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30), st.sampled_from(["\ud800", "a\udfffb", "\x00", "é" * 20, "fake", "user", "text"]),
)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                          max_size=4), max_leaves=12)

ROLE = st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot"])
PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "text", "image_url"]), "text": st.text(max_size=20)})
MESSAGE = st.fixed_dictionaries({"role": ROLE, "content": st.text(max_size=40) | st.lists(PART, max_size=3)})
TOKEN_IDS = st.lists(st.integers(min_value=-1, max_value=300), max_size=20)
SMALL_INT = st.integers(min_value=-1, max_value=40)
UNIT = st.floats(min_value=-0.1, max_value=2.1, allow_nan=False)

VALID = {  # a body starts valid: the model and a prompt
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                "content": st.text(max_size=40)}), min_size=1, max_size=3),
    "prompt": st.text(min_size=1, max_size=40) | st.lists(st.integers(0, 255), min_size=1, max_size=20),
}
FIELDS = {  # then gets a few fields, each with a value a client might send (in range or not)
    "model": st.sampled_from(["fake", "other", ""]),
    "messages": st.lists(MESSAGE, max_size=4),
    "prompt": st.text(max_size=40) | TOKEN_IDS | st.lists(st.text(max_size=10) | TOKEN_IDS, max_size=3),
    "max_tokens": SMALL_INT, "max_completion_tokens": SMALL_INT,
    "temperature": UNIT, "top_p": UNIT, "min_p": UNIT, "top_k": SMALL_INT,
    "presence_penalty": UNIT, "frequency_penalty": UNIT, "repetition_penalty": UNIT,
    "n": st.integers(min_value=0, max_value=9), "best_of": st.integers(min_value=0, max_value=9),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=20),
    "seed": st.integers(min_value=-1, max_value=2**64), "logprobs": st.booleans() | SMALL_INT,
    "top_logprobs": SMALL_INT, "ignore_eos": st.booleans(), "stop_token_ids": TOKEN_IDS,
    "echo": st.booleans(), "suffix": st.text(max_size=5), "user": st.text(max_size=5),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
    "tools": st.lists(JSON, max_size=2), "logit_bias": st.dictionaries(st.text(max_size=3), SMALL_INT, max_size=2),
    "min_tokens": SMALL_INT, "include_stop_str_in_output": st.booleans(), "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(), "chat_template_kwargs": st.dictionaries(st.text(max_size=9), JSON),
    "tool_choice": st.sampled_from(["none", "auto", "required"]) | JSON, "guided_choice": st.lists(st.text()),
    "skip_special_tokens": st.booleans(),
}


@st.composite
def bodies(draw, prompt_field: str) -> bytes:
    """A valid body, then a few fields set (plausible values), a field or two set to any JSON
    value, and maybe a field taken out."""
    obj = {"model": "fake", prompt_field: draw(VALID[prompt_field])}
    for key in draw(st.lists(st.sampled_from(sorted(FIELDS)), unique=True, max_size=4)):
        obj[key] = draw(FIELDS[key])
    for key in draw(st.lists(st.sampled_from(sorted(FIELDS)), unique=True, max_size=2)):
        obj[key] = draw(JSON)
    for key in draw(st.lists(st.sampled_from(sorted(obj)), unique=True, max_size=1)):
        del obj[key]
    return dumps(obj)  # NaN and Infinity as JavaScript writes them, which Python reads


RAW = st.one_of(st.binary(max_size=60), st.sampled_from([b"", b"{", b"[]", b"null", b'{"a": 1e999999}',
                                                         b'{"n": -0}', b"\xef\xbb\xbf{}", b'{"' + b"[" * 50000]),
                JSON.map(dumps))


class FastEngine(FakeEngine):
    """The fake engine without its sleeps: a reply of max_tokens letters, at once."""

    async def generate(self, request_id, prompt_ids, params):
        for i in range(params.max_tokens):
            yield StepOutput((65 + i % 26,), chr(65 + i % 26), "length" if i == params.max_tokens - 1 else None)


@pytest.fixture(scope="module")
def server():
    live = LiveServer(FastEngine(), ServerConfig(port=0, max_queue=64)).__enter__()
    yield live
    live.stop()


class Client:
    """One keep-alive HTTP connection (a new one whenever the server closes it)."""

    def __init__(self, url: str):
        self.host, self.port = url.removeprefix("http://").split(":")
        self.conn = None

    def post(self, path: str, body: bytes) -> tuple[int, str]:
        for attempt in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, int(self.port), timeout=30)
            try:
                self.conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
                r = self.conn.getresponse()
                data = r.read().decode("utf-8", "replace")
                if r.getheader("Connection", "").lower() == "close":
                    self.conn.close()
                    self.conn = None
                return r.status, data
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.conn.close()
                self.conn = None  # a stale keep-alive connection: once more on a fresh one
                if attempt:
                    raise
        raise AssertionError("unreachable")


def check(status: int, data: str, body: bytes) -> None:
    assert status < 500, (status, data[:500], body[:300])
    if status >= 400:
        err = json.loads(data)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], (data, body[:300])
    elif data.startswith("data: "):  # a stream: no error event in it
        events = [e for e in data.split("\n\n") if e.startswith("data: ") and e != "data: [DONE]"]
        assert data.rstrip().endswith("data: [DONE]"), data[-300:]
        assert not [e for e in events if '"error"' in e[:20]], (events, body[:300])
    else:
        assert json.loads(data)["choices"], data


FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("path,prompt_field", [("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")])
def test_fuzzed_bodies_never_get_a_5xx_and_the_server_answers_after(server, path, prompt_field):
    client = Client(server.url)
    seen = {"2xx": 0, "4xx": 0}

    @FUZZ
    @given(body=st.one_of(bodies(prompt_field), bodies(prompt_field), bodies(prompt_field), RAW))
    def fuzz(body):
        status, data = client.post(path, body)
        check(status, data, body)
        seen["2xx" if status < 300 else "4xx"] += 1

    fuzz()
    assert seen["2xx"] + seen["4xx"] >= EXAMPLES
    assert seen["2xx"] > EXAMPLES // 10, seen  # the bodies reach generation too, not only the validators
    good = {"model": "fake", "max_tokens": 3, **({"messages": [{"role": "user", "content": "hi"}]}
                                                  if "chat" in path else {"prompt": "hi"})}
    status, data = client.post(path, json.dumps(good).encode())
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 3
    stats = server.engine.stats()
    assert stats.num_running == stats.num_waiting == 0
