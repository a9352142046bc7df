"""`runtime serve` as a new user starts it: time to serving, time to the first answer, and memory.

    python bench/serve_start.py                        # the default model, default options
    python bench/serve_start.py -- --kv-cache-memory 1GiB --json

Starts `runtime serve --port 0 [ARGS]` (this checkout's), waits for its chat-page line, sends one
greedy chat request (32 tokens at most) and reads the server's VmRSS and VmHWM from /proc. Times
are from the command, so they include Python's start, loading, and the CPU kernel build if that
is not cached yet. There is no peer: it measures what a user waits for and what it holds.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def status_mb(pid: int, field: str) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", text).group(1)) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("serve_args", nargs="*", help="after --: options for runtime serve")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "flotilla.server.cli", "serve", "--port", "0", *args.serve_args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url, kv = None, ""
        for line in proc.stdout:
            kv = line.strip() if line.startswith("KV cache:") else kv
            if m := re.search(r"chat page: (http://\S+)/$", line.rstrip()):
                url = m.group(1)
                break
        if url is None:
            raise SystemExit(f"serve exited with {proc.wait()} before serving")
        ready = time.perf_counter() - start
        body = {"model": "x", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 32, "temperature": 0}
        models = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=60).read())
        body["model"] = models["data"][0]["id"]
        req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(req, timeout=600).read())
        first = time.perf_counter() - start
        row = {"serving_s": round(ready, 1), "first_answer_s": round(first, 1),
               "tokens": answer["usage"]["completion_tokens"], "rss_mb": round(status_mb(proc.pid, "VmRSS")),
               "peak_rss_mb": round(status_mb(proc.pid, "VmHWM")), "kv_cache": kv}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    if args.json:
        print(json.dumps(row))
        return
    print("| serving s | first answer s | tokens | RSS MB | peak RSS MB |")
    print("|---|---|---|---|---|")
    print(f"| {row['serving_s']} | {row['first_answer_s']} | {row['tokens']} | {row['rss_mb']} | {row['peak_rss_mb']} |")
    print(row["kv_cache"])


if __name__ == "__main__":
    main()
