"""`runtime serve --speculative ngram`: the same greedy text over HTTP as without speculation
(streamed too), and /metrics reports the acceptance rate and accepted tokens per step."""
from __future__ import annotations

import json

import pytest

from flotilla.runtime.engine_args import EngineArgs, build_engine, generate
from flotilla.runtime.sampling import SamplingParams
from server_harness import loaded_model, start_server
from test_server_limits import parse_exposition, request

MODEL = "SmolLM2-135M-Instruct"
TEXT = ("Edit this list, keeping every line and fixing the typos only:\n"
        "- the quick brown fox jumsp over the lazy dog\n- a journey of a thousand miles begins with one stpe\n"
        "- all that glitters is not gold\n")


@pytest.fixture(scope="module")
def live(smollm2_gguf):
    server = start_server(smollm2_gguf, engine={"speculative": "ngram", "num_speculative_tokens": 5,
                                                "max_num_seqs": 4})
    yield server
    server.stop()


def test_speculative_server_text_and_metrics(live, smollm2_gguf):
    lm = loaded_model(smollm2_gguf)
    messages = [{"role": "user", "content": TEXT}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    status, _, data = request(live.url, "POST", "/v1/chat/completions", body)
    assert status == 200, data
    plain = generate(build_engine(lm, EngineArgs(kv_cache_memory="64MiB")),
                     [lm.tokenizer.apply_chat_template(messages)],
                     SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))[0]
    assert data["choices"][0]["message"]["content"] == lm.tokenizer.decode(plain)
    assert data["usage"]["completion_tokens"] == 48

    status, _, sse = request(live.url, "POST", "/v1/chat/completions", {**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in sse.split("\n") if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) \
        == data["choices"][0]["message"]["content"]

    status, _, text = request(live.url, "GET", "/metrics")
    m = parse_exposition(text)
    drafts, accepted = m[("flotilla_spec_draft_tokens_total", ())], m[("flotilla_spec_accepted_tokens_total", ())]
    steps = m[("flotilla_spec_verify_steps_total", ())]
    assert 0 < accepted < drafts and steps > 0
    assert m[("flotilla_spec_acceptance_rate", ())] == pytest.approx(accepted / drafts, abs=1e-6)
    assert m[("flotilla_spec_accepted_tokens_per_step", ())] == pytest.approx(accepted / steps, abs=1e-6)
    # the text repeats its input: n-gram drafts save steps (two requests of 48 tokens each)
    assert accepted >= 20


def test_generate_cli_speculates_and_reports_acceptance(smollm2_gguf):
    from test_cli_engine import runtime

    prompt = "Repeat exactly: one two three four five six seven eight nine ten"
    p = runtime("generate", str(smollm2_gguf), "-p", prompt, "--chat", "--max-tokens", "20",
                "--kv-cache-memory", "32MiB", "--speculative", "ngram", "--num-speculative-tokens", "3", "--stats")
    assert p.returncode == 0, p.stderr
    lm = loaded_model(smollm2_gguf)
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    plain = generate(build_engine(lm, EngineArgs(kv_cache_memory="32MiB")), [ids],
                     SamplingParams(max_tokens=20, temperature=0))[0]
    assert p.stdout == lm.tokenizer.decode(plain) + "\n"
    assert "drafts accepted" in p.stderr and "a verify step]" in p.stderr


@pytest.mark.parametrize("flag, message", [
    (["--speculative", "medusa"], "error: --speculative 'medusa': expected one of ngram, draft:PATH"),
    (["--speculative", "ngram", "--num-speculative-tokens", "0"], "error: --num-speculative-tokens must be in [1, 32]"),
])
def test_bad_speculative_flags_are_one_line_errors(smollm2_gguf, flag, message):
    from test_cli_engine import runtime

    p = runtime("generate", str(smollm2_gguf), "-p", "hi", "--kv-cache-memory", "32MiB", *flag)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith(message)
