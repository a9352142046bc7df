"""Worker processes on this machine, for `runtime serve --pp N` without `--hosts`.

One `runtime worker` per stage, listening on a free loopback port, with the model path (so no
weights are pushed) and the token in its environment (never on a command line). On a machine
with at least N GPUs each worker gets its own (`cuda:i`; with --tp M, GPUs i*M .. i*M+M-1);
otherwise they are CPU processes. `--devices` places them by hand, repeats allowed: several
stages on one GPU (each worker its own CUDA context, under a private MPS daemon where one can be
started: mps.py), CPU stages beside GPU ones. CPU workers
split the cores between them (less one core per GPU worker, which drives its GPU). The workers
exit when the head does.

Polling (spin.py): when the ring leaves cores to spare (GPU workers, or CPU workers given a few
threads on a larger machine), the workers poll for the next step instead of sleeping, and so
does the head for results (`spin_us`, which the head's PipelineSettings take too).
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

from .mps import MpsChoice, mps_for
from .spin import DEFAULT_SPIN_US, spare_cores

_LISTENING = re.compile(r"flotilla worker: listening on (\S+):(\d+)")


def local_devices(n: int, tp: int = 1) -> list[str]:
    if torch.cuda.is_available() and torch.cuda.device_count() >= n * tp:
        return [f"cuda:{i * tp}" for i in range(n)]
    return ["cpu"] * n


def worker_threads(devices: list[str], cores: int) -> list[int | None]:
    """CPU threads per local worker: the CPU workers split the cores, less one per GPU worker
    (which gets one thread: it only drives its GPU); None (torch's default) on an all-GPU host.
    Otherwise the idle stages' spinning OpenMP threads take the cores from the stage that
    computes (2x slower on 2 cores)."""
    on_cpu = sum(d == "cpu" for d in devices)
    if not on_cpu:
        return [None] * len(devices)
    share = max(1, (cores - (len(devices) - on_cpu)) // on_cpu)
    return [share if d == "cpu" else 1 for d in devices]


class LocalWorkers:
    def __init__(self, n: int, model: Path, token: bytes, devices: list[str] | None = None,
                 threads: int | None = None, log=None, tp: int = 1, spin_us: int | None = None,
                 mps: str = "auto"):
        self.n, self.model, self.token, self.tp, self.mps_mode = n, Path(model), token, tp, mps
        self.devices = devices or local_devices(n, tp)
        if len(self.devices) != n:
            raise ValueError(f"{n} local workers need {n} devices, got {self.devices}")
        cores = len(os.sched_getaffinity(0))
        self.threads = [threads] * n if threads is not None else worker_threads(self.devices, cores)
        if spin_us is None:  # automatic: poll where the ring leaves cores to spare (TP ranks take one each)
            spin_us = DEFAULT_SPIN_US if spare_cores(cores, [(t or 1) * tp for t in self.threads]) else 0
        self.spin_us = spin_us
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.procs: list[subprocess.Popen] = []
        self.mps = MpsChoice()  # MPS for the stages that share a GPU (mps.py): set by start

    def describe(self) -> str:
        """e.g. 'cuda:0, cuda:0, cpu', and ', each a group of tp 2' under tensor parallelism."""
        return ", ".join(self.devices) + (f", each a group of tp {self.tp}" if self.tp > 1 else "")

    def start(self, timeout: float = 600.0) -> list[tuple[str, int]]:
        env = dict(os.environ, FLOTILLA_TOKEN=self.token.decode())
        root = Path(__file__).resolve().parents[3]  # run this checkout's flotilla, installed or not
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
        self.mps = mps_for(self.devices, self.mps_mode, self.log, self.tp)
        try:
            for device, threads in zip(self.devices, self.threads):
                cmd = [sys.executable, "-m", "flotilla.runtime.cli", "worker", "--listen", "127.0.0.1:0",
                       "--device", device, "--model", str(self.model), "--exit-with-parent"]
                if threads:
                    cmd += ["--threads", str(threads)]
                if self.tp > 1:
                    cmd += ["--tp", str(self.tp)]
                if self.spin_us:
                    cmd += ["--spin-us", str(self.spin_us)]
                self.procs.append(subprocess.Popen(cmd, env={**env, **self.mps.env_for(device, self.tp)},
                                                   stdout=subprocess.PIPE, text=True, bufsize=1))
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
        self.mps.stop()
