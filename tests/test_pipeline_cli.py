"""`runtime serve --pp N` and `runtime worker` as users run them."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

from pipeline_helpers import smollm2_reference

REPO = Path(__file__).resolve().parent.parent


def runtime(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    e.pop("FLOTILLA_TOKEN", None) if "FLOTILLA_TOKEN" not in (env or {}) else None
    return subprocess.run([sys.executable, "-m", "flotilla.server.cli", *args], capture_output=True, text=True,
                          timeout=120, env=e)


def test_token_rules_and_bad_flags_are_one_line_errors(tmp_path):
    r = runtime("worker", "--listen", "nonsense", "--token", "0123456789abcdef0123")  # accepted, with a warning
    assert r.returncode == 2 and "--token-file" in r.stderr and "ps" in r.stderr and "--listen" in r.stderr
    r = runtime("worker", "--listen", "127.0.0.1:0", "--token", "short")
    assert r.returncode == 2 and "at least 16" in r.stderr
    r = runtime("worker", "--listen", "127.0.0.1:0")
    assert r.returncode == 2 and "needs a shared token" in r.stderr
    short = tmp_path / "short"
    short.write_text("abc")
    r = runtime("worker", "--listen", "127.0.0.1:0", "--token-file", str(short))
    assert r.returncode == 2 and "at least 16" in r.stderr
    r = runtime("serve", "--pp", "2", "--hosts", "127.0.0.1:1,127.0.0.1:2")
    assert r.returncode == 2 and "needs a shared token" in r.stderr
    r = runtime("serve", "--pp", "3", "--hosts", "a,b", env={"FLOTILLA_TOKEN": "0123456789abcdef-env"})
    assert r.returncode == 2 and "names 2 workers, but --pp is 3" in r.stderr
    r = runtime("serve", "--pp", "1", "--hosts", "a,b", env={"FLOTILLA_TOKEN": "0123456789abcdef-env"})
    assert r.returncode == 2 and "names 2 workers, but --pp is 1" in r.stderr  # given, not the default
    r = runtime("serve", "--hosts", "127.0.0.1:1,127.0.0.1:1", env={"FLOTILLA_TOKEN": "0123456789abcdef-env"})
    assert r.returncode == 2 and "--hosts names 127.0.0.1:1 twice" in r.stderr
    r = runtime("serve", "--hosts", "localhost:7071,127.0.0.1:7071", env={"FLOTILLA_TOKEN": "0123456789abcdef-env"})
    assert r.returncode == 2 and "names one worker twice, as localhost:7071 and 127.0.0.1:7071" in r.stderr
    # --pp left out: one stage per worker named (here: both refuse, so the second is reached only by count)
    r = runtime("serve", "--hosts", "127.0.0.1:1,127.0.0.1:2", env={"FLOTILLA_TOKEN": "0123456789abcdef-env"})
    assert r.returncode == 2 and "cannot connect to worker 127.0.0.1:1: connection refused" in r.stderr
    r = runtime("serve", "--pp", "2", "--hosts", "127.0.0.1:1,127.0.0.1:2", env={"FLOTILLA_TOKEN": "0123456789abcdef-env"})
    assert r.returncode == 2 and "cannot connect to worker 127.0.0.1:1: connection refused" in r.stderr
    r = runtime("worker", "--listen", "nonsense", env={"FLOTILLA_TOKEN": "0123456789abcdef-env"})
    assert r.returncode == 2 and "--listen" in r.stderr
    for listen in ("fd:999", "fd:x"):  # serve --pp's local workers get their parent's socket so
        r = runtime("worker", "--listen", listen, env={"FLOTILLA_TOKEN": "0123456789abcdef-env"})
        assert r.returncode == 2 and f"--listen {listen}: not an inherited listening socket" in r.stderr, r.stderr
    r = runtime("worker", "--listen", "127.0.0.1:0", "--spin-us", "-1", env={"FLOTILLA_TOKEN": "0123456789abcdef-env"})
    assert r.returncode == 2 and "--spin-us must be >= 0" in r.stderr


def test_counts_layers_and_tls_files_are_refused_before_any_worker_starts(tmp_path):
    """What the flags or the model's config alone can refuse is one line, before a local worker starts (the default
    model, SmolLM2, has 30 layers)."""
    env = {"FLOTILLA_TOKEN": "0123456789abcdef-env"}
    r = runtime("serve", "--pp", "0")
    assert r.returncode == 2 and "argument --pp: must be at least 1, got 0" in r.stderr
    r = runtime("worker", "--listen", "127.0.0.1:0", "--tp", "-1", env=env)
    assert r.returncode == 2 and "argument --tp: must be at least 1, got -1" in r.stderr
    for args, msg in ((["--pp", "31"], "--pp 31 is more stages than the model's 30 layers"),
                      (["--pp", "2", "--layers", "10,10"], "adds up to 20 layers; the model has 30")):
        r = runtime("serve", *args)
        assert r.returncode == 2 and msg in r.stderr and "worker" not in r.stderr, r.stderr
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    r = runtime("worker", "--listen", "127.0.0.1:0", "--tls-cert", str(cert), "--tls-key", str(key), env=env)
    assert r.returncode == 2 and f"--tls-cert {cert}: no such file" in r.stderr
    cert.write_text("not a certificate")
    key.write_text("nor a key")
    r = runtime("worker", "--listen", "127.0.0.1:0", "--tls-cert", str(cert), "--tls-key", str(key), env=env)
    assert r.returncode == 2 and f"cannot load the TLS files (--tls-cert {cert}, --tls-key {key})" in r.stderr
    r = runtime("worker", "--listen", "127.0.0.1:0", "--tls-cert", str(tmp_path), "--tls-key", str(key), env=env)
    assert r.returncode == 2 and f"--tls-cert {tmp_path}: a directory, not a file" in r.stderr
    if shutil.which("openssl"):  # two pairs: the one's key is not the other's
        for name in ("a", "b"):
            key_file, cert_file = tmp_path / f"{name}.key", tmp_path / f"{name}.pem"
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                            f"/CN={name}", "-keyout", str(key_file), "-out", str(cert_file)],
                           check=True, capture_output=True)
        r = runtime("worker", "--listen", "127.0.0.1:0", "--tls-cert", str(tmp_path / "a.pem"), "--tls-key",
                    str(tmp_path / "b.key"), env=env)
        assert r.returncode == 2 and f"--tls-key {tmp_path / 'b.key'} is not the private key of --tls-cert" in r.stderr


def test_a_token_mismatch_is_named_on_both_sides():
    from pipeline_helpers import ProcessWorker, wait_until

    worker = ProcessWorker(token=b"worker-token-0123456789").wait_listening()
    try:
        r = runtime("serve", "--pp", "1", "--hosts", f"127.0.0.1:{worker.port}",
                    env={"FLOTILLA_TOKEN": "head-token-0123456789ab"})
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert (f"cannot connect to worker 127.0.0.1:{worker.port}: it answered, but with another token than this "
                "head's; give the head and every worker the same token (FLOTILLA_TOKEN or --token-file)") in r.stderr
        assert "start `runtime worker" not in r.stderr
        assert wait_until(lambda: any("its token is likely not this worker's" in line for line in worker.log), 10), \
            worker.log
    finally:
        worker.stop()


def test_serve_pp2_starts_local_workers_and_serves(smollm2_int4):
    prompts, _, texts = smollm2_reference(smollm2_int4)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("FLOTILLA_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-m", "flotilla.server.cli", "serve", str(smollm2_int4), "--pp", "2",
                             "--layers", "16,14", "--port", "0", "--served-model-name", "smol", "--kv-cache-memory", "64MiB", "--max-num-seqs", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        url = None
        for line in proc.stdout:
            lines.append(line)
            if m := re.search(r"OpenAI API at (http://\S+)/v1", line):
                url = m.group(1)
                break
        assert url, "".join(lines)
        log = "".join(lines)
        assert "starting 2 local workers (cpu, cpu)" in log
        assert re.search(r"stage 0  127\.0\.0\.1:\d+  layers 0-15 \(16\) \+ embeddings", log)
        assert re.search(r"stage 1  127\.0\.0\.1:\d+  layers 16-29 \(14\) \+ lm_head", log)
        workers = [int(p) for p in re.findall(r"\[worker \d\] flotilla worker: listening on 127\.0\.0\.1:(\d+)", log)]
        assert len(workers) == 2
        body = json.dumps({"model": "smol", "prompt": prompts[0], "max_tokens": 24, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            assert json.loads(r.read())["choices"][0]["text"] == texts[0]
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            assert json.loads(r.read())["status"] == "ok"
        children = _children(proc.pid)
        assert len(children) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert all(not _alive(pid) for pid in children)  # the head took its workers down with it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text()


def test_pp3_with_workers_that_never_answer_or_are_not_workers_is_one_line_in_bounded_time():
    silent = [socket.socket() for _ in range(3)]  # the kernel completes the TCP handshake; nothing ever answers
    for s in silent:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
    web = socket.socket()  # something else: answers every connection with an HTTP response
    web.bind(("127.0.0.1", 0))
    web.listen(8)

    def answer_http():
        while True:
            try:
                conn, _ = web.accept()
            except OSError:
                return
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            conn.close()

    threading.Thread(target=answer_http, daemon=True).start()
    token = {"FLOTILLA_TOKEN": "0123456789abcdef-env"}
    try:
        hosts = ",".join(f"127.0.0.1:{s.getsockname()[1]}" for s in silent)
        r = runtime("serve", "--port", "0", "--pp", "3", "--hosts", hosts, env=token)  # bounded: 120 s at most
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert "no answer within 10 s" in lines[0] and "runtime worker --listen" in lines[0]
        hosts = f"127.0.0.1:{web.getsockname()[1]},127.0.0.1:{silent[0].getsockname()[1]}"  # the first answers
        r = runtime("serve", "--port", "0", "--hosts", hosts, env=token)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert "something answered, but not a flotilla worker" in lines[0]
    finally:
        for s in [*silent, web]:
            s.close()
