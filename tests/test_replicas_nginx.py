"""Replicas behind nginx with the shipped deploy/nginx.conf: two `runtime serve` processes (one
of them a TP=2 group) and nginx (run as this user, with its own prefix, pid and logs) on
loopback. 32 concurrent streams through nginx all complete and both replicas serve a share
(their own /metrics say so); the websocket chat works through it; after one replica is killed,
every request sent afterwards still succeeds (nginx moves the ones it cannot start to the other
replica); SIGTERM stops the TP replica and its other rank."""
from __future__ import annotations

import asyncio
import getpass
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from conftest import REPO, SIMPLE_CHAT_TEMPLATE, make_hf_model, save_byte_tokenizer, save_hf_model, tiny_config

NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.path.exists(p)),
                                      None)
pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (.ci/run installs Debian's)")

STREAMS = 32
MAX_TOKENS = 8


class Replica:
    """`runtime serve` on a free loopback port, as users start it."""

    def __init__(self, model: Path, *args: str):
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        env.pop("FLOTILLA_API_KEY", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flotilla.server.cli", "serve", str(model), "--port", "0", "--kv-cache-memory",
             "16MiB", "--max-num-seqs", "16", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=env)
        self.url = None

    def wait_started(self) -> None:
        lines = []
        while self.url is None:
            line = self.proc.stdout.readline()
            assert line, "runtime serve exited early:\n" + "".join(lines)
            lines.append(line)
            if m := re.search(r"chat page: (http://\S+)/$", line.rstrip("\n")):
                self.url = m.group(1)

    @property
    def address(self) -> str:
        return self.url.removeprefix("http://")

    def completions_served(self) -> int:
        """Successful /v1/completions by this replica's own /metrics."""
        text = urllib.request.urlopen(self.url + "/metrics", timeout=30).read().decode()
        m = re.search(r'^flotilla_requests_total\{endpoint="/v1/completions",status="200"\} (\d+)$', text, re.M)
        return int(m.group(1)) if m else 0

    def children(self) -> list[int]:
        """Processes whose parent is this replica (from /proc/*/stat: pid (comm) state ppid ...)."""
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == self.proc.pid:
                found.append(int(stat.parent.name))
        return found

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


class Nginx:
    """nginx in the foreground with deploy/nginx.conf included in a minimal http block."""

    def __init__(self, prefix: Path, listen: int, upstreams: list[str]):
        shipped = (REPO / "deploy" / "nginx.conf").read_text()
        servers = re.findall(r"^\s*server (127\.0\.0\.1:\d+)", shipped, re.M)
        assert len(servers) == 2 and "least_conn;" in shipped
        for old, new in zip(servers, upstreams):
            shipped = shipped.replace(f"server {old} ", f"server {new} ")
        shipped = re.sub(r"^(\s*)listen \d+;", rf"\g<1>listen 127.0.0.1:{listen};", shipped, count=1, flags=re.M)
        (prefix / "temp").mkdir(parents=True)
        (prefix / "flotilla.conf").write_text(shipped)
        self.error_log, self.access_log = prefix / "error.log", prefix / "access.log"
        user = f"user {getpass.getuser()};\n" if os.geteuid() == 0 else ""  # as this user, not nobody
        temps = "".join(f"    {kind}_temp_path {prefix}/temp/{kind};\n"
                        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        (prefix / "nginx.conf").write_text(
            f"{user}daemon off;\nworker_processes 1;\npid {prefix}/nginx.pid;\nerror_log {self.error_log} info;\n"
            f"events {{ worker_connections 256; }}\n"
            f"http {{\n    access_log {prefix}/access.log;\n{temps}    include {prefix}/flotilla.conf;\n}}\n")
        self.proc = subprocess.Popen([NGINX, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-e",
                                      str(self.error_log)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.url = f"http://127.0.0.1:{listen}"

    def wait_started(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, "nginx exited: " + self.proc.stderr.read().decode()
            try:
                urllib.request.urlopen(self.url + "/health", timeout=5)
                return
            except OSError:
                assert time.monotonic() < deadline, "nginx did not answer within 30 s"
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    model = save_hf_model(make_hf_model(tiny_config("llama"), seed=5), root / "tiny")
    save_byte_tokenizer(model, SIMPLE_CHAT_TEMPLATE)
    replicas = [Replica(model, "--tp", "2"), Replica(model)]  # one replica is a tensor-parallel group
    nginx = None
    try:
        for r in replicas:
            r.wait_started()
        nginx = Nginx(root / "nginx", free_port(), [r.address for r in replicas])
        nginx.wait_started()
        yield replicas, nginx
    finally:
        if nginx is not None:
            nginx.stop()
        for r in replicas:
            r.kill()


async def stream(session: aiohttp.ClientSession, url: str, i: int) -> dict:
    body = {"model": "tiny", "prompt": f"request {i}:", "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0}
    async with session.post(url + "/v1/completions", json=body) as resp:
        events = [line[6:].strip() async for line in resp.content if line.startswith(b"data: ")]
        return {"status": resp.status, "events": events}


def streams_through(nginx: Nginx, n: int = STREAMS) -> list[dict]:
    async def run():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                         timeout=aiohttp.ClientTimeout(total=300)) as s:
            return await asyncio.gather(*(stream(s, nginx.url, i) for i in range(n)))
    return asyncio.run(run())


def assert_complete(results: list[dict]) -> None:
    assert [r["status"] for r in results] == [200] * len(results)
    for r in results:
        assert r["events"][-1] == b"[DONE]"
        chunks = [json.loads(e) for e in r["events"][:-1]]
        assert not [c for c in chunks if "error" in c]
        assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS


def test_streams_spread_over_both_replicas_and_survive_one_dying(cluster):
    replicas, nginx = cluster
    before = [r.completions_served() for r in replicas]
    assert_complete(streams_through(nginx))
    served = [r.completions_served() - b for r, b in zip(replicas, before)]
    print("requests per replica:", served)
    assert sum(served) == STREAMS and min(served) > 0, f"requests per replica: {served}"

    async def ws_turn():  # the websocket chat, through nginx's upgrade headers
        async with aiohttp.ClientSession() as s, s.ws_connect(nginx.url.replace("http", "ws") + "/ws") as ws:
            assert json.loads((await ws.receive(timeout=60)).data)["type"] == "ready"
            await ws.send_json({"type": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                "ignore_eos": True})
            frames = []
            while not frames or frames[-1]["type"] != "done":
                frames.append(json.loads((await ws.receive(timeout=60)).data))
            return frames
    frames = asyncio.run(ws_turn())
    assert frames[0]["type"] == "start" and frames[-1]["usage"]["completion_tokens"] == 4
    # the page's ?api_key= is never written to nginx's access log: /ws is not logged
    assert "/v1/completions" in nginx.access_log.read_text() and "/ws" not in nginx.access_log.read_text()

    alive, dead = replicas
    dead.kill()
    before = alive.completions_served()
    assert_complete(streams_through(nginx))  # none lost: those nginx could not start went to the other
    assert alive.completions_served() - before == STREAMS
    log = nginx.error_log.read_text()
    assert re.search(rf"connect\(\) failed \(111: Connection refused\).*upstream: \"http://{dead.address}/", log), \
        "nginx never tried the dead replica: the retry was not exercised"

    # the TP=2 replica's drain stops its other rank too
    children = alive.children()
    assert children, "runtime serve --tp 2 started no process"
    alive.proc.send_signal(signal.SIGTERM)
    assert alive.proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 30
    while [c for c in children if running(c)]:
        assert time.monotonic() < deadline, f"processes of the stopped TP replica still run: {children}"
        time.sleep(0.2)

    # both down now: nginx's JSON 503 in OpenAI's error shape, which clients parse, not its HTML page
    request = urllib.request.Request(nginx.url + "/v1/completions", data=b'{"prompt": "hi", "max_tokens": 1}',
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=30)
    assert e.value.code == 503 and e.value.headers["Content-Type"] == "application/json"
    assert e.value.headers["Retry-After"] == "1"
    assert json.loads(e.value.read())["error"]["message"] == "no flotilla replica is answering; retry shortly"


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
