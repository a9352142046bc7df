"""Tensor parallelism inside one host: N processes serve one model as one engine.

    runtime generate MODEL --tp 2 -p "..."        runtime serve MODEL --tp 4 --device cuda

Rank 0 is the process the user started. It owns the engine (scheduler, sampler, tokenizer) and
its share of every layer, and starts ranks 1..N-1 as child processes (multiprocessing, spawn).
All N join one torch.distributed group — NCCL on CUDA (rank r on cuda:r), gloo on CPU — through
a rendezvous file in a private temporary directory, and each loads only its share of the weights
(flotilla.models.parallel: heads, KV heads, intermediate units and vocabulary rows divided).

Each step rank 0 sends the StepInput to every other rank over a pipe (msgpack; the sampling rows
stay on rank 0), and then all ranks run the same ModelRunner step: the collectives inside the
layers (an all-reduce after o_proj and down_proj, one after the embedding, a gather of the
logits) keep them in lockstep, and only rank 0 receives the logits and samples. Each rank's KV
cache holds its own KV heads, with the block ids rank 0's block manager hands out.

The control messages go over pipes rather than the process group, so that an idle server has no
collective waiting out a timeout, and a rank whose parent dies reads EOF and exits.

Pipeline parallelism combines with this as one TP group per stage (`runtime serve --pp N --tp M`,
`runtime worker --tp M`): the stage's worker is rank 0, `load_model_parallel(..., stage=...)`
builds its group, and `TPExecutor.execute(step, hidden)` broadcasts the stage's incoming hidden
states to the other ranks (pipeline/stage_runtime.py). Each stage's group is its own: its
processes, its rendezvous, its default process group.
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import msgpack
import torch
import torch.distributed as dist
from tqdm import tqdm

from flotilla.errors import FlotillaError
from flotilla.models.llama import Stage
from flotilla.models.parallel_state import TPGroup, check_divisible, tensor_parallel
from flotilla.models.sources import open_source

from .default_model import resolve_model_path
from .host_memory import lean_cpu_load
from .kv_cache import KVCache, KVCacheSpec
from .loader import LoadedModel, load_model, parse_device, parse_dtype
from .model_runner import ModelRunner, StepInput
from .sampler import SamplerOutput

log = logging.getLogger("flotilla.runtime")

RANK_DEATH_WAIT_S = 2.0  # after a failed step, how long rank 0 waits to see whether a rank died (its exit code)


class RankDied(FlotillaError):
    """A step failed because a tensor-parallel rank died: the group can never serve again."""


def add_tp_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel size: N processes on this host share every layer "
                        "(GPUs cuda:K..K+N-1 from --device cuda:K, default cuda:0; or CPU processes splitting "
                        "the cores; default 1; vLLM's --tensor-parallel-size is the same)")
    p.add_argument("--tensor-parallel-size", dest="tp", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


@dataclass(frozen=True)
class LaunchSpec:
    """What every rank loads, and where."""

    model: str
    device: str  # cpu, or cuda / cuda:K (rank r then uses cuda:K+r)
    dtype: str | None
    world_size: int
    threads: int  # torch threads per rank on CPU
    stage: tuple[int, int, int] | None = None  # (start, end, num_layers)

    def device_for(self, rank: int) -> torch.device:
        d = torch.device(self.device)
        return torch.device("cuda", (d.index or 0) + rank) if d.type == "cuda" else d

    @property
    def backend(self) -> str:
        return "nccl" if torch.device(self.device).type == "cuda" else "gloo"

    def stage_of(self) -> Stage | None:
        return Stage(*self.stage) if self.stage else None


# ------------------------------------------------------------------------------- messages

def _pack(*fields) -> bytes:
    return msgpack.packb(list(fields), use_bin_type=True)


def _unpack(data: bytes) -> list:
    return msgpack.unpackb(data, raw=False, strict_map_key=True)


# rank 0 samples and verifies: the sampling rows and a draft model's probabilities stay there
_STEP_FIELDS = [f.name for f in dataclasses.fields(StepInput) if f.name not in ("sampling", "draft_probs")]


def encode_step(step: StepInput, hidden: torch.Tensor | None = None) -> bytes:
    """A step for the other ranks: every StepInput field but the sampling rows and draft
    probabilities (rank 0 samples),
    and the shape of the hidden states that follow by broadcast, if any."""
    shape = list(hidden.shape) if hidden is not None else None
    return _pack("step", {name: getattr(step, name) for name in _STEP_FIELDS}, shape)


def decode_step(msg: list) -> tuple[StepInput, list[int] | None]:
    _, fields, shape = msg
    return StepInput(**fields, sampling=None), shape


class _NoSampler:
    """The other ranks compute their share of the logits (for the gather) and sample nothing."""

    def __call__(self, logits: torch.Tensor, sampling) -> SamplerOutput:
        return SamplerOutput([])


# ---------------------------------------------------------------------------------- rank 0

def check_gloo_interface() -> None:
    """GLOO_SOCKET_IFNAME, where set, names this machine's interfaces (else every rank dies with gloo's
    traceback)."""
    value = os.environ.get("GLOO_SOCKET_IFNAME", "").strip()
    if not value:
        return
    import socket

    here = [name for _, name in socket.if_nameindex()]
    missing = [n for n in value.split(",") if n.strip() not in here]
    if missing:
        raise FlotillaError(f"GLOO_SOCKET_IFNAME={value!r}: no interface {', '.join(missing)} on this machine "
                            f"(it has {', '.join(here)}); name one of those, or unset it")


class TensorParallel:
    """Rank 0's handle on its group: the other ranks' processes and pipes, and the TPGroup that
    layers are built for. `close()` (also at exit) stops the ranks."""

    def __init__(self, spec: LaunchSpec):
        check_gloo_interface()
        self.spec = spec
        self._closed = False
        self.in_step = False  # rank 0 is inside a step: the other ranks may wait in its collectives
        self._tmp = tempfile.TemporaryDirectory(prefix="flotilla-tp-")
        init = Path(self._tmp.name, "rendezvous").as_uri()
        ctx = multiprocessing.get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(1, spec.world_size):
            here, there = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=_worker_main, args=(rank, spec, init, there), name=f"flotilla-tp-{rank}",
                               daemon=True)
            proc.start()
            there.close()
            self.procs.append(proc)
            self.conns.append(here)
        atexit.register(self.close)
        try:
            self._wait_for("hello")
            _join_group(spec, 0, init)
        except BaseException:
            self.close()
            raise
        self.group = TPGroup(0, spec.world_size)

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def memory_shares(self) -> int:
        """How many ranks share one device's memory: all of them on CPU, one per GPU."""
        return self.world_size if self.spec.device_for(0).type == "cpu" else 1

    def wait_ready(self) -> None:
        """Wait until every other rank has loaded its share (a FlotillaError names a failed rank)."""
        self._wait_for("ready")

    def executor(self, runner: ModelRunner) -> "TPExecutor":
        return TPExecutor(runner, self)

    def send(self, payload: bytes) -> None:
        for conn in self.conns:
            conn.send_bytes(payload)

    def _wait_for(self, kind: str) -> None:
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(0.2):
                if not proc.is_alive():
                    raise FlotillaError(f"tensor-parallel rank {rank} exited (code {proc.exitcode}) "
                                        f"before it was {kind}; its error is printed above")
            try:
                msg = _unpack(conn.recv_bytes())
            except EOFError:
                raise FlotillaError(f"tensor-parallel rank {rank} closed its pipe before it was {kind}") from None
            if msg[0] == "error":
                raise FlotillaError(f"tensor-parallel rank {rank}: {msg[1]}")
            if msg[0] != kind:
                raise RuntimeError(f"tensor-parallel rank {rank} sent {msg[0]!r} where {kind!r} was expected")

    def dead_ranks(self) -> list[str]:
        """The other ranks that have exited: every step needs them all, so the group cannot serve again."""
        return [f"tensor-parallel rank {rank} exited (code {proc.exitcode})"
                for rank, proc in enumerate(self.procs, start=1) if not self._closed and not proc.is_alive()]

    def rank_death(self, error: BaseException) -> RankDied | None:
        """After a step failed with `error` (a collective's or a pipe's): the RankDied to raise instead, if a rank
        has exited (a collective may fail a moment before the dead process is reaped)."""
        deadline = time.monotonic() + RANK_DEATH_WAIT_S
        while not (dead := self.dead_ranks()) and time.monotonic() < deadline and not self._closed:
            time.sleep(0.05)
        if not dead:
            return None
        log.debug("the step failed as a tensor-parallel rank died", exc_info=error)
        return RankDied(f"a tensor-parallel rank died during a step ({'; '.join(dead)}); this engine cannot "
                        f"serve again")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in self.conns:
            try:
                conn.send_bytes(_pack("stop"))
            except OSError:
                pass
        # ranks left inside a step's collective (rank 0 interrupted mid-step, as by Ctrl-C) never read "stop": they
        # are ended after a moment, not after the 10 s a rank gets to leave cleanly
        for proc in self.procs:
            proc.join(timeout=0.5 if self.in_step else 10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._tmp.cleanup()


class TPExecutor:
    """The engine's executor on rank 0: each step goes to the other ranks, then runs here."""

    computes_prompt_logprobs = True  # every rank computes its share of the prompt rows' logits (the gather)

    def __init__(self, runner: ModelRunner, tp: TensorParallel):
        self.runner, self.tp = runner, tp
        spec = runner.cache.spec  # the same pool on every rank, a hybrid cache's groups too
        tp.send(_pack("setup", runner.cache.num_blocks, runner.block_size, [list(g) for g in spec.groups],
                      list(spec.group_windows)))

    def execute(self, step: StepInput, hidden: torch.Tensor | None = None):
        try:
            self.tp.in_step = True
            self.tp.send(encode_step(step, hidden))
            if hidden is not None:
                hidden = self.tp.group.broadcast(hidden.contiguous())
            out = self.runner.execute(step, hidden)
            self.tp.in_step = False
            return out
        except (RuntimeError, OSError) as e:  # gloo's or NCCL's error text, or a broken pipe: say which rank died
            died = self.tp.rank_death(e)
            if died is None:
                raise
            raise died from None

    def close(self) -> None:
        self.tp.close()


def load_model_parallel(model: str | Path | None, device: str | None = None, dtype: str | None = None, tp: int = 1,
                        stage: Stage | None = None, with_tokenizer: bool = True,
                        progress: bool | None = None) -> LoadedModel:
    """`load_model`, split over `tp` processes of this host when tp > 1; then `lm.parallel` is
    the TensorParallel handle and build_engine makes this process rank 0 of the group."""
    if tp == 1:
        return load_model(model, device, dtype, stage, with_tokenizer, progress)
    path = resolve_model_path(str(model) if model else None)
    dev = parse_device(device)
    parse_dtype(dtype, dev)  # a bad name fails here, before any process starts
    check_divisible(open_source(path).config, tp, where=str(path))
    if dev.type == "cuda" and (dev.index or 0) + tp > torch.cuda.device_count():
        raise FlotillaError(f"--tp {tp} from {dev} needs GPUs up to cuda:{(dev.index or 0) + tp - 1}; "
                            f"this host has {torch.cuda.device_count()}")
    threads = max(1, torch.get_num_threads() // tp)
    spec = LaunchSpec(str(path), str(dev), dtype, tp, threads,
                      (stage.start, stage.end, stage.num_layers) if stage else None)
    if dev.type == "cpu":
        torch.set_num_threads(threads)
    group = TensorParallel(spec)
    try:
        with tensor_parallel(group.group):
            lm = load_model(path, spec.device_for(0), dtype, stage, with_tokenizer, progress)
        group.wait_ready()
    except BaseException:
        group.close()
        raise
    return dataclasses.replace(lm, parallel=group)


# ---------------------------------------------------------------------------- ranks 1..N-1

def _join_group(spec: LaunchSpec, rank: int, init_method: str) -> None:
    device = spec.device_for(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: the ranks talk over loopback
    dist.init_process_group(spec.backend, init_method=init_method, rank=rank, world_size=spec.world_size)


def _worker_main(rank: int, spec: LaunchSpec, init_method: str, conn) -> None:
    """A rank other than 0: join the group, load this rank's share, then run the steps rank 0 sends."""
    serving = False
    # tqdm's default lock is a multiprocessing semaphore: a rank ended inside a collective (after a Ctrl-C or a
    # peer's death) would leave it to the resource tracker, which warns of it at exit; a thread lock is enough here
    tqdm.set_lock(threading.RLock())
    try:
        if spec.device_for(rank).type == "cpu":
            torch.set_num_threads(spec.threads)
        conn.send_bytes(_pack("hello"))
        _join_group(spec, rank, init_method)
        with lean_cpu_load(spec.device_for(rank)), tensor_parallel(TPGroup(rank, spec.world_size)):
            lm = load_model(spec.model, spec.device_for(rank), spec.dtype, spec.stage_of(), with_tokenizer=False,
                            progress=False)
        conn.send_bytes(_pack("ready"))
        serving = True
        _run_steps(lm, conn, TPGroup(rank, spec.world_size))
    except FlotillaError as e:
        _report(conn, str(e))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # rank 0 is gone
    except RuntimeError as e:
        if not (serving and _collective_failed(e)):
            _fail_rank(conn, e)  # an out-of-memory error, a bug: its traceback, and rank 0 hears of it
        # a collective failed: another rank died (rank 0 says which); one line, not the collective's traceback
        print(f"flotilla: tensor-parallel rank {rank}: a step's collective failed (a rank of the group died); "
              f"exiting", file=sys.stderr, flush=True)
        sys.exit(1)
    except BaseException as e:
        _fail_rank(conn, e)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collective_failed(e: RuntimeError) -> bool:
    """Whether a rank's error is its collective's (gloo's or NCCL's: a peer rank went away), not its own."""
    backend_error = getattr(dist, "DistBackendError", None)
    return (backend_error is not None and isinstance(e, backend_error)) or any(
        word in str(e) for word in ("gloo", "NCCL", "Connection closed by peer", "Broken pipe"))


def _fail_rank(conn, e: BaseException) -> None:
    """An unexpected error on a rank: rank 0 hears of it, the traceback goes to stderr, the rank exits."""
    _report(conn, f"{type(e).__name__}: {e}")
    traceback.print_exc()
    sys.exit(1)


def _report(conn, message: str) -> None:
    try:
        conn.send_bytes(_pack("error", message))
    except OSError:
        pass


def _run_steps(lm: LoadedModel, conn, group: TPGroup) -> None:
    runner = None
    while True:
        msg = _unpack(conn.recv_bytes())
        if msg[0] == "stop":
            return
        if msg[0] == "setup":  # an engine was built on rank 0: a cache of the same blocks (and groups) here
            _, num_blocks, block_size, groups, windows = msg
            spec = KVCacheSpec(tuple(lm.model.stage.layers), lm.model.num_kv_heads, lm.config.head_dim, lm.dtype,
                               block_size, tuple(tuple(g) for g in groups), tuple(windows))
            runner = None  # the old cache goes first
            runner = ModelRunner(lm.model, KVCache(spec, num_blocks, lm.device), sampler=_NoSampler())
            continue
        step, shape = decode_step(msg)
        hidden = None
        if shape is not None:
            hidden = group.broadcast(torch.empty(shape, dtype=lm.dtype, device=lm.device))
        runner.execute(step, hidden)
