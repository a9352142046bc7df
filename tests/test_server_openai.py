"""The official openai client against a live server on loopback: chat and completions, streamed
and not, equal to the engine's own greedy output; usage, stop strings, logprobs, n, seeds."""
from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from flotilla.runtime.sampling import SamplingParams
from server_harness import start_server

QUESTION = "Name three colours of the rainbow."


@pytest.fixture(scope="module")
def live(smollm2_gguf):
    server = start_server(smollm2_gguf)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.api, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def chat_prompt(live, content=QUESTION):
    return live.engine.tokenizer.apply_chat_template([{"role": "user", "content": content}])


def test_chat_equals_engine_greedy(live, client):
    expected, ids, reason = live.engine_text(chat_prompt(live), SamplingParams(max_tokens=24, temperature=0))
    r = client.chat.completions.create(model=live.engine.model_name, max_tokens=24, temperature=0,
                                       messages=[{"role": "user", "content": QUESTION}])
    assert expected.strip()
    assert r.choices[0].message.content == expected
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == reason
    assert r.usage.completion_tokens == len(ids)
    assert r.usage.prompt_tokens == len(chat_prompt(live))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")


def test_chat_stream_equals_engine_greedy_with_usage(live, client):
    expected, ids, reason = live.engine_text(chat_prompt(live), SamplingParams(max_tokens=24, temperature=0))
    stream = client.chat.completions.create(model=live.engine.model_name, max_completion_tokens=24, temperature=0,
                                            messages=[{"role": "user", "content": QUESTION}], stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 3  # really streamed
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats_give_the_usage_so_far_in_every_chunk(live, client):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk's usage counts the tokens so
    far; the last chunk is the usage chunk as before."""
    stream = client.chat.completions.create(model=live.engine.model_name, max_completion_tokens=10, temperature=0,
                                            messages=[{"role": "user", "content": QUESTION}], stream=True,
                                            extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    prompt = len(chat_prompt(live))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage.prompt_tokens == prompt for c in chunks) and counts == sorted(counts)
    assert counts[0] == 0 and counts[-1] == 10 and chunks[-1].choices == []
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 3


def test_completion_equals_engine_greedy_both_ways(live, client):
    prompt = "The capital of France is"
    expected, ids, _ = live.engine_text(live.engine.tokenizer.encode(prompt),
                                        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    r = client.completions.create(model=live.engine.model_name, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 == len(ids)
    chunks = list(client.completions.create(model=live.engine.model_name, prompt=prompt, max_tokens=12,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_of_token_ids_and_default_max_tokens(live, client):
    ids = live.engine.tokenizer.encode("Once upon a time")
    r = client.completions.create(model=live.engine.model_name, prompt=ids, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 16  # OpenAI's default max_tokens for completions


def test_stop_string_cuts_the_text(live, client):
    full, _, _ = live.engine_text(chat_prompt(live), SamplingParams(max_tokens=24, temperature=0))
    words = full.split()
    stop = " " + words[2]
    r = client.chat.completions.create(model=live.engine.model_name, max_tokens=24, temperature=0, stop=[stop],
                                       messages=[{"role": "user", "content": QUESTION}])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[:full.index(stop)]


def test_logprobs_chat_and_completion(live, client):
    r = client.chat.completions.create(model=live.engine.model_name, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=3, messages=[{"role": "user", "content": QUESTION}])
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-5)  # greedy picks the top one
        assert item.token == item.top_logprobs[0].token
    assert "".join(i.token for i in content) == r.choices[0].message.content
    c = client.completions.create(model=live.engine.model_name, prompt="Once upon a time", max_tokens=3,
                                  temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    # offsets in the completion's text, as vLLM's without echo (which this server refuses)
    assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    streamed = [ch.choices[0].logprobs for ch in client.completions.create(
        model=live.engine.model_name, prompt="Once upon a time", max_tokens=3, temperature=0, logprobs=2, stream=True)
        if ch.choices[0].logprobs is not None and ch.choices[0].logprobs.tokens]
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


def test_vllm_stop_fields_min_tokens_and_logit_bias(live, client):
    """stop_reason, include_stop_str_in_output, min_tokens and logit_bias, as vLLM serves them."""
    full, _, _ = live.engine_text(chat_prompt(live), SamplingParams(max_tokens=24, temperature=0))
    stop = " " + full.split()[2]
    kw = dict(model=live.engine.model_name, max_tokens=24, temperature=0,
              messages=[{"role": "user", "content": QUESTION}])
    r = client.chat.completions.create(stop=[stop], extra_body={"include_stop_str_in_output": True}, **kw)
    assert r.choices[0].message.content == full[:full.index(stop) + len(stop)]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == stop
    streamed = list(client.chat.completions.create(stop=[stop], stream=True, **kw))
    assert [c.choices[0].stop_reason for c in streamed if c.choices[0].finish_reason] == [stop]
    assert client.chat.completions.create(**kw).choices[0].stop_reason is None  # length
    # an answer that ends at once (eos) goes on to min_tokens; eos gives stop_reason None, as vLLM
    short = [{"role": "user", "content": "Reply with one word: yes or no. Is water wet?"}]
    text, ids, reason = live.engine_text(live.engine.tokenizer.apply_chat_template(short),
                                         SamplingParams(max_tokens=24, temperature=0))
    assert reason == "stop" and len(ids) < 8, (text, ids)
    r = client.chat.completions.create(model=live.engine.model_name, max_tokens=24, temperature=0, messages=short)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason is None
    r = client.chat.completions.create(model=live.engine.model_name, max_tokens=24, temperature=0, messages=short,
                                       extra_body={"min_tokens": 8})
    assert r.usage.completion_tokens >= 8 and r.choices[0].message.content.startswith(text)
    # continue_final_message: the reply continues the assistant's last message, from inside its turn
    start = [{"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": "The capital of France is "}]  # cut as transformers cuts
    r = client.chat.completions.create(model=live.engine.model_name, max_tokens=4, temperature=0, messages=start,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r.choices[0].message.content.startswith(" Paris"), r.choices[0].message.content
    # logit_bias: the greedy first token, banned, gives way
    first = live.engine.tokenizer.encode(full, add_special_tokens=False)[0]
    r = client.chat.completions.create(logit_bias={str(first): -100}, max_completion_tokens=4,
                                       **{k: v for k, v in kw.items() if k != "max_tokens"})
    assert not r.choices[0].message.content.startswith(live.engine.tokenizer.decode([first]))


def test_completion_text_offset_and_top_logprobs_with_multibyte_text(live, client):
    """Tokens that are pieces of a character get the character's offset, streamed or not, and each
    top_logprobs row holds the sampled token (up to logprobs + 1 entries), as vLLM's."""
    kw = dict(model=live.engine.model_name, prompt="🌳🌲🌴🌵🎄🌳🌲🌴🌵", max_tokens=8, temperature=1.5, seed=3,
              logprobs=1)
    c = client.completions.create(**kw)
    lp, text = c.choices[0].logprobs, c.choices[0].text
    assert all(0 <= o <= len(text) for o in lp.text_offset) and lp.text_offset == sorted(lp.text_offset)
    streamed = [o for ch in client.completions.create(stream=True, **kw) if ch.choices[0].logprobs is not None
                for o in ch.choices[0].logprobs.text_offset]
    assert streamed == lp.text_offset
    for token, top in zip(lp.tokens, lp.top_logprobs):
        assert token in top and 1 <= len(top) <= 2
    c = client.completions.create(**{**kw, "logprobs": 0})
    assert all(list(top) == [t] for t, top in zip(c.choices[0].logprobs.tokens, c.choices[0].logprobs.top_logprobs))


def test_n_choices_and_seeds(live, client):
    kw = dict(model=live.engine.model_name, max_tokens=8, temperature=1.0, seed=1234,
              messages=[{"role": "user", "content": "Write a word."}])
    a = client.chat.completions.create(n=3, **kw)
    b = client.chat.completions.create(n=3, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]  # seeded
    assert len({c.message.content for c in a.choices}) > 1  # each choice has its own seed
    assert a.usage.prompt_tokens == len(chat_prompt(live, "Write a word."))  # counted once
    assert 3 <= a.usage.completion_tokens <= 3 * 8
    streamed = list(client.chat.completions.create(n=2, stream=True, **kw))
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == {0: a.choices[0].message.content, 1: a.choices[1].message.content}


def test_models_list_and_retrieve(live, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [live.engine.model_name]
    assert client.models.retrieve(live.engine.model_name).id == live.engine.model_name
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-5")
    assert "SmolLM2" in str(e.value)


def test_client_disconnect_aborts_the_request(live):
    aborted = live.state.metrics.finished.get("abort")

    async def run():
        async with aiohttp.ClientSession() as s:
            body = {"model": live.engine.model_name, "prompt": "Count to a thousand:", "max_tokens": 2000,
                    "stream": True, "ignore_eos": True}
            resp = await s.post(live.api + "/completions", json=body)
            got = 0
            async for line in resp.content:
                got += line.startswith(b"data: ")
                if got >= 3:
                    break
            assert live.stats().num_running + live.stats().num_waiting == 1
            resp.close()  # drop the connection mid-stream
        for _ in range(200):
            s = live.stats()
            if s.num_running + s.num_waiting == 0 and live.state.admission.in_flight == 0:
                return True
            await asyncio.sleep(0.05)
        return False
    assert asyncio.run(run())
    assert live.stats().kv_blocks_free == live.stats().kv_blocks_total
    assert live.state.metrics.finished.get("abort") == aborted + 1  # counted once, as an abort


def test_client_disconnect_aborts_a_non_streaming_request(live):
    async def run():
        async with aiohttp.ClientSession() as s:
            body = {"model": live.engine.model_name, "prompt": "Count to a thousand:", "max_tokens": 2000,
                    "ignore_eos": True}
            task = asyncio.create_task(s.post(live.api + "/completions", json=body))
            for _ in range(400):  # until the engine has it
                if live.stats().num_running == 1:
                    break
                await asyncio.sleep(0.05)
            task.cancel()  # the client gives up: its connection closes
            await asyncio.gather(task, return_exceptions=True)
        for _ in range(200):
            s = live.stats()
            if s.num_running + s.num_waiting == 0 and live.state.admission.in_flight == 0:
                return s
            await asyncio.sleep(0.05)
    stats = asyncio.run(run())
    assert stats is not None and stats.kv_blocks_free == stats.kv_blocks_total
    assert live.state.metrics.requests.get("/v1/completions", "499") >= 1


def dense_logprobs(live, ids: list[int]):
    """The oracle for prompt logprobs: the model over the whole prompt with dense causal attention (not the
    paged cache), log-softmax per position: row p is the distribution of the token at p + 1."""
    import torch

    from flotilla.models.attention import DenseCausalAttention
    from server_harness import loaded_model

    model = loaded_model(live.model_path).model
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention(1, len(ids)))
        return torch.log_softmax(model.compute_logits(hidden[:-1]), dim=-1)


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(live, client):
    """lm-eval's loglikelihood request (token ids, echo, logprobs 1, max_tokens 1, temperature 0): the
    prompt's token_logprobs equal the dense forward's, the first null; top_logprobs hold the token and the
    likeliest (lm-eval's is_greedy); max_tokens 0 scores the prompt alone; a stream gives the same."""
    ids = live.engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. The capital of France is Paris.")
    want = dense_logprobs(live, ids)
    c = client.completions.create(model=live.engine.model_name, prompt=ids, echo=True, logprobs=1, max_tokens=1,
                                  temperature=0)
    choice = c.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 1 and c.usage.completion_tokens == 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p, (v, top) in enumerate(zip(lp.token_logprobs[1:len(ids)], lp.top_logprobs[1:len(ids)])):
        row = want[p]
        assert v == pytest.approx(row[ids[p + 1]].item(), abs=2e-3)
        assert (v == max(top.values())) == (int(row.argmax()) == ids[p + 1])  # lm-eval's is_greedy
        assert lp.tokens[p + 1] in top and len(top) <= 2
    prompt_text = live.engine.tokenizer.decode(ids)
    assert choice.text.startswith(prompt_text) and lp.text_offset[len(ids)] == len(prompt_text)
    assert lp.text_offset[:len(ids)] == sorted(lp.text_offset[:len(ids)])
    # max_tokens 0: the prompt alone, its text as sent
    text = "Once upon a time, there was a robot."
    c = client.completions.create(model=live.engine.model_name, prompt=text, echo=True, logprobs=0, max_tokens=0)
    n = len(live.engine.tokenizer.encode(text))
    assert c.choices[0].text == text and c.usage.completion_tokens == 0 and c.choices[0].finish_reason == "length"
    assert len(c.choices[0].logprobs.tokens) == n and c.choices[0].logprobs.token_logprobs[0] is None
    # streamed: the prompt in the first chunk, the same text and offsets
    kw = dict(model=live.engine.model_name, prompt=text, echo=True, logprobs=2, max_tokens=4, temperature=0)
    whole = client.completions.create(**kw).choices[0]
    chunks = [ch.choices[0] for ch in client.completions.create(stream=True, **kw)]
    assert "".join(ch.text for ch in chunks) == whole.text and whole.text.startswith(text)
    assert [o for ch in chunks if ch.logprobs for o in ch.logprobs.text_offset] == whole.logprobs.text_offset
    assert client.completions.create(model=live.engine.model_name, prompt=text, echo=True,
                                     max_tokens=2).choices[0].text.startswith(text)  # echo without logprobs


def test_vllm_prompt_logprobs_and_their_refusals(live, client):
    ids = live.engine.tokenizer.encode("Paris is the capital of France.")
    want = dense_logprobs(live, ids)
    c = client.completions.create(model=live.engine.model_name, prompt=ids, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    pl = c.choices[0].model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    for p, row in enumerate(pl[1:]):
        token = str(ids[p + 1])
        assert row[token]["logprob"] == pytest.approx(want[p][ids[p + 1]].item(), abs=2e-3)
        assert row[token]["rank"] == int((want[p] > want[p][ids[p + 1]]).sum()) + 1
        assert {e["rank"] for t, e in row.items() if t != token} <= {1, 2} and 2 <= len(row) <= 3
    chat = [{"role": "user", "content": QUESTION}]
    r = client.chat.completions.create(model=live.engine.model_name, max_tokens=1, messages=chat,
                                       extra_body={"prompt_logprobs": 0})
    assert len(r.model_extra["prompt_logprobs"]) == r.usage.prompt_tokens
    for bad in (dict(extra_body={"prompt_logprobs": 1}, stream=True), dict(extra_body={"echo": True})):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=live.engine.model_name, max_tokens=1, messages=chat, **bad)
    with pytest.raises(openai.BadRequestError, match="0 only with echo"):
        client.completions.create(model=live.engine.model_name, prompt="Hi", max_tokens=0)


def test_tokenizer_endpoints_serve_lm_evals_remote_tokenizer(live):
    """POST /tokenize, POST /detokenize, GET /tokenizer_info as vLLM's (what lm-eval's remote tokenizer checks
    for and uses: eos_token in the info, a list of tokens), equal to the engine's own tokenizer."""
    import json
    import urllib.error
    import urllib.request

    def call(path, body=None):  # (status, JSON body)
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(base + path, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    base, tok = live.url, live.engine.tokenizer
    info = call("/tokenizer_info")[1]
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"] and info["model_max_length"] > 0
    text = "The quick brown fox, 🦊!"
    r = call("/tokenize", {"prompt": text, "add_special_tokens": False})[1]
    assert r["tokens"] == tok.encode(text, add_special_tokens=False) and r["count"] == len(r["tokens"])
    chat = call("/tokenize", {"messages": [{"role": "user", "content": QUESTION}]})[1]
    assert chat["tokens"] == chat_prompt(live)
    back = call("/detokenize", {"tokens": r["tokens"]})[1]
    assert back["prompt"] == text
    for path, body, param in (("/detokenize", {"tokens": [10 ** 9]}, "tokens"), ("/detokenize", {}, "tokens"),
                              ("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"model": "other", "prompt": "a"},
                                                                       "model")):
        status, err = call(path, body)
        assert 400 <= status < 500 and err["error"]["param"] == param, err
