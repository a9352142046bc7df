"""Worker processes on this machine, for `runtime serve --pp N` without `--hosts`.

One `runtime worker` per stage, listening on a free loopback port, with the model path (so no
weights are pushed) and the token in its environment (never on a command line). On a machine
with at least N GPUs each worker gets its own (`cuda:i`); otherwise they are CPU processes that
split the cores between them. The workers exit when the head does.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from flotilla.errors import FlotillaError

_LISTENING = re.compile(r"flotilla worker: listening on (\S+):(\d+)")


def local_devices(n: int) -> list[str]:
    if torch.cuda.is_available() and torch.cuda.device_count() >= n:
        return [f"cuda:{i}" for i in range(n)]
    return ["cpu"] * n


class LocalWorkers:
    def __init__(self, n: int, model: Path, token: bytes, devices: list[str] | None = None,
                 threads: int | None = None, log=None):
        self.n, self.model, self.token = n, Path(model), token
        self.devices = devices or local_devices(n)
        if threads is None and all(d == "cpu" for d in self.devices):
            # CPU workers share this machine's cores: split them, or the idle stages' spinning OpenMP
            # threads take the cores from the stage that computes (2x slower on 2 cores)
            threads = max(1, len(os.sched_getaffinity(0)) // len(self.devices))
        self.threads = threads
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.procs: list[subprocess.Popen] = []

    def start(self, timeout: float = 600.0) -> list[tuple[str, int]]:
        env = dict(os.environ, FLOTILLA_TOKEN=self.token.decode())
        root = Path(__file__).resolve().parents[3]  # run this checkout's flotilla, installed or not
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
        for i, device in enumerate(self.devices):
            cmd = [sys.executable, "-m", "flotilla.runtime.cli", "worker", "--listen", "127.0.0.1:0",
                   "--device", device, "--model", str(self.model), "--exit-with-parent"]
            if self.threads:
                cmd += ["--threads", str(self.threads)]
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, bufsize=1))
        try:
            return [self._address(i, p, time.monotonic() + timeout) for i, p in enumerate(self.procs)]
        except BaseException:
            self.stop()
            raise

    def _address(self, i: int, proc: subprocess.Popen, deadline: float) -> tuple[str, int]:
        found: list[tuple[str, int]] = []
        ready = threading.Event()

        def pump():  # forward the worker's stdout; the first line says where it listens
            for line in proc.stdout:
                m = _LISTENING.search(line)
                if m and not found:
                    found.append((m.group(1), int(m.group(2))))
                    ready.set()
                self.log(f"[worker {i}] {line.rstrip()}")
            ready.set()

        threading.Thread(target=pump, name=f"flotilla-worker-{i}-stdout", daemon=True).start()
        ready.wait(max(0.0, deadline - time.monotonic()))
        if not found:
            raise FlotillaError(f"local worker {i} did not start (exit status {proc.poll()}); its log is above")
        return found[0]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []
