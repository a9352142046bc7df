"""Helpers for the pipeline tests: workers in this process (threads) or as `runtime worker`
processes, and reading what they say."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
TOKEN = b"pipeline-test-token-0123456789"


class ThreadWorker:
    """A pipeline Worker on its own event loop in a daemon thread of this process."""

    def __init__(self, cache_dir: Path, model: Path | None = None, port: int = 0, token: bytes = TOKEN,
                 ssl_server=None, ssl_client=None, handshake_timeout: float = 10.0, spin: float = 0.0):
        from flotilla.runtime.pipeline.spin import SpinSelector
        from flotilla.runtime.pipeline.worker import Worker, WorkerConfig

        self.config = WorkerConfig(token, torch.device("cpu"), Path(cache_dir), model, ssl_server, ssl_client,
                                   handshake_timeout=handshake_timeout)
        self.worker = Worker(self.config)
        if spin:  # as `runtime worker --spin-us`: polling for up to `spin` seconds after each step
            selector = SpinSelector(spin, self.worker.idle)
            self.worker.on_step = selector.arm
            self.loop = asyncio.SelectorEventLoop(selector)
        else:
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.host, self.port = self.call(self.worker.start("127.0.0.1", port))

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def stop(self) -> None:
        """Like a killed process: the listening socket and every connection close at once."""
        async def down():
            await self.worker.close()
            await asyncio.sleep(0.05)
        try:
            self.call(down(), 10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def worker_env(token: bytes = TOKEN) -> dict:
    env = dict(os.environ, FLOTILLA_TOKEN=token.decode(), PYTHONPATH=str(REPO))
    env.pop("FLOTILLA_KERNEL", None)
    return env


class ProcessWorker:
    """`runtime worker` as a child process (kill -9 able)."""

    def __init__(self, port: int = 0, model: Path | None = None, cache_dir: Path | None = None,
                 token: bytes = TOKEN, prefix: list[str] | None = None, host: str = "127.0.0.1",
                 extra: list[str] | None = None):
        self.host = host
        cmd = [*(prefix or []), sys.executable, "-m", "flotilla.runtime.cli", "worker", "--listen", f"{host}:{port}",
               "--device", "cpu", "--exit-with-parent", *(extra or [])]  # never outlives the test run
        if model is not None:
            cmd += ["--model", str(model)]
        if cache_dir is not None:
            cmd += ["--cache-dir", str(cache_dir)]
        self.log: list[str] = []
        self.proc = subprocess.Popen(cmd, env=worker_env(token), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1)
        self._listening = threading.Event()
        self.port = port
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line.rstrip())
            m = re.search(r"listening on (\S+):(\d+)", line)
            if m and not self._listening.is_set():
                self.port = int(m.group(2))
                self._listening.set()
        self._listening.set()

    def wait_listening(self, timeout: float = 120) -> "ProcessWorker":
        if not self._listening.wait(timeout) or self.proc.poll() is not None:
            raise RuntimeError("worker did not start:\n" + "\n".join(self.log[-30:]))
        return self

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def checkpoint_per_layer(src: Path, out: Path) -> Path:
    """Rewrite a model as a flotilla checkpoint with one shard per layer key (embed, 0..L-1, head),
    so that a stage's shards are exactly its layers."""
    from flotilla.models.checkpoint import TOKENIZER_FILES, CheckpointWriter, is_checkpoint, layer_key
    from flotilla.models.sources import open_source

    if is_checkpoint(out):
        return out
    source = open_source(src)
    groups: dict[str, dict] = {}
    for name in source.names():
        groups.setdefault(layer_key(name), {})[name] = source.get(name)
    keys = ["embed", *map(str, range(source.config.num_hidden_layers)), "head"]
    with CheckpointWriter(out, source.config, shard_size=1, force=True) as w:
        for key in keys:
            if key in groups:
                w.add_layer(key, groups[key])
        if Path(src).is_dir():
            w.copy_files(Path(src), TOKENIZER_FILES)
        return w.commit()


def make_tls_files(directory: Path) -> tuple[Path, Path, Path] | None:
    """A CA and one node certificate signed by it (openssl CLI); None when openssl is missing."""
    import shutil

    if shutil.which("openssl") is None:
        return None
    d = Path(directory)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run = lambda *a: subprocess.run(["openssl", *a], cwd=d, check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=flotilla-test-ca")
    run("req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=node")
    run("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "node.pem", "-days", "2")
    return d / "node.pem", d / "node.key", d / "ca.pem"


TOPICS = ["the ocean", "a robot", "Paris", "mathematics", "a cat", "the moon", "coffee", "winter",
          "a library", "music", "trains", "volcanoes", "bread", "chess", "rain", "the internet"]


def smollm2_prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": f"Write one sentence about {t}."}])
            for t in TOPICS]


_REFERENCE: dict = {}


def smollm2_reference(model: Path, max_tokens: int = 24) -> tuple[list[list[int]], list[list[int]], list[str]]:
    """(prompts, greedy tokens, texts) of pp=1 — the model in this process — for the 16 prompts;
    computed once per test session."""
    key = (str(model), max_tokens)
    if key not in _REFERENCE:
        from flotilla.runtime.engine_args import EngineArgs, build_engine
        from flotilla.runtime.loader import load_model
        from flotilla.runtime.sampling import SamplingParams

        lm = load_model(model, "cpu", "float32", progress=False)
        engine = build_engine(lm, EngineArgs(kv_cache_memory="64MiB", max_num_seqs=16))
        prompts = smollm2_prompts(lm.tokenizer)
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"ref-{i}", p, params)
        tokens: dict[str, list[int]] = {}
        texts: dict[str, str] = {}
        while engine.has_unfinished():
            for o in engine.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                texts[o.request_id] = texts.get(o.request_id, "") + o.text
        ids = [f"ref-{i}" for i in range(len(prompts))]
        _REFERENCE[key] = (prompts, [tokens[i] for i in ids], [texts[i] for i in ids])
    return _REFERENCE[key]
