"""`runtime bench --random tiny` end to end on CPU (a subprocess, as users run it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def runtime(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "flotilla.runtime.cli", *args], env=env,
                          capture_output=True, text=True, timeout=600)


def test_bench_random_tiny_decodes_every_token_of_every_stream():
    p = runtime("bench", "--random", "tiny", "--bits", "4", "--batch", "1,3", "--tokens", "6", "--prompt-len", "5",
                "--device", "cpu", "--json")
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["model"] == "random tiny (int4 g128)" and r["device"] == "cpu" and r["dtype"] == "float32"
        assert r["decode_tokens"] == r["batch"] * 5  # 6 tokens a stream, the first from the prefill step
        assert r["decode_steps"] == 5 and r["graphs"] is False and r["overlap"] is False  # a CPU: no overlap
        assert r["tok_s"] > 0 and abs(r["tok_s_per_stream"] * r["batch"] - r["tok_s"]) < 1e-6 * r["tok_s"]


def test_bench_table_and_errors():
    p = runtime("bench", "--random", "tiny", "--bits", "8", "--tokens", "3", "--prompt-len", "2", "--device", "cpu")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("random tiny (int8 g128) on cpu (float32)")
    assert lines[1].split() == ["batch", "tok/s", "tok/s/stream", "ms/step", "graphs", "overlap"]
    assert lines[2].split()[0] == "1" and lines[2].split()[-1] == "no"
    bad = runtime("bench", "--random", "llama-9", "--device", "cpu")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "error: unknown model shape 'llama-9'; valid: llama-3-8b, llama-3-70b, tiny"
    bad = runtime("bench", "--random", "tiny", "--batch", "1,x", "--device", "cpu")
    assert bad.returncode == 2 and "--batch '1,x': expected positive integers" in bad.stderr


def test_bench_runs_a_gguf_file_and_the_default_model(smollm2_gguf):
    """`runtime bench` on a GGUF file (the embedded default): the table, with the bytes its kernels read
    a step (the packed GGUF forms and the tied Q8_0 table), not a traceback."""
    for args in ((str(smollm2_gguf),), ()):
        p = runtime("bench", *args, "--batch", "1", "--tokens", "3", "--prompt-len", "2", "--device", "cpu")
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
        head = p.stdout.splitlines()[0]
        assert head.startswith(f"{smollm2_gguf} on cpu (float32), 0.0"), head  # ~90 MB of SmolLM2's forms
        assert float(head.split(", ")[1].split()[0]) > 0.05
