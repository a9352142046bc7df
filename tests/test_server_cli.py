"""`runtime serve` as users run it: a subprocess that prints the chat page's URL, honours the API
key from the environment, and on SIGTERM stops accepting, lets in-flight requests finish within
the grace period and cancels the rest."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def env(**extra) -> dict:
    e = {**os.environ, "PYTHONPATH": str(REPO), **extra}
    e.pop("FLOTILLA_API_KEY", None) if "FLOTILLA_API_KEY" not in extra else None
    return e


def runtime(*args, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flotilla.server.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env(), **kw)


class Serve:
    def __init__(self, model: Path, *args: str, **environ):
        self.proc = subprocess.Popen([sys.executable, "-m", "flotilla.server.cli", "serve", str(model), "--port", "0",
                                      "--kv-cache-memory", "256MiB", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env(**environ))
        self.lines = []
        while True:
            line = self.proc.stdout.readline()
            assert line, "serve exited early:\n" + "".join(self.lines)
            self.lines.append(line)
            if m := re.search(r"chat page: (http://\S+)/$", line.rstrip("\n")):
                self.url = m.group(1)
                break

    def wait_for(self, text: str) -> None:
        while text not in "".join(self.lines):
            line = self.proc.stdout.readline()
            assert line, "".join(self.lines)
            self.lines.append(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def get(url: str, headers: dict | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def open_stream(url: str, key: str | None, max_tokens: int) -> socket.socket:
    """A raw HTTP/1.1 streaming request, read by hand so the test sees exactly what arrives."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": max_tokens,
                       "ignore_eos": True, "stream": True}).encode()
    sock = socket.create_connection((host, int(port)), timeout=120)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    return sock


def read_until(sock: socket.socket, marker: bytes, data: bytes = b"") -> bytes:
    while marker not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_serve_prints_url_uses_env_key_and_drains_on_sigterm(smollm2_gguf):
    server = Serve(smollm2_gguf, "--grace-period", "60", FLOTILLA_API_KEY="envkey")
    try:
        assert re.match(r"http://127\.0\.0\.1:\d+$", server.url)
        log = "".join(server.lines)  # what it said while starting, in order
        said = [log.index(f"flotilla: loading {smollm2_gguf}…"), log.index(f"flotilla: loaded {smollm2_gguf.name} in "),
                log.index("KV cache: "), log.index("flotilla: serving")]
        assert said == sorted(said), log
        status, page = get(server.url + "/")
        assert status == 200 and "<title>flotilla chat</title>" in page
        assert get(server.url + "/health")[0] == 200
        assert get(server.url + "/v1/models")[0] == 401
        assert get(server.url + "/v1/models", {"Authorization": "Bearer envkey"})[0] == 200

        sock = open_stream(server.url, "envkey", 40)
        head = read_until(sock, b"data: ")  # generating
        assert head.startswith(b"HTTP/1.1 200")
        server.proc.send_signal(signal.SIGTERM)
        server.wait_for("shutting down")
        with pytest.raises(OSError):  # no new connections
            socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=5).close()
        data = read_until(sock, b"data: [DONE]", head)
        sock.close()
        events = [json.loads(e) for e in re.findall(rb"data: (\{.*\})", data)]
        assert [e["choices"][0]["finish_reason"] for e in events][-1] == "length"  # finished, not cut
        assert not [e for e in events if "error" in e]
        assert server.proc.wait(timeout=60) == 0
    finally:
        server.close()


def test_sigterm_cancels_what_outlives_the_grace_period(smollm2_gguf):
    server = Serve(smollm2_gguf, "--grace-period", "0.5")
    try:
        sock = open_stream(server.url, None, 4000)
        head = read_until(sock, b"data: ")
        server.proc.send_signal(signal.SIGTERM)
        data = read_until(sock, b"data: [DONE]", head)
        sock.close()
        events = [json.loads(e) for e in re.findall(rb"data: (\{.*\})", data)]
        assert "shutting down" in events[-1]["error"]["message"]
        assert server.proc.wait(timeout=60) == 0
    finally:
        server.close()


def test_mistakes_exit_2_with_one_line():
    r = runtime("serve", "--api-key-file", "/nonexistent/key")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "--api-key-file /nonexistent/key: cannot read it" in r.stderr
    r = runtime("serve", "--max-queue", "-1")
    assert r.returncode == 2 and "--max-queue must be >= 0" in r.stderr


def test_runtime_script_has_serve_and_runtime_does_not_import_the_server():
    r = runtime("--help")
    assert r.returncode == 0 and "serve" in r.stdout and "generate" in r.stdout
    code = "import sys, flotilla.runtime.cli as c; c.build_parser(c.COMMANDS); print(any(m.startswith('flotilla.server') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), check=True)
    assert out.stdout.strip() == "False"
    # the console script imports the server's command table (through flotilla.entry, quiet on an early Ctrl-C)
    assert 'runtime = "flotilla.entry:runtime"' in (REPO / "pyproject.toml").read_text()
    assert 'return _interruptible("flotilla.server.cli")' in (REPO / "flotilla" / "entry.py").read_text()


def test_port_in_use_is_one_line_exit_2_before_the_model_loads(smollm2_gguf):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        r = runtime("serve", str(smollm2_gguf), "--port", str(port), timeout=60)
    finally:
        taken.close()
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [f"error: cannot listen on 127.0.0.1:{port}: the port is already in "
                                             "use (is another server running?); pick another --port"]
    # nothing was loaded: no "flotilla: loading" line (which comes before any weight is read), no
    # KV cache line; this, not a wall-clock bound, shows the port was checked first
    assert r.stdout == ""


def test_bound_sockets_share_one_port_and_refuse_until_served():
    from flotilla.errors import FlotillaError
    from flotilla.server.listen import bind_sockets

    sockets = bind_sockets("localhost", 0)
    try:
        ports = {s.getsockname()[1] for s in sockets}
        assert len(ports) == 1 and ports != {0}
        port = ports.pop()
        with pytest.raises(ConnectionRefusedError):  # bound, not yet listening: an early client is refused
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        # a second server starting meanwhile cannot bind the port (SO_REUSEADDR is off while loading)
        with pytest.raises(FlotillaError, match="already in use"):
            bind_sockets("127.0.0.1", port)
    finally:
        for s in sockets:
            s.close()


def test_a_restart_binds_past_time_wait_and_listens():
    from flotilla.server.listen import bind_sockets, prepare_to_listen

    (first,) = bind_sockets("127.0.0.1", 0)
    port = first.getsockname()[1]
    prepare_to_listen([first])
    first.listen()
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    served, _ = first.accept()
    served.close()  # the server closes first: its end of the connection waits in TIME_WAIT
    assert client.recv(1) == b""
    client.close()
    first.close()
    (again,) = bind_sockets("127.0.0.1", port)
    try:
        prepare_to_listen([again])
        again.listen()
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        again.close()


def test_a_ctrl_c_while_the_command_imports_exits_130_without_a_traceback(tmp_path, monkeypatch, capsys):
    """The console scripts import their command (and torch) inside flotilla.entry: a Ctrl-C in that first second
    ends with status 130, as one later does, not in an import's traceback."""
    import sys

    from flotilla import entry

    (tmp_path / "slow_to_import.py").write_text("raise KeyboardInterrupt\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as e:
        entry._interruptible("slow_to_import")
    assert e.value.code == 130 and "Traceback" not in capsys.readouterr().err
    assert "slow_to_import" not in sys.modules
