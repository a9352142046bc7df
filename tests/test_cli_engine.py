"""`runtime generate` and `runtime chat` run on the engine (subprocesses, as users run them)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
    assert "KV cache: 45 blocks x 16 tokens" in p.stderr and "6 tokens" in p.stderr


def test_chat_keeps_the_conversation_and_stops_at_a_stop_string(smollm2_gguf):
    p = runtime("chat", str(smollm2_gguf), "--max-tokens", "12", "--kv-cache-memory", "32MiB", "--stop", ".",
                stdin="What is the capital of France?\nAnd of Italy?\n")
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    assert len(lines) == 2 and "Paris" in lines[0] and "Rome" in lines[1]
    assert not any(ln.rstrip().endswith(".") for ln in lines)  # the stop string is never printed


def test_bad_engine_flags_are_one_line_errors(smollm2_gguf):
    p = runtime("generate", str(smollm2_gguf), "-p", "hi", "--kv-cache-memory", "lots")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("error: --kv-cache-memory 'lots': expected a size")


def test_the_default_kv_cache_on_a_cpu_comes_from_the_context(smollm2_gguf):
    p = runtime("generate", str(smollm2_gguf), "-p", "Hi", "--max-tokens", "2", "--max-model-len", "2048")
    assert p.returncode == 0, p.stderr
    line = next(ln for ln in p.stderr.splitlines() if ln.startswith("KV cache:"))
    assert line.startswith("KV cache: 129 blocks x 16 tokens = 2064 tokens, 90.7 MiB"), line  # 2048 + the null block
    assert "default on CPU: 2048 tokens for up to 1 sequence of up to 2048" in line
