"""`runtime generate` and `runtime chat` run on the engine (subprocesses, as users run them)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def runtime(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "flotilla.runtime.cli", *args], input=stdin, env=env,
                          capture_output=True, text=True, timeout=600)


def test_generate_streams_greedy_text_and_reports_the_kv_cache(smollm2_gguf):
    p = runtime("generate", str(smollm2_gguf), "-p", "The capital of France is", "--max-tokens", "6",
                "--kv-cache-memory", "32MiB", "--stats")
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout
    assert "KV cache: 44 blocks x 16 tokens" in p.stderr and "6 tokens" in p.stderr


def test_chat_keeps_the_conversation_and_stops_at_a_stop_string(smollm2_gguf):
    p = runtime("chat", str(smollm2_gguf), "--max-tokens", "12", "--kv-cache-memory", "32MiB", "--stop", ".",
                "--temperature", "0",
                stdin="What is the capital of France?\nAnd of Italy?\n")
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    assert len(lines) == 2 and "Paris" in lines[0] and "Rome" in lines[1]
    assert not any(ln.rstrip().endswith(".") for ln in lines)  # the stop string is never printed


def test_chat_over_local_workers_keeps_their_log_out_of_the_reply(smollm2_gguf):
    """`runtime chat --pp 2`: the workers run at --log-level error (their notices would land inside a streamed
    reply), and each line of theirs that does come is whole and prefixed."""
    p = runtime("chat", str(smollm2_gguf), "--pp", "2", "--threads", "2", "--max-tokens", "12", "--temperature", "0",
                stdin="What is the capital of France?\n")
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout and "INFO" not in p.stderr and "WARNING" not in p.stderr, p.stderr
    assert all(ln.startswith(("[worker ", "starting ", "pipeline ", "  ")) for ln in p.stderr.splitlines()), p.stderr


def test_bad_engine_flags_are_one_line_errors(smollm2_gguf):
    p = runtime("generate", str(smollm2_gguf), "-p", "hi", "--kv-cache-memory", "lots")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("error: --kv-cache-memory 'lots': expected a size")


def test_engine_flags_out_of_range_fail_before_the_model_loads():
    """Zero, negative or odd engine sizes are one line naming the flag (they were a ZeroDivisionError, a
    ValueError, or a KV cache of -511 blocks), checked before anything loads."""
    from flotilla.errors import FlotillaError
    from flotilla.runtime.engine_args import EngineArgs

    for kwargs, words in (({"block_size": 0}, "--block-size 0: expected an integer of at least 1"),
                          ({"block_size": 12}, "--block-size 12: expected a power of two"),
                          ({"max_num_seqs": -1}, "--max-num-seqs -1"), ({"max_num_seqs": 0}, "--max-num-seqs 0"),
                          ({"max_num_batched_tokens": 0}, "--max-num-batched-tokens 0"),
                          ({"max_model_len": 0}, "--max-model-len 0"), ({"kv_cache_fraction": 1.5}, "(0, 1]")):
        with pytest.raises(FlotillaError, match=re.escape(words)):
            EngineArgs(**kwargs)
    p = runtime("generate", "/nonexistent/model", "-p", "hi", "--block-size", "0")
    assert p.returncode == 2 and p.stderr.strip() == "error: --block-size 0: expected an integer of at least 1"


def test_generate_reads_its_prompt_from_a_file_or_stdin_and_refuses_an_empty_one_before_loading(smollm2_gguf,
                                                                                                tmp_path):
    args = ("--max-tokens", "6", "--kv-cache-memory", "32MiB")
    want = runtime("generate", str(smollm2_gguf), "-p", "The capital of France is", *args)
    assert want.returncode == 0, want.stderr
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The capital of France is\n")  # the file's last newline is not part of the prompt
    for p in (runtime("generate", str(smollm2_gguf), "-f", str(prompt), *args),
              runtime("generate", str(smollm2_gguf), *args, stdin="The capital of France is\n")):
        assert p.returncode == 0 and p.stdout == want.stdout, p.stderr
    for flags, stdin, words in ((["-p", ""], None, "the prompt is empty"), ([], "", "stdin gave an empty prompt"),
                                (["-f", str(tmp_path / "missing.txt")], None, "cannot read it"),
                                (["-p", "hi", "--max-tokens", "0"], None, "--max-tokens must be at least 1")):
        p = runtime("generate", "/nonexistent/model", *flags, stdin=stdin)  # said before any model loads
        assert p.returncode == 2 and words in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_a_max_model_len_past_the_model_is_said_and_capped(smollm2_gguf):
    p = runtime("generate", str(smollm2_gguf), "-p", "Hi", "--max-tokens", "2", "--max-model-len", "100000",
                "--kv-cache-memory", "32MiB")
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("--max-model-len 100000 is past the model's context; serving 8192") == 1


def test_generate_says_when_the_context_ends_the_reply(smollm2_gguf):
    p = runtime("generate", str(smollm2_gguf), "-p", "Once upon a time", "--max-tokens", "100", "--max-model-len", "24",
                "--temperature", "0")
    assert p.returncode == 0, p.stderr
    assert "[stopped after 20 tokens: the prompt's 4 and the reply filled the 24-token context" in p.stderr
    p = runtime("generate", str(smollm2_gguf), "-p", "Once upon a time", "--max-tokens", "5", "--max-model-len", "24")
    assert p.returncode == 0 and "stopped after" not in p.stderr  # --max-tokens ended it


def test_a_sliding_window_model_is_served_its_whole_context(tmp_path):
    from conftest import make_hf_model, tiny_config

    from flotilla.runtime.engine_args import EngineArgs, build_engine
    from flotilla.runtime.loader import load_model

    path = tmp_path / "mistral-sw"
    make_hf_model(tiny_config("mistral", sliding_window=32, max_position_embeddings=256)).save_pretrained(path)
    lines: list[str] = []
    engine = build_engine(load_model(path, "cpu", with_tokenizer=False), EngineArgs(kv_cache_memory="4MiB"),
                          report=lines.append)
    assert not any("sliding window" in line for line in lines)  # its layers attend within the window
    assert engine.config.context_len == 256


def test_the_default_kv_cache_on_a_cpu_comes_from_the_context(smollm2_gguf):
    p = runtime("generate", str(smollm2_gguf), "-p", "Hi", "--max-tokens", "2", "--max-model-len", "2048")
    assert p.returncode == 0, p.stderr
    line = next(ln for ln in p.stderr.splitlines() if ln.startswith("KV cache:"))
    assert line.startswith("KV cache: 128 blocks x 16 tokens = 2048 tokens (+1 padding block), 90.7 MiB"), line
    assert "default on CPU: 2048 tokens for up to 1 sequence of up to 2048" in line


def test_chat_drops_the_oldest_turns_to_fit_the_context_and_skips_blank_lines(smollm2_gguf):
    """A conversation that outgrows the context keeps going: the oldest turns are dropped (said on stderr), a
    blank line is skipped rather than quitting, and a message too long on its own is refused for that turn."""
    asks = ["Tell me a long story about a dragon and a knight."] * 4
    p = runtime("chat", str(smollm2_gguf), "--max-tokens", "60", "--max-model-len", "256", "--kv-cache-memory",
                "32MiB", "--temperature", "0", stdin="\n".join([asks[0], "", *asks[1:], "word " * 300, "/reset", "What is the capital of France?"]) + "\n")
    assert p.returncode == 0, p.stderr
    assert "oldest messages were dropped to fit the context of 256 tokens" in p.stderr
    assert "that message alone (" in p.stderr and "send a shorter one" in p.stderr
    assert "Paris" in p.stdout.splitlines()[-1]


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(smollm2_gguf):
    """Ctrl-C (SIGINT) during a reply stops that reply between engine steps ("[stopped]"), and the next
    message is answered; the process exits 0 at the end of its input."""
    import select
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "flotilla.runtime.cli", "chat", str(smollm2_gguf), "--max-tokens",
                             "2000", "--kv-cache-memory", "64MiB", "--temperature", "0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        proc.stdin.write("Write a 1000-word essay about the history of Rome.\n")  # a reply of many steps
        proc.stdin.flush()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # the reply has begun
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready and proc.stdout.read(1):
                break
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate("What is the capital of France?\n", timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "[stopped]" in err and "Traceback" not in err
    assert "Paris" in out.splitlines()[-1]


def test_more_bad_flags_are_one_line_errors():
    for args, message in ((("--device", "mps"), "error: device 'mps': flotilla runs on cpu, cuda or cuda:N"),
                          (("--device", "meta"), "error: device 'meta': flotilla runs on cpu, cuda or cuda:N"),
                          (("--num-speculative-tokens", "3"), "error: --num-speculative-tokens 3 without --speculative"),
                          (("--temperature", "nan"), "error: --temperature must be a finite number >= 0"),
                          (("--temperature", "inf"), "error: --temperature must be a finite number >= 0")):
        p = runtime("generate", "-p", "hi", *args)
        assert p.returncode == 2 and p.stderr.startswith(message) and "Traceback" not in p.stderr, (args, p.stderr)


def test_threads_flag_sets_the_compute_threads(capsys):
    import torch

    from flotilla.server.cli import main

    before = torch.get_num_threads()
    try:
        assert main(["bench", "--random", "tiny", "--tokens", "2", "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
        assert main(["bench", "--random", "tiny", "--threads", "0"]) == 2
        assert "error: --threads must be at least 1, got 0" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)


def test_a_kernel_setting_with_a_typo_is_one_line(monkeypatch):
    """FLOTILLA_KERNEL / FLOTILLA_CPU_ISA with a typo: one error line before anything loads (the first was ignored
    for a GGUF file and a traceback for a checkpoint; the second fell back to dense fp32, 4x slower)."""
    for var, value, message in (("FLOTILLA_KERNEL", "bogus", "error: FLOTILLA_KERNEL='bogus' is not a kernel; valid: "),
                                ("FLOTILLA_CPU_ISA", "avx9", "error: FLOTILLA_CPU_ISA='avx9' is not an instruction set; valid: "
                                                          "avx2, avx512"),
                                ("GLOO_SOCKET_IFNAME", "nosuch0", "error: GLOO_SOCKET_IFNAME='nosuch0': no interface "
                                                                  "nosuch0 on this machine")):
        monkeypatch.setenv(var, value)
        p = runtime("generate", "-p", "hi", "--max-tokens", "2", *(("--tp", "3") if var.startswith("GLOO") else ()))
        monkeypatch.delenv(var)
        assert p.returncode == 2 and p.stderr.startswith(message) and "Traceback" not in p.stderr, p.stderr


def test_user_mistakes_are_named_before_any_model_loads(tmp_path):
    """What a vLLM / llama.cpp user types by habit: `runtime quantize` points at the quantize command; an option a
    command does not take is named with that command's usage; -t is --threads; a bad --kv-cache-memory is said
    before the model loads; a folder holding a .gguf names the file to give."""
    p = runtime("quantize", "model.gguf")
    assert p.returncode == 2 and "quantize is a command of its own" in p.stderr and "'quantize model.gguf'" in p.stderr
    p = runtime("generate", "-p", "hi", "--n-predict=4")
    assert p.returncode == 2 and "runtime generate: error: unrecognized arguments: --n-predict=4" in p.stderr, p.stderr
    assert "usage: runtime generate" in p.stderr
    p = runtime("generate", "-p", "hi", "--pp", "2")  # another command's option: named where it belongs
    assert p.returncode == 2 and "--pp is an option of runtime chat" in p.stderr, p.stderr
    p = runtime("generate", "-p", "hi", "-t", "0")
    assert p.returncode == 2 and "--threads must be at least 1" in p.stderr, p.stderr
    env = {**os.environ, "PYTHONPATH": str(REPO), "FLOTILLA_GEMV_GROUP32": "core"}
    env_typo = subprocess.run([sys.executable, "-m", "flotilla.server.cli", "generate", "-p", "hi"], text=True,
                              capture_output=True, env=env, timeout=120)
    assert env_typo.returncode == 2 and "FLOTILLA_GEMV_GROUP32='core': expected one of" in env_typo.stderr
    p = runtime("generate", "-p", "hi", "--kv-cache-memory", "lots")
    assert p.returncode == 2 and "--kv-cache-memory 'lots': expected a size" in p.stderr, p.stderr
    assert "loaded" not in p.stderr.lower() and "loading" not in p.stderr.lower()
    (tmp_path / "SmolLM2.Q4_1.gguf").write_bytes(b"")
    p = runtime("generate", str(tmp_path), "-p", "hi")
    assert p.returncode == 2 and f"give the file itself: {tmp_path / 'SmolLM2.Q4_1.gguf'}" in p.stderr, p.stderr


def test_a_chat_template_of_ones_own_replaces_the_models(smollm2_gguf, tmp_path):
    """--chat-template (as vLLM's): a file or the template itself; this one drops the user's words for a prompt
    of its own, whose greedy continuation says so."""
    template = tmp_path / "t.jinja"
    template.write_text("{{ 'The capital of France is' }}")
    for value in (str(template), "{{ 'The capital of France is' }}"):
        p = runtime("generate", str(smollm2_gguf), "--chat", "-p", "Tell me a joke", "--chat-template", value,
                    "--max-tokens", "4", "--kv-cache-memory", "32MiB", "--temperature", "0")
        assert p.returncode == 0, p.stderr
        assert "Paris" in p.stdout, p.stdout


@pytest.mark.parametrize("value, said", [("{% for m in messages %}{{ m.content }", "--chat-template: line 1: "),
                                         ("{% for m in messages %}" + "x" * 300 + "{{ m.content }",
                                          "--chat-template: line 1: "),  # longer than a file name may be
                                         ("no-such-template.jinja", "no such file, and not a Jinja template"),
                                         ("{{ 'x' }}", "add --chat")])
def test_a_bad_chat_template_is_one_line_before_the_model_loads(value, said):
    chat = ["--chat"] if said != "add --chat" else []
    p = runtime("generate", "/nonexistent/model", *chat, "-p", "hi", "--chat-template", value)
    assert p.returncode == 2 and said in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
