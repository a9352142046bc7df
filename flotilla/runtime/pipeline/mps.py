"""NVIDIA MPS for local stages that share a GPU (`runtime serve --devices cuda:0,cuda:0`).

Each process on a GPU holds its own CUDA context, and the GPU runs one context at a time. In a
ring whose stages share a GPU every hop is a switch from one process's context to the other's:
~144 µs each on an H100 (GPU timestamps at both ends of each stage; bench/NOTES-gpu-pipeline.md),
twice a token with two stages, 0.29 ms on an 8B model's 2.4 ms token. Under MPS (the CUDA
Multi-Process Service) the clients' work runs in one server context and nothing switches: 2-9 µs
between the stages there, pp=2 on one GPU 0.98x of pp=1 against 0.855x without it.

`mps="auto"` (the default): where two local stages share a GPU, start a private MPS control daemon
(`nvidia-cuda-mps-control -f`, its pipe and log directories in a temporary directory), check that a
CUDA process gets through it, and start the workers as its clients; the daemon goes when the
workers do (and with the head: it dies with its parent). Where an MPS daemon runs already (it
answers on $CUDA_MPS_PIPE_DIRECTORY, default /tmp/nvidia-mps, and a CUDA client gets through it)
the workers use that one. Where
`nvidia-cuda-mps-control` is not installed or the check fails, the workers run without MPS and
the head says why, once. `"on"` makes those an error; `"off"` never starts a daemon and keeps
the workers off one that runs.
"""
from __future__ import annotations

import collections
import ctypes
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from flotilla.errors import FlotillaError

MODES = ("auto", "on", "off")
CONTROL = "nvidia-cuda-mps-control"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
# a CUDA client of the daemon: its first kernel on every shared GPU (the server starts with it)
_PROBE = ("import sys, torch\n"
          "for d in sys.argv[1:]:\n"
          "    x = torch.ones(1024, device=d)\n"
          "    assert float((x + x).sum()) == 2048.0\n")


def shared_gpus(devices: list[str], tp: int = 1) -> list[str]:
    """The CUDA devices that more than one local process would use ('cuda' is cuda:0; with --tp M
    a stage on cuda:i uses cuda:i .. cuda:i+M-1)."""
    seen = collections.Counter(g for d in devices for g in _gpus_of(d, tp))
    return [f"cuda:{i}" for i, n in sorted(seen.items()) if n > 1]


def _gpus_of(device: str, tp: int = 1) -> range:
    """The CUDA indices a local worker on `device` uses (none on a CPU)."""
    if not device.startswith("cuda"):
        return range(0)
    first = int(device.partition(":")[2] or 0)
    return range(first, first + tp)


def _off_env() -> dict[str, str]:
    """Keeps a CUDA process off any MPS daemon: a pipe directory no daemon serves."""
    return {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(tempfile.gettempdir(), "flotilla-mps-off")}


def _pipe_dir(env: dict[str, str] | None = None) -> str:
    return (env if env is not None else os.environ).get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIR


