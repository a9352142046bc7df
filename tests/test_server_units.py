"""The server's parts without a model: request validation into SamplingParams, SSE framing,
the Prometheus exposition, admission bounds."""
from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from flotilla.server.admission import Admission
from flotilla.server.errors import ApiError
from flotilla.server.fields import Fields, parse_json_object
from flotilla.server.metrics import Counter, Gauge, Histogram
from flotilla.server.protocol import parse_chat, parse_completion
from flotilla.server.sse import DONE, event


class StubTokenizer:
    """Bytes as tokens; the chat template is '<role>content' per message."""
    vocab_size = 256

    def encode(self, text, add_special_tokens=True):
        return list(text.encode())

    def apply_chat_template(self, messages, add_generation_prompt=True, continue_final_message=False, kwargs=None):
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")

    def token_bytes(self, token_id):
        return bytes([token_id])

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")

    def decode_window(self, ids):
        return self.decode(ids)

    def detokenizer(self, prompt_ids=None):
        from flotilla.models.tokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self, prompt_ids or [])


class StubModel:
    model_name = "stub"
    max_model_len = 64
    tokenizer = StubTokenizer()


def chat(**body):
    return parse_chat({"model": "stub", "messages": [{"role": "user", "content": "hi"}], **body}, StubModel(), 8)


def test_chat_maps_openai_fields_to_sampling_params():
    req = chat(temperature=0, top_p=0.5, max_completion_tokens=7, max_tokens=3, stop="END", seed=5,
               presence_penalty=1, frequency_penalty=-1, logprobs=True, top_logprobs=2, top_k=-1, user="me")
    (p,) = req.params
    assert (p.temperature, p.top_p, p.max_tokens, p.stop, p.seed) == (0, 0.5, 7, ("END",), 5)
    assert (p.presence_penalty, p.frequency_penalty, p.logprobs, p.top_logprobs, p.top_k) == (1, -1, True, 2, 0)
    assert req.prompts == (tuple(b"<user>hi<assistant>"),)


def test_defaults_chat_fills_the_context_completions_take_16():
    (p,) = chat().params
    assert p.max_tokens == 64 - len(b"<user>hi<assistant>") and p.temperature == 1.0
    (q,) = parse_completion({"model": "stub", "prompt": "abc"}, StubModel(), 8).params
    assert q.max_tokens == 16


