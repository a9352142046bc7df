"""A tensor-parallel rank killed while a request is being generated: the client's error says in plain words
that a rank died (which one), not gloo's text; the server logs one line for it (no traceback) and exits with
status 1."""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

from quantize_helpers import tiny_model_dir
from tp_helpers import start_tp_server


def _rank_pids(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children  # the spawned ranks (not multiprocessing's resource tracker)
            if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def test_a_rank_killed_mid_request_is_said_in_plain_words(tmp_path):
    model = tiny_model_dir(tmp_path / "fp32", seed=1, max_position_embeddings=4096)
    proc, url = start_tp_server(model, "--grace-period", "5")
    try:
        (rank,) = _rank_pids(proc.pid)
        os.kill(rank, signal.SIGSTOP)  # the request's first step waits in a collective for rank 1
        body = json.dumps({"model": "fp32", "prompt": "hello", "max_tokens": 2000, "stream": True,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            time.sleep(1.0)  # the step is under way
            os.kill(rank, signal.SIGKILL)
            events = [line[len("data: "):] for line in r.read().decode().splitlines() if line.startswith("data: ")]
        errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
        assert len(errors) == 1, events
        message = errors[0]["message"]
        assert "a tensor-parallel rank of this server died (tensor-parallel rank 1 exited (code -9))" in message, \
            message
        assert "gloo" not in message and "RuntimeError" not in message, message
        assert proc.wait(timeout=60) == 1
        err = proc.stderr.read()
        assert "Traceback" not in err and "gloo" not in err, err[-3000:]
        assert "engine loop failed: a tensor-parallel rank died during a step (tensor-parallel rank 1 exited " \
               "(code -9)); this engine cannot serve again" in err, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
