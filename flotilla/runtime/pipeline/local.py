"""Worker processes on this machine, for `runtime serve --pp N` without `--hosts`.

One `runtime worker` per stage, listening on a free loopback port, with the model path (so no
weights are pushed) and the token in its environment (never on a command line). On a machine
with at least N GPUs each worker gets its own (`cuda:i`; with --tp M, GPUs i*M .. i*M+M-1);
otherwise they are CPU processes. `--devices` places them by hand, repeats allowed: several
stages on one GPU (each worker its own CUDA context, under a private MPS daemon where one can be
started: mps.py), CPU stages beside GPU ones. CPU workers
split the cores between them (less one core per GPU worker, which drives its GPU). The workers
exit when the head does. The head binds each worker's listening socket and passes it down
(`--listen fd:N`). A worker that dies (killed, out of memory) is started again on that socket
after a short delay, as a user restarts a `runtime worker` by hand, and the head
re-prefills its sequences once it answers; one restarted RESTART_LIMIT times within
RESTART_WINDOW_S is left down at its next death, said once, and the head's pipeline is told
(Pipeline.stage_left_down): it can never serve again, so `runtime serve` exits with status 1.
A worker that is alive but not heard from (hung, stopped: the head pings every second) for
`hang_timeout` seconds, after the head had heard from it since its (re)start, is killed with its process
group (its TP ranks), and so restarted the same way; one the head has not reached yet (still loading, or
waiting for its turn after a restart) is left alone.

Polling (spin.py): when the ring leaves cores to spare (GPU workers, or CPU workers given a few
threads on a larger machine), the workers poll for the next step instead of sleeping, and so
does the head for results (`spin_us`, which the head's PipelineSettings take too).
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from flotilla.errors import FlotillaError
from flotilla.progress import say_line

from .mps import MpsChoice, mps_for
from .spin import DEFAULT_SPIN_US, spare_cores

_LISTENING = re.compile(r"flotilla worker: listening on (\S+):(\d+)")
RESTART_LIMIT = 5  # restarts of one worker within RESTART_WINDOW_S; at its next death it is left down
RESTART_WINDOW_S = 300.0
RESTART_DELAY_S = 0.5  # before a restart, doubled for each restart within the window
POLL_S = 0.5  # how often the supervisor looks at the workers


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
                 mps: str = "auto", cores: int | None = None, log_level: str | None = None):
        """`log`: where the workers' lines go ("[worker i] ..." a line, their logging included); `log_level`:
        theirs (`runtime worker --log-level`; default info)."""
        self.n, self.model, self.token, self.tp, self.mps_mode = n, Path(model), token, tp, mps
        self.log_level = log_level
        self.devices = devices or local_devices(n, tp)
        if len(self.devices) != n:
            raise ValueError(f"{n} local workers need {n} devices, got {self.devices}")
        cores = cores or len(os.sched_getaffinity(0))  # `serve --threads`: the threads the workers share
        self.threads = [threads] * n if threads is not None else worker_threads(self.devices, cores)
        if spin_us is None:  # automatic: poll where the ring leaves cores to spare (TP ranks take one each)
            spin_us = DEFAULT_SPIN_US if spare_cores(cores, [(t or 1) * tp for t in self.threads]) else 0
        self.spin_us = spin_us
        self.log = log or say_line
        self.procs: list[subprocess.Popen] = []
        self.addresses: list[tuple[str, int]] = []
        self.socks: list[socket.socket] = []  # each worker's listening socket, held here across its restarts
        self._watch = None  # watch(): (worker i -> when the head last heard from it, the hang timeout)
        self._left_down = None  # watch(): told (worker i, why) of a worker left down: the head's pipeline
        self._launched = [0.0] * n  # when each worker was last (re)started
        self._killed: set[int] = set()  # killed as hung, not yet started again
        self.mps = MpsChoice()  # MPS for the stages that share a GPU (mps.py): set by start
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._supervisor: threading.Thread | None = None

    def describe(self) -> str:
        """e.g. 'cuda:0, cuda:0, cpu', and ', each a group of tp 2' under tensor parallelism."""
        return ", ".join(self.devices) + (f", each a group of tp {self.tp}" if self.tp > 1 else "")

    def start(self, timeout: float = 600.0) -> list[tuple[str, int]]:
        self.mps = mps_for(self.devices, self.mps_mode, self.log, self.tp)
        try:
            for i in range(self.n):
                # the head holds each worker's listening socket, so that a worker started again listens on
                # the same address: nothing else can take the port meanwhile
                sock = socket.create_server(("127.0.0.1", 0))
                sock.set_inheritable(True)
                self.socks.append(sock)
                self.procs.append(self._launch(i))
            deadline = time.monotonic() + timeout
            self.addresses = [self._address(i, p, deadline) for i, p in enumerate(self.procs)]
        except BaseException:
            self.stop()
            raise
        self._stopping.clear()
        self._supervisor = threading.Thread(target=self._supervise, name="flotilla-local-workers", daemon=True)
        self._supervisor.start()
        return list(self.addresses)

    def watch(self, last_heard, hang_timeout: float, left_down=None) -> None:
        """From now on, kill (and so restart) a live worker that the head heard from since its (re)start but not
        for `hang_timeout` seconds since: `last_heard(i)` is when it last did (time.monotonic()). `left_down(i,
        why)` (the head's Pipeline.stage_left_down) is told of a worker left down."""
        self._watch = (last_heard, hang_timeout)
        self._left_down = left_down

    def _launch(self, i: int) -> subprocess.Popen:
        self._launched[i] = time.monotonic()
        self._killed.discard(i)
        env = dict(os.environ, FLOTILLA_TOKEN=self.token.decode())
        root = Path(__file__).resolve().parents[3]  # run this checkout's flotilla, installed or not
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
        device, threads = self.devices[i], self.threads[i]
        fd = self.socks[i].fileno()
        cmd = [sys.executable, "-m", "flotilla.runtime.cli", "worker", "--listen", f"fd:{fd}",
               "--device", device, "--model", str(self.model), "--exit-with-parent"]
        if threads:
            cmd += ["--threads", str(threads)]
        if self.tp > 1:
            cmd += ["--tp", str(self.tp)]
        if self.spin_us:
            cmd += ["--spin-us", str(self.spin_us)]
        if self.log_level:
            cmd += ["--log-level", self.log_level]
        # a session of its own: a terminal's Ctrl-C reaches the head alone, which stops the workers itself
        # (--exit-with-parent covers a head that dies)
        # its logging (stderr) through the same pipe: every line prefixed, none glued to the head's
        return subprocess.Popen(cmd, env={**env, **self.mps.env_for(device, self.tp)}, pass_fds=(fd,),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                start_new_session=True)

    def _address(self, i: int, proc: subprocess.Popen, deadline: float) -> tuple[str, int]:
        found: list[tuple[str, int]] = []
        ready = threading.Event()
        self._pump(i, proc, ready, found)
        ready.wait(max(0.0, deadline - time.monotonic()))
        if not found:
            raise FlotillaError(f"local worker {i} did not start (exit status {proc.poll()}); its log is above")
        return found[0]

    def _pump(self, i: int, proc: subprocess.Popen, ready: threading.Event, found: list) -> None:
        """Forward the worker's output to the log; a line of it says where it listens (`found`)."""
        def pump():
            for line in proc.stdout:
                m = _LISTENING.search(line)
                if m and not found:
                    found.append((m.group(1), int(m.group(2))))
                    ready.set()
                self.log(f"[worker {i}] {line.rstrip()}")
            ready.set()

        threading.Thread(target=pump, name=f"flotilla-worker-{i}-stdout", daemon=True).start()

    def _supervise(self) -> None:
        """Start a worker that died again on its address (the head reconnects to it and re-prefills),
        after RESTART_DELAY_S doubling with each recent restart; one restarted RESTART_LIMIT times within
        RESTART_WINDOW_S is left down at its next death, said once. A worker that was asked to stop (exit
        status 0, SIGTERM, SIGINT: a service manager stopping the whole group) is not restarted. Polling
        also reaps the dead (no zombies)."""
        recent: list[list[float]] = [[] for _ in range(self.n)]  # restart times within the window
        due: dict[int, float] = {}  # worker -> when it starts again
        done: set[int] = set()  # left down
        while not self._stopping.wait(POLL_S):
            with self._lock:
                if self._stopping.is_set():
                    return
                for i, proc in enumerate(self.procs):
                    status = proc.poll()
                    if status is None and i not in done:
                        self._kill_if_hung(i, proc)
                    if status is None or i in done:
                        continue
                    now, (host, port) = time.monotonic(), self.addresses[i]
                    if i in due:
                        if now >= due[i]:
                            del due[i]
                            recent[i].append(now)
                            self.procs[i] = self._launch(i)
                            self._pump(i, self.procs[i], threading.Event(), [])
                            self.log(f"[worker {i}] started again on {host}:{port}")
                        continue
                    if status in (0, -signal.SIGTERM, -signal.SIGINT):
                        done.add(i)
                        self.log(f"[worker {i}] stopped (status {status}): it was asked to; not starting it again")
                        continue
                    recent[i] = [t for t in recent[i] if now - t < RESTART_WINDOW_S]
                    if len(recent[i]) >= RESTART_LIMIT:
                        done.add(i)
                        why = f"exited (status {status}) after {RESTART_LIMIT} restarts within {RESTART_WINDOW_S:.0f} s"
                        self.log(f"[worker {i}] {why}: left down; its stage cannot serve until the head is "
                                 f"restarted")
                        if self._left_down is not None:
                            self._left_down(i, f"its local worker {why} and was left down")
                        continue
                    delay = RESTART_DELAY_S * 2 ** len(recent[i])
                    due[i] = now + delay
                    self.log(f"[worker {i}] exited (status {status}); starting it again on {host}:{port} "
                             f"in {delay:g} s")

    def _kill_if_hung(self, i: int, proc: subprocess.Popen) -> None:
        if self._watch is None or i in self._killed:
            return
        last_heard, timeout = self._watch
        heard = last_heard(i)
        if heard < self._launched[i]:  # not reached since its (re)start: loading, or not its turn yet
            return
        silent = time.monotonic() - heard
        if silent > timeout:
            self.log(f"[worker {i}] alive but not heard from for {silent:.0f} s (hung or stopped): killing it, "
                     f"so that it starts again")
            self._killed.add(i)  # once: a process stuck in the kernel may take a while to go
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the TP ranks go with it
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:  # a restart under way finishes first; none starts after this
            pass
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=5)
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
        for sock in self.socks:
            sock.close()
        self.socks = []
        self.mps.stop()