def test_developer_role_is_system_and_text_parts_join():
    req = chat(messages=[{"role": "developer", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert bytes(req.prompts[0]) == b"<system>be brief<user>a\nb<assistant>"  # joined as vLLM joins them


def test_vllm_sampling_fields_and_logit_bias():
    (p,) = chat(min_tokens=5, max_tokens=9, include_stop_str_in_output=True, logit_bias={"65": -100, "7": 2.5}).params
    assert (p.min_tokens, p.max_tokens, p.include_stop_str_in_output) == (5, 9, True)
    assert p.logit_bias == ((65, -100.0), (7, 2.5))
    (q,) = parse_completion({"prompt": "abc", "min_tokens": 20}, StubModel(), 8).params
    assert (q.min_tokens, q.max_tokens) == (20, 20)  # the default 16 never undercuts min_tokens
    for body, param, words in [
        (dict(min_tokens=10, max_tokens=9), "min_tokens", "between 0 and 9"),
        (dict(logit_bias={"x": 1}), "logit_bias", "not a token id"),
        (dict(logit_bias={"300": 1}), "logit_bias", "out of range"),
        (dict(logit_bias={"3": 101}), "logit_bias", "between -100 and 100"),
        (dict(logit_bias=[1]), "logit_bias", "an object mapping token ids"),
        (dict(tool_choice="required"), "tool_choice", "no tools"),
        (dict(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice", "no tools"),
        (dict(guided_choice=["yes", "no"]), "guided_choice", "guided decoding"),
        (dict(structured_outputs={"choice": ["a"]}), "structured_outputs", "structured outputs"),
        (dict(prompt_logprobs=1, stream=True), "prompt_logprobs", "not available with 'stream'"),
        (dict(skip_special_tokens=False), "skip_special_tokens", "not supported"),
        (dict(echo=True), "echo", "not supported for chat"),
        (dict(continue_final_message=True, add_generation_prompt=True), "continue_final_message", "both be true"),
        (dict(chat_template_kwargs={"messages": []}), "chat_template_kwargs", "set by the request or the model"),
        (dict(chat_template_kwargs={"chat_template": "{{ 1 }}"}), "chat_template_kwargs", "set by the request"),
        (dict(chat_template_kwargs={"eos_token": "x"}), "chat_template_kwargs", "set by the request or the model"),
        (dict(chat_template_kwargs={str(i): i for i in range(17)}), "chat_template_kwargs", "at most 16 names"),
        (dict(chat_template_kwargs={"a": "x" * 5000}), "chat_template_kwargs", "4096 bytes"),
        (dict(chat_template="{{ messages }}"), "chat_template", "uses the model's"),
        (dict(allowed_token_ids=[1, 2]), "allowed_token_ids", "token allow-lists"),
        (dict(logit_bias={"12": 1, "012": 2}), "logit_bias", "names token 12 twice"),
        (dict(logit_bias={str(i): 1 for i in range(301)}), "logit_bias", "at most 300"),
    ]:
        with pytest.raises(ApiError) as e:
            chat(**body)
        assert e.value.status == 400 and e.value.param == param and words in e.value.message, (body, e.value.message)
    assert chat(tool_choice="none", guided_json=None, prompt_logprobs=None, skip_special_tokens=True).params
    # truncate_prompt_tokens (vLLM's): the prompt's last tokens only
    req = parse_completion({"prompt": "abcdefgh", "truncate_prompt_tokens": 3}, StubModel(), 8)
    assert req.prompts == (tuple(b"fgh"),)
    req = parse_completion({"prompt": "x" * 100, "truncate_prompt_tokens": -1}, StubModel(), 8)  # the context's
    assert len(req.prompts[0]) == 63 and req.params[0].max_tokens == 1
    # empty values of the refused fields mean their defaults (vLLM's request model sends bad_words: [])
    assert chat(bad_words=[], allowed_token_ids=[], chat_template="", structured_outputs={}).params


def test_chat_template_flags_reach_the_tokenizer():
    seen = []

    class Recording(StubTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=True, continue_final_message=False,
                                kwargs=None):
            seen.append((add_generation_prompt, continue_final_message, kwargs))
            return [1]

    class Model(StubModel):
        tokenizer = Recording()

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    parse_chat({"messages": messages, "continue_final_message": True}, Model(), 8)
    parse_chat({"messages": messages[:1], "add_generation_prompt": False,
                "chat_template_kwargs": {"enable_thinking": False}}, Model(), 8)
    assert seen == [(False, True, {}), (False, False, {"enable_thinking": False})]


def test_n_choices_get_distinct_seeds_and_prompt_batches_fan_out():
    req = chat(n=3, seed=10)
    assert [(i, p.seed) for i, _, p in req.choices()] == [(0, 10), (1, 11), (2, 12)]
    req = parse_completion({"model": "stub", "prompt": ["ab", [1, 2, 3]], "n": 2}, StubModel(), 8)
    assert [(i, len(ids)) for i, ids, _ in req.choices()] == [(0, 2), (1, 2), (2, 3), (3, 3)]
    assert parse_completion({"model": "stub", "prompt": ["a"] * 3, "n": 3}, StubModel(), 8).num_choices == 9


def test_context_bounds():
    with pytest.raises(ApiError, match="ask for at most 45") as e:
        chat(max_tokens=46)
    assert e.value.param == "max_tokens" and e.value.code == "context_length_exceeded"
    assert chat(max_tokens=45).params[0].max_tokens == 45
    with pytest.raises(ApiError, match="65 tokens of prompt, but the context holds 64"):
        parse_completion({"model": "stub", "prompt": "x" * 65}, StubModel(), 8)


@pytest.mark.parametrize("value,ok", [(3, True), (3.0, True), (True, False), ("3", False), (3.5, False), (0, False)])
def test_integer_fields_are_strict(value, ok):
    f = Fields({"max_tokens": value})
    if ok:
        assert f.integer("max_tokens", None, 1, 10) == 3
    else:
        with pytest.raises(ApiError, match="'max_tokens' must be an integer between 1 and 10") as e:
            f.integer("max_tokens", None, 1, 10)
        assert e.value.status == 400 and e.value.param == "max_tokens"


def test_number_fields_reject_nan_and_bools():
    for bad in (float("nan"), True, "1"):
        with pytest.raises(ApiError):
            Fields({"t": bad}).number("t", 1.0, 0, 2)


def test_json_body_errors():
    for raw, words in [(b"", "empty"), (b"{", "not valid JSON"), (b"[]", "JSON object"), (b"\xc3\x28", "UTF-8")]:
        with pytest.raises(ApiError, match=words):
            parse_json_object(raw)
    assert parse_json_object(b' {"a": 1} ') == {"a": 1}


def test_error_body_is_openai_shaped():
    e = ApiError(429, "slow down", code="queue_full", headers={"Retry-After": "1"})
    assert e.body() == {"error": {"message": "slow down", "type": "rate_limit_error", "param": None,
                                  "code": "queue_full"}}
    assert e.response().headers["Retry-After"] == "1"


def test_sse_framing():
    assert event({"a": "é\n"}) == 'data: {"a":"é\\n"}\n\n'.encode()
    assert DONE == b"data: [DONE]\n\n"


def test_exposition_format():
    c = Counter("reqs_total", "Requests", ("endpoint", "status"))
    c.inc(1, "/v1/x", "200")
    c.inc(2, "/v1/x", "200")
    c.inc(1, 'we"ird\\', "400")
    assert c.render() == ["# HELP reqs_total Requests", "# TYPE reqs_total counter",
                          'reqs_total{endpoint="/v1/x",status="200"} 3',
                          'reqs_total{endpoint="we\\"ird\\\\",status="400"} 1']
    g = Gauge("usage_ratio", "Usage")
    g.set(0.25)
    assert g.render()[-1] == "usage_ratio 0.25"
    h = Histogram("lat_seconds", "Latency", (0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0):  # a value equal to a bound falls in that bucket (le is inclusive)
        h.observe(v)
    h.observe(0.5, times=2)
    assert h.render()[2:] == ['lat_seconds_bucket{le="0.1"} 2', 'lat_seconds_bucket{le="1"} 5',
                              'lat_seconds_bucket{le="+Inf"} 6', "lat_seconds_sum 3.65", "lat_seconds_count 6"]


def test_admission_bound_is_exact_and_released_on_errors():
    async def run():
        a = Admission(capacity=2, max_queue=1, retry_after=3)
        with a.admit(2):
            with a.admit(1):
                assert a.in_flight == 3 and a.queued == 1
                with pytest.raises(ApiError) as e:
                    with a.admit(1):
                        pass
                assert e.value.status == 429 and e.value.headers == {"Retry-After": "3"}
        with pytest.raises(RuntimeError):
            with a.admit(3):
                raise RuntimeError("handler failed")
        assert a.in_flight == 0 and await a.wait_idle(0.01)
        with pytest.raises(ApiError, match="asks for 4 sequences") as e:  # never fits: a 400, not a retry
            with a.admit(4):
                pass
        assert e.value.status == 400 and a.in_flight == 0
        with a.admit(1):
            assert not await a.wait_idle(0.01)
            a.draining = True
            with pytest.raises(ApiError, match="shutting down") as e:
                with a.admit(1):
                    pass
            assert e.value.status == 503
    asyncio.run(run())


def test_a_model_served_by_a_relative_path_is_named_after_it(tmp_path, monkeypatch):
    """`runtime serve .` (or `q4/`) names the model after the directory: /v1/models had an empty id."""
    from flotilla.server.engine_client import _default_name

    (tmp_path / "q4").mkdir()
    (tmp_path / "m.gguf").write_bytes(b"")
    monkeypatch.chdir(tmp_path / "q4")
    assert _default_name(Path(".")) == "q4" and _default_name(Path("../q4/")) == "q4"
    assert _default_name(Path("../m.gguf")) == "m"
    (tmp_path / "model-q4.gguf").symlink_to(tmp_path / "m.gguf")  # a hub cache's link to a blob keeps its name
    assert _default_name(Path("../model-q4.gguf")) == "model-q4"


def test_echo_and_prompt_logprobs_map_to_the_engine_request():
    """echo with logprobs k asks the engine for the prompt's logprobs with k likeliest (vLLM's prompt_logprobs
    too, the larger wins); max_tokens 0 only with echo; an engine without prompt logprobs refuses them."""
    req = parse_completion({"prompt": "abcd", "echo": True, "logprobs": 2, "max_tokens": 0}, StubModel(), 8)
    assert req.echo and req.prompt_texts == ("abcd",) and req.params[0].prompt_logprobs == 2
    assert req.params[0].max_tokens == 0 and req.prompt_logprobs is None
    req = parse_completion({"prompt": [5, 6, 7], "echo": True, "logprobs": 1, "prompt_logprobs": 4}, StubModel(), 8)
    assert req.prompt_texts == (None,) and req.params[0].prompt_logprobs == 4 and req.prompt_logprobs == 4
    assert parse_completion({"prompt": "abcd", "echo": True}, StubModel(), 8).params[0].prompt_logprobs is None
    req = parse_completion({"prompt": "abcdefgh", "echo": True, "truncate_prompt_tokens": 3}, StubModel(), 8)
    assert req.prompt_texts == (None,)  # the kept tokens are echoed, decoded
    with pytest.raises(ApiError, match="0 only with echo"):
        parse_completion({"prompt": "abcd", "max_tokens": 0}, StubModel(), 8)
    with pytest.raises(ApiError, match="not available with 'stream'"):
        parse_completion({"prompt": "abcd", "prompt_logprobs": 1, "stream": True}, StubModel(), 8)

    class Without(StubModel):  # an engine whose executor does not compute them
        computes_prompt_logprobs = False

    with pytest.raises(ApiError, match="not computed by this server's engine"):
        parse_completion({"prompt": "abcd", "echo": True, "logprobs": 1}, Without(), 8)
    assert parse_completion({"prompt": "abcd", "echo": True}, Without(), 8).echo  # no logprobs: nothing to compute


def test_fields_no_part_of_the_request_read_are_named():
    """A misspelt or another server's field is named (the server logs it, as vLLM does); OpenAI's fields
    that change nothing here (user, metadata, ...) are not."""
    req = parse_completion({"prompt": "abc", "max_token": 1, "temprature": 0, "user": "me", "metadata": {}},
                           StubModel(), 8)
    assert req.ignored == ("max_token", "temprature")
    assert chat(top_k=3, min_p=0.1, logprobs=False, stream_options=None).ignored == ()
    assert chat(guided_json=None, response_format={"type": "text"}, tool_choice="none").ignored == ()
    options = {"include_usage": True, "continuous_usage_stats": True, "include_obfuscation": False}
    req = chat(stream=True, stream_options=options)
    assert req.continuous_usage and req.ignored == ("stream_options.include_obfuscation",)


def test_prompts_are_bounded_by_admission_not_max_n_and_scoring_may_fill_the_context():
    """--max-n bounds n; the prompts of a request (lm-eval sends its batch as one) are bounded by the
    server's sequences (admission), as vLLM sets no count; a prompt scored alone (echo, max_tokens 0) may be
    the whole context; empty prompt arrays and completions' top_logprobs are named."""
    req = parse_completion({"prompt": [[5, 6]] * 12, "echo": True, "logprobs": 1, "max_tokens": 1}, StubModel(), 8)
    assert req.num_choices == 12
    with pytest.raises(ApiError, match="--max-n"):
        parse_completion({"prompt": "abc", "n": 9}, StubModel(), 8)
    full = list(range(3, 67))  # 64 tokens: StubModel's whole context
    assert parse_completion({"prompt": full, "echo": True, "max_tokens": 0}, StubModel(), 8).params[0].max_tokens == 0
    with pytest.raises(ApiError, match="context holds 64"):
        parse_completion({"prompt": full, "echo": True, "max_tokens": 1}, StubModel(), 8)
    for prompt, words in (([], "got an empty array"), ([[]], "'prompt[0]' is an empty array"),
                          ([[50], []], "'prompt[1]' is an empty array")):
        with pytest.raises(ApiError, match=re.escape(words)):
            parse_completion({"prompt": prompt}, StubModel(), 8)
    with pytest.raises(ApiError, match="'logprobs': N"):
        parse_completion({"prompt": "abc", "top_logprobs": 2}, StubModel(), 8)


@pytest.mark.parametrize("body, param", [({"response_format": {}}, "response_format"),
                                         ({"response_format": {"a": 1}}, "response_format"),
                                         ({"tools": {}}, "tools"), ({"tools": [{"type": "function"}]}, "tools")])
def test_a_tool_or_response_format_that_cannot_be_honoured_is_refused(body, param):
    """A response_format without its type (OpenAI's requires one) and tools given as anything but an empty list
    are 400s (an audit found them answered 200, their request run as if absent)."""
    with pytest.raises(ApiError) as e:
        chat(**body)
    assert e.value.status == 400 and e.value.param == param
    assert chat(tools=[]).ignored == () and chat(response_format={"type": "text"}).params


def test_min_tokens_past_max_tokens_says_so():
    with pytest.raises(ApiError, match="no more than max_tokens"):
        chat(max_tokens=2, min_tokens=5)