def _answers(pipe_dir: str, env: dict[str, str] | None = None) -> bool:
    """Whether a control daemon answers on `pipe_dir` (a killed one leaves its pipe behind)."""
    control = shutil.which(CONTROL)
    if control is None or not os.path.exists(os.path.join(pipe_dir, "control")):
        return False
    try:
        r = subprocess.run([control], input="get_server_list\n", text=True, timeout=10,
                           env=dict(env if env is not None else os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe_dir),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def running_pipe_dir(env: dict[str, str] | None = None) -> str | None:
    """The pipe directory of an MPS control daemon that runs (and answers) already, if any."""
    d = _pipe_dir(env)
    return d if _answers(d, env) else None


def is_mps_client(device) -> bool:
    """Whether a process on `device` with this environment runs as an MPS client."""
    return device.type == "cuda" and running_pipe_dir() is not None


try:  # looked up once here: nothing but the call itself runs between fork and exec
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None


def _die_with(parent: int):
    """preexec_fn: the daemon goes with the head however the head ends (Linux; strictly, with the
    thread that started it: `serve` starts its workers from the main thread)."""
    def child() -> None:
        if _prctl is not None:
            _prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the head died before that
            os._exit(1)
    return child


def check_client(gpus: list[str], env: dict[str, str], timeout: float = 120.0) -> None:
    """Run a CUDA client on each of `gpus` with `env` (RuntimeError: it failed)."""
    try:
        check = subprocess.run([sys.executable, "-c", _PROBE, *gpus], env=dict(env), timeout=timeout,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"a CUDA client of the MPS daemon did not finish in {timeout:.0f} s") from None
    if check.returncode:
        last = (check.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"a CUDA client of the MPS daemon failed: {last}")


@dataclasses.dataclass
class MpsChoice:
    """What local workers on shared GPUs get: the private daemon started (or None), the
    environment for the workers on those GPUs, and whether they run under MPS at all."""
    daemon: "MpsDaemon | None" = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    used: bool = False
    gpus: list[str] = dataclasses.field(default_factory=list)

    def env_for(self, device: str, tp: int = 1) -> dict[str, str]:
        """The MPS environment of a worker on `device` (only workers on the shared GPUs get it)."""
        return self.env if any(f"cuda:{i}" in self.gpus for i in _gpus_of(device, tp)) else {}

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None


class MpsDaemon:
    """A private MPS control daemon for this machine's workers."""

    def __init__(self, root: str, proc: subprocess.Popen | None, control: str):
        self.root, self.proc, self.control = root, proc, control
        self.pipe_dir, self.log_dir = os.path.join(root, "pipe"), os.path.join(root, "log")

    def client_env(self) -> dict[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir, "CUDA_MPS_LOG_DIRECTORY": self.log_dir}

    @classmethod
    def start(cls, gpus: list[str], timeout: float = 120.0) -> "MpsDaemon":
        """Start one and check that a CUDA client on each of `gpus` gets through it (RuntimeError:
        why not; nothing is left running)."""
        control = shutil.which(CONTROL)
        if control is None:
            raise RuntimeError(f"{CONTROL} is not installed (it comes with NVIDIA's driver utilities)")
        daemon = cls(tempfile.mkdtemp(prefix="flotilla-mps-"), None, control)
        os.makedirs(daemon.pipe_dir)
        os.makedirs(daemon.log_dir)
        env = dict(os.environ, **daemon.client_env())
        try:
            daemon.proc = proc = subprocess.Popen([control, "-f"], env=env, stdin=subprocess.DEVNULL,
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                  preexec_fn=_die_with(os.getpid()))
        except OSError as e:
            shutil.rmtree(daemon.root, ignore_errors=True)
            raise RuntimeError(f"{CONTROL} did not start: {e}") from None
        try:
            deadline = time.monotonic() + 10
            while not os.path.exists(os.path.join(daemon.pipe_dir, "control")):
                if proc.poll() is not None:
                    raise RuntimeError(f"{CONTROL} -f exited with status {proc.returncode}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{CONTROL} -f opened no control pipe in 10 s")
                time.sleep(0.05)
            check_client(gpus, env, timeout)
        except BaseException:
            daemon.stop()
            raise
        return daemon

    def stop(self) -> None:
        """Quit the daemon (it stops its server) and remove its directories."""
        if self.proc.poll() is None:
            try:
                subprocess.run([self.control], input="quit\n", text=True,  # its commands come on stdin
                               env=dict(os.environ, **self.client_env()), timeout=15,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                self.proc.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def mps_for(devices: list[str], mode: str, log, tp: int = 1) -> MpsChoice:
    """The MPS setup of local workers on `devices` under `mode` (MODES). FlotillaError where mode
    is "on" and MPS cannot be had."""
    if mode not in MODES:
        raise FlotillaError(f"--mps {mode!r}: expected one of {', '.join(MODES)}")
    gpus = shared_gpus(devices, tp)
    if not gpus:
        return MpsChoice()
    running = running_pipe_dir()
    if mode == "off":  # not even a daemon that runs already: its clients would find it by default
        return MpsChoice(env=_off_env() if running is not None else {}, gpus=gpus)
    if running is not None:
        try:
            check_client(gpus, dict(os.environ))
        except RuntimeError as e:
            if mode == "on":
                raise FlotillaError(f"--mps on: the MPS daemon at {running}: {e}") from None
            log(f"stages share {', '.join(gpus)}; the MPS daemon at {running} is not usable ({e}): the workers "
                f"run without MPS")
            return MpsChoice(env=_off_env(), gpus=gpus)
        log(f"stages share {', '.join(gpus)}: their workers use the MPS daemon that runs already ({running})")
        return MpsChoice(used=True, gpus=gpus)
    try:
        daemon = MpsDaemon.start(gpus)
    except RuntimeError as e:
        if mode == "on":
            raise FlotillaError(f"--mps on: {e}") from None
        log(f"stages share {', '.join(gpus)} without MPS ({e}): the GPU switches between their processes "
            f"at every hop (~0.15 ms each); start `{CONTROL} -d` first, or give each stage its own GPU")
        return MpsChoice(gpus=gpus)
    log(f"stages share {', '.join(gpus)}: started a private MPS daemon so that the GPU runs their work in one "
        f"context (no switch at each hop; --mps off to run without it)")
    return MpsChoice(daemon, daemon.client_env(), True, gpus)
