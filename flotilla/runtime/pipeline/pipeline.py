"""The head's pipeline: the workers, the ring through them, and its repair.

Setting up (`start`): connect to every worker, probe them, split the layers (partition.py; the
split is printed), have each load its stage (pushing shards it lacks), size the KV pool to the
smallest stage, and configure epoch 1: each stage connects to the next, the last answers the head
(and feeds stage 0 the sampled ids that overlapped decodes take as their input tokens).

Running: `send_step` writes a Step for stage 0 to its socket from the engine's thread (or, over
TLS or behind unsent bytes, hands it to the I/O thread); `get_results` reads the current epoch's
StepResults on the same thread from the result connection to the last stage (results.py), opened
at each configuration.

Faults: a lost worker (closed connection, silent past the heartbeat timeout) or a stage reporting
a broken link bumps `generation` and clears `ready`; everything in flight is lost. A stage's report
is hearsay (its neighbour may be the one that died): the head pings every worker and says the
fault once it knows which one went down, or that all answer (`_settle`), the report as detail. A repair task
reconnects with exponential backoff; a returning worker reloads its stage (from its cache, with
no transfer, after a push) with exactly the pool size it had, then every stage is configured for
a new epoch and `ready` is set again. The engine (engine.py) pauses and re-prefills meanwhile.

All network work runs on one asyncio loop in its own thread; the engine thread calls the public
methods.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from flotilla.errors import FlotillaError
from flotilla.models.config import ModelConfig
from flotilla.models.llama import Stage

from .activations import check_wire_dtype
from .messages import Configure, Configured, Fault, Probe, StageLoaded, StatsRequest, Step, StepResult, WorkerInfo, \
    WorkerStats
from .connection import TOKEN_MISMATCH, AuthError, TLSHandshakeError
from .partition import (StageBudget, compute_units, describe, shared_without_mps, sharing, split_layers,
                        stages_from_counts)
from .peer import GONE, LinkSettings, PeerLost, RemoteFailure, StagePeer
from .results import ResultChannel, open_result_channel
from .weight_push import MODEL_MISMATCH, fingerprint, load_request
from .wire import ProtocolError

log = logging.getLogger("flotilla.pipeline")

MAX_BACKOFF = 2.0


@dataclass(frozen=True)
class PipelineSettings:
    hosts: tuple[tuple[str, int], ...]
    link: LinkSettings
    layers: tuple[int, ...] | None = None  # --layers, else split by the probes
    wire_dtype: str = "fp16"
    dtype: str = "auto"
    block_size: int = 16
    kv_memory: int = 0  # bytes per stage (--kv-cache-memory); 0: not given
    kv_fraction: float = 0.0  # of each stage's free memory (--kv-cache-fraction); 0: not given
    max_num_seqs: int = 64  # with neither given, a stage's pool is sized as a single-process run's
    stage_timeout: float = 60.0
    load_timeout: float = 3600.0
    graph_tokens: int = 0  # GPU stages replay decode steps of up to this many tokens from CUDA graphs (0: eager)
    graph_query_len: int = 1  # 1 + the speculative tokens a sequence may verify in a replayed step
    max_model_len: int = 0  # the longest context (the graphs' block-table width); 0: the model's
    spin_us: int = 0  # the engine's thread polls for results this long before it sleeps (results.py)
    micro_batches: int = 0  # kept in flight; 0: one per stage that can compute at the same time (partition.compute_units)
    mps_advice: bool = True  # name stages that share a GPU without MPS (local workers: their --mps said it already)

    def __post_init__(self):
        check_wire_dtype(self.wire_dtype)
        if not self.hosts:
            raise FlotillaError("a pipeline needs at least one worker")
        if self.stage_timeout <= 0:
            raise FlotillaError(f"--stage-timeout must be > 0 seconds, got {self.stage_timeout}")
        if self.micro_batches < 0:
            raise FlotillaError(f"micro-batches in flight must be >= 0 (0: automatic), got {self.micro_batches}")


class Pipeline:
    def __init__(self, model: Path, config: ModelConfig, settings: PipelineSettings,
                 report: Callable[[str], None] | None = None):
        self.model, self.config, self.settings = Path(model), config, settings
        self.report = report or (lambda line: log.info("%s", line))
        self.peers = [StagePeer(i, h, p, settings.link, self._on_data, self._on_lost)
                      for i, (h, p) in enumerate(settings.hosts)]
        self.stages: list[Stage] = []
        self.shares = [1] * len(self.peers)  # stages that share each stage's memory (e.g. one GPU)
        self.infos: list[WorkerInfo] = []
        self.num_blocks = 0
        self.generation = 0  # bumped at every fault
        self.epoch = 0
        self.ready = threading.Event()
        self.down_since: float | None = None
        self.down_reason = ""
        self.missing: dict[int, str] = {}  # a stage that is down -> what it is, e.g. 'is unreachable: …'
        self._refused: set[int] = set()  # stages whose worker answered Failure (missing says why)
        self.repair_error = ""  # why the last repair failed, where no stage's entry in `missing` says it
        self._said: set[str] = set()  # the reasons of failed repairs logged since the fault
        self.left_down: dict[int, str] = {}  # stages whose local worker will not come back (LocalWorkers)
        self.loaded: list[StageLoaded] = []
        self._results: ResultChannel | None = None  # this epoch's; the engine's thread reads it
        self._retired: list[ResultChannel] = []  # aborted by the I/O thread, closed by the engine's
        self._fingerprint = ""
        self._repair: asyncio.Task | None = None
        self._noticed = ""  # a stage's report of a broken link, not yet said (_settle): 'stage i (address)'
        self._noticed_what = ""  # and what it reported
        self._settling: asyncio.Task | None = None
        self._started = False  # faults before this are errors of start()
        self._closing = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="flotilla-pipeline", daemon=True)
        self._thread.start()
        self.on_close: list[Callable[[], None]] = []  # e.g. stop the local worker processes

    @property
    def num_stages(self) -> int:
        return len(self.peers)

    @property
    def depth(self) -> int:
        """Micro-batches to keep in flight: one per stage that can compute while the others do
        (stages sharing a GPU take turns on it: more micro-batches would only cut the batch)."""
        if self.settings.micro_batches:
            return self.settings.micro_batches
        if not self.infos:
            return self.num_stages
        return compute_units([i.device for i in self.infos], [i.memory_id for i in self.infos])

    # ------------------------------------------------------------------ the engine thread's side
    def start(self) -> None:
        try:
            self._run(self._setup(), None)
        except PeerLost as e:  # a worker that went away while it was being set up: one line, not a traceback
            self.close()
            raise FlotillaError(f"setting up the pipeline: {e}") from None
        except BaseException:
            self.close()
            raise

    def send_step(self, msg: Step) -> None:
        """Straight onto stage 0's socket from this thread (plain TCP; Connection.write_direct),
        else (TLS) through the I/O thread."""
        if not (self.ready.is_set() and msg.epoch == self.epoch and self.peers[0].write_direct(msg)):
            self._loop.call_soon_threadsafe(self._write_step, msg)

    def get_results(self, timeout: float) -> list[StepResult]:
        """The StepResults that have come back, waiting up to `timeout` seconds for the first (the
        engine's thread only)."""
        while self._retired:
            self._retired.pop().close()
        channel = self._results
        if channel is None:
            self.ready.wait(timeout)  # down: the engine rewinds once the generation moves
            return []
        return channel.read(timeout)

    def worker_stats(self, reset: bool = False) -> list[WorkerStats]:
        async def ask():
            return await asyncio.gather(*(p.call(StatsRequest(reset), 30) for p in self.peers))
        return self._run(ask(), 60)

    def last_heard(self, i: int) -> float:
        """When (time.monotonic()) stage i's worker last sent anything (it answers the head's pings every
        second); 0 before the first connection."""
        return self.peers[i].last_seen

    def problems(self) -> list[str]:
        if self.ready.is_set() or self.down_since is None:
            return []
        down = f"down {time.monotonic() - self.down_since:.0f}s"
        return [f"{line} ({down})" for line in self._down_lines()]

    def _down_lines(self) -> list[str]:
        """What keeps the pipeline down now: each missing stage, and a repair's failure that names none."""
        lines = [f"pipeline stage {i} ({self.peers[i].address}) {state}" for i, state in sorted(self.missing.items())]
        if self.repair_error or not lines:
            lines.append(f"the pipeline is being repaired: {self.repair_error or self.down_reason}")
        return lines

    def stage_status(self) -> list[tuple[int, str, str, bool]]:
        """(index, worker address, device, up) per stage: up while its worker is connected and not
        missing (a stage the repair has not brought back yet is down)."""
        devices = [i.device for i in self.infos] + [""] * (len(self.peers) - len(self.infos))
        return [(p.index, p.address, devices[p.index], p.connected and p.index not in self.missing)
                for p in self.peers]

    def describe_down(self) -> str:
        if self.missing or self.repair_error:
            return "; ".join(self._down_lines())
        return self.down_reason or "the pipeline is down"

    def stage_left_down(self, index: int, why: str) -> None:
        """Stage `index`'s local worker will not come back (any thread): the pipeline can never serve again."""
        self.left_down[index] = why

    def fatal(self) -> list[str]:
        """What keeps this pipeline from ever serving again: a local worker left down (the server exits)."""
        return [f"pipeline stage {i} ({self.peers[i].address}): {why}" for i, why in sorted(self.left_down.items())]

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        try:
            self._run(self._shutdown(), 10)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()  # here, not in its finalizer at exit (its self-pipe may be gone by then)
        while self._retired:
            self._retired.pop().close()
        for fn in self.on_close:
            fn()

    def _run(self, coro, timeout: float | None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ------------------------------------------------------------------ set up
    async def _setup(self) -> None:
        s = self.settings
        self._fingerprint = await asyncio.to_thread(fingerprint, self.model)
        await self._gather([self._connect(p) for p in self.peers])
        probe = Probe(json.dumps(self.config.to_hf_dict()), s.layers is None, s.dtype)
        infos: list[WorkerInfo] = await self._gather([p.call(probe, 120) for p in self.peers])
        self.infos = infos
        self.shares = sharing([i.memory_id for i in infos])
        if s.mps_advice:
            for group in shared_without_mps([i.device for i in infos], [i.memory_id for i in infos],
                                            [i.mps for i in infos]):
                names = ", ".join(f"{i} ({self.peers[i].address})" for i in group)
                self.report(f"stages {names} share one GPU without MPS: it switches between their processes at "
                            f"every hop (~0.15 ms each); start `nvidia-cuda-mps-control -d` on that host before the "
                            f"workers (local workers: --mps auto does it)")
        if s.layers is not None:
            counts, how = list(s.layers), "--layers"
        else:
            budgets = [StageBudget(p.address, i.free_memory // n, i.layer_bytes, i.head_bytes, i.layer_ms, i.head_ms)
                       for p, i, n in zip(self.peers, infos, self.shares)]
            counts, how = split_layers(self.config.num_hidden_layers, budgets), "by free memory and speed probe"
        self.stages = stages_from_counts(counts)
        self.report(describe(self.stages, [p.address for p in self.peers], how))
        self.loaded = await self._gather([self._load(p, 0) for p in self.peers])
        self.num_blocks = min(r.capacity for r in self.loaded)
        if self.num_blocks < 2:
            raise FlotillaError(f"a pipeline stage has room for {self.num_blocks - 1} KV block(s) beside the padding "
                                "block; need at least 1 (give the workers more memory or lower --max-num-seqs)")
        for p, r in zip(self.peers, self.loaded):
            self.report(f"  stage {p.index}: weights {r.source}; room for {r.capacity - 1} KV blocks")
        self.report(f"pipeline KV pool: {self.num_blocks - 1} blocks x {s.block_size} tokens (the smallest stage's, "
                    f"+1 padding block); "
                    f"activations on the wire as {s.wire_dtype} (a same-host device lane keeps the stage's own "
                    f"dtype); {self.depth} micro-batch(es) in flight")
        await self._configure_all()
        self._started = True
        self.ready.set()

    async def _connect(self, peer: StagePeer) -> None:
        try:
            await peer.connect()
        except GONE as e:
            if _wrong_token(e):
                raise FlotillaError(f"cannot connect to worker {peer.address}: it {WRONG_TOKEN}") from None
            why = _why_unreachable(e, self.settings)
            hint = "" if isinstance(e, TLSHandshakeError) else "; start `runtime worker --listen HOST:PORT` there, " \
                "or fix --hosts"
            raise FlotillaError(f"cannot connect to worker {peer.address}: {why}{hint}") from None

    async def _load(self, peer: StagePeer, exact_blocks: int) -> StageLoaded:
        s = self.settings
        req = load_request(self.model, self._fingerprint, self.stages[peer.index], dtype=s.dtype,
                           kv_memory=s.kv_memory, kv_fraction=s.kv_fraction,
                           max_model_len=s.max_model_len or self.config.max_model_len, max_num_seqs=s.max_num_seqs,
                           memory_shares=self.shares[peer.index], block_size=s.block_size, exact_blocks=exact_blocks)
        try:
            return await asyncio.wait_for(peer.load(req, self.model), s.load_timeout)
        except RemoteFailure as e:  # the worker's --model is another model: name the head's too
            if MODEL_MISMATCH not in str(e):
                raise
            raise RemoteFailure(str(e).replace(MODEL_MISMATCH, f"{MODEL_MISMATCH} ({self.model})", 1)) from None

    async def _configure_all(self) -> None:
        self.epoch += 1
        peers = self.peers
        s = self.settings
        tail = len(peers) - 1  # its feedback link feeds stage 0 the sampled ids of overlapped decodes
        msgs = [Configure(self.epoch, self.num_blocks, peers[i + 1].address if i < tail else None,
                          s.wire_dtype, i, s.graph_tokens, s.graph_query_len, s.max_model_len,
                          peers[0].address if 0 < i == tail else None)
                for i in range(len(peers))]
        # from the last stage back, so each stage's next hop is already in the new epoch
        for peer, msg in reversed(list(zip(peers, msgs))):
            reply = await peer.call(msg, 60)  # a failure may be its next hop's (repair_error says it)
            if not isinstance(reply, Configured) or reply.epoch != self.epoch:
                raise RemoteFailure(f"worker {peer.address} did not confirm epoch {self.epoch}")
        last, link = peers[-1], s.link
        # no polling over TLS: the I/O thread writes every step then, and a polling thread keeps the GIL from it
        spin = s.spin_us / 1e6 if link.ssl is None else 0.0
        first = peers[0]
        channel = await asyncio.to_thread(open_result_channel, last.host, last.port, link.token, link.ssl,
                                          link.connect_timeout, link.max_frame, self.epoch, spin, self._results_lost,
                                          lambda: not first.backlogged())
        self._retire()
        self._results = channel

    async def _gather(self, coros):
        """Run concurrently; the first failure cancels the rest and propagates."""
        tasks = [asyncio.ensure_future(c) for c in coros]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise

    # ------------------------------------------------------------------ the data path
    def _write_step(self, msg: Step) -> None:
        """On the loop's thread: the step goes to stage 0's socket now (no queue, no task)."""
        if self.ready.is_set() and msg.epoch == self.epoch:
            self.peers[0].write(msg)

    def _on_data(self, peer: StagePeer, msg) -> None:
        if msg.epoch != self.epoch or not self.ready.is_set():
            return
        if isinstance(msg, Fault):
            self._noticed_what = msg.message
            self._broken(f"stage {peer.index} ({peer.address})", hearsay=True)

    def _retire(self) -> None:
        """Abort this epoch's result connection (the engine's thread, if it waits on it, returns)
        and leave it for that thread to close."""
        channel, self._results = self._results, None
        if channel is not None:
            channel.abort()
            self._retired.append(channel)

    def _results_lost(self, channel: ResultChannel, reason: str) -> None:
        """From the engine's thread: the result connection broke."""
        def lost():
            if channel is self._results:
                self._broken(f"the result connection to stage {self.num_stages - 1} broke: {reason}")
        if not self._closing:
            self._loop.call_soon_threadsafe(lost)

    # ------------------------------------------------------------------ faults and repair
    def _on_lost(self, peer: StagePeer, reason: str) -> None:
        if peer.index not in self._refused:  # a refusal's reason outlives the close that follows it
            self.missing[peer.index] = f"is unreachable: {reason}"
        self._broken(f"stage {peer.index} ({peer.address}): {reason}")

    def _broken(self, reason: str, hearsay: bool = False) -> None:
        """`hearsay`: `reason` names a stage that reports a broken link (_noticed_what); which side of it
        went down is said once known."""
        if self._closing or not self._started:
            return
        if self.ready.is_set():
            self.ready.clear()
            self._retire()
            self.generation += 1
            self.down_since = time.monotonic()
            self.down_reason = f"{reason} reports: {self._noticed_what}" if hearsay else reason
            if hearsay:
                self._noticed = reason
                self._settling = asyncio.get_running_loop().create_task(self._settle(self.down_since))
            else:
                self._report_down(reason)
        elif self._noticed and not hearsay:  # a worker lost after a neighbour's report: the one that went down
            self._report_down(f"{reason}; {self._noticed_first()}")
        if self._repair is None or self._repair.done():
            self._repair = asyncio.get_running_loop().create_task(self._repair_loop())

    def _noticed_first(self) -> str:
        return f"{self._noticed} noticed first: {self._noticed_what}"

    def _report_down(self, reason: str) -> None:
        self._noticed = ""
        self.down_reason = reason
        self.report(f"pipeline down: {reason}; repairing (requests pause, and fail after "
                    f"--stage-timeout {self.settings.stage_timeout:g}s)")

    async def _settle(self, since: float) -> None:
        """After a stage's report: ping every worker; one that is lost meanwhile is the fault's
        cause (_broken says it); one silent for two heartbeats is named; all answering: a broken
        link between live workers, the report alone."""
        for p in self.peers:
            p.ping()
        deadline = since + 2 * self.settings.link.heartbeat_interval
        silent = self.peers
        while self._noticed and time.monotonic() < deadline:
            silent = [p for p in self.peers if p.connected and p.last_seen < since]
            if not silent:
                break
            await asyncio.sleep(0.02)
        if self._noticed:
            names = ", ".join(f"stage {p.index} ({p.address})" for p in silent)
            self._report_down(f"{names} not heard from since; {self._noticed_first()}" if silent
                              else f"{self._noticed} reports: {self._noticed_what}")

    async def _repair_loop(self) -> None:
        delay = 0.1
        while not self._closing:
            try:
                await self._reestablish()
                break
            except (FlotillaError, PeerLost, *GONE) as e:
                if self._closing:
                    return
                if isinstance(e, StageFailure):
                    self._stage_failed(e)
                else:
                    self.repair_error = _why(e)
                self._say_repair_failure(delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF)
        if self._closing:
            return
        if self._noticed:  # back before the fault was said
            self._report_down(f"{self._noticed} reports: {self._noticed_what}")
        down = time.monotonic() - (self.down_since or time.monotonic())
        self.missing.clear()
        self._refused.clear()
        self._said.clear()
        self.repair_error = ""
        self.down_since, self.down_reason = None, ""
        self.ready.set()
        self.report(f"pipeline restored after {down:.1f}s (epoch {self.epoch})")

    def _stage_failed(self, e: "StageFailure") -> None:
        """A repair failed at stage e.index: that stage's entry says why now (not the fault's old reason)."""
        self.missing[e.index] = e.state
        if e.refused:
            self._refused.add(e.index)
        else:
            self._refused.discard(e.index)
        self.repair_error = ""

    def _say_repair_failure(self, delay: float) -> None:
        """A WARNING once per distinct reason (a worker that cannot rejoin is retried every few seconds)."""
        reason = self.describe_down()
        if reason in self._said:
            log.debug("pipeline repair failed (%s); retrying in %.1fs", reason, delay)
            return
        self._said.add(reason)
        log.warning("pipeline not repaired yet: %s; retrying (every %gs at most) until it succeeds", reason, MAX_BACKOFF)

    async def _reestablish(self) -> None:
        for peer in self.peers:
            if not peer.connected:
                await self._rejoin(peer)
        await self._configure_all()

    async def _rejoin(self, peer: StagePeer) -> None:
        """Connect to a returning worker, probe it, have it load its stage. A failure is a StageFailure: what
        the stage is now (unreachable, or answering but unable to rejoin), for /health and the requests' errors."""
        i = peer.index
        try:
            await peer.connect()
        except GONE as e:
            state = WRONG_TOKEN if _wrong_token(e) else f"is unreachable: cannot connect ({_why(e)})"
            raise StageFailure(i, state, str(e), refused=False) from None
        self._refused.discard(i)  # it answers: a loss from now on is said as such, not as its last refusal
        try:
            self.infos[i] = await peer.call(Probe(json.dumps(self.config.to_hf_dict()), False, self.settings.dtype),
                                            120)
            loaded = await self._load(peer, self.num_blocks)
            if loaded.capacity < self.num_blocks:
                raise FlotillaError(f"worker {peer.address} came back with room for {loaded.capacity - 1} KV blocks; "
                                    f"the pipeline's pool has {self.num_blocks - 1}")
        except PeerLost as e:  # it went away meanwhile (_on_lost said why)
            raise StageFailure(i, self.missing.get(i) or f"is unreachable: {e}", str(e), refused=False) from None
        except (FlotillaError, *GONE) as e:  # e.g. it serves another head now, or another --model: it says so
            peer.close()  # the next try starts afresh: connect, probe, load
            raise StageFailure(i, f"answered, but cannot rejoin: {_said(e, peer)}", str(e), refused=True) from None
        self.loaded[i] = loaded
        self.missing.pop(i, None)
        self._refused.discard(i)
        self.report(f"  stage {i} ({peer.address}) is back: weights {loaded.source}")

    async def _shutdown(self) -> None:
        for task in (self._repair, self._settling):
            if task is not None:
                task.cancel()
        self._retire()
        for p in self.peers:
            p.close()


class StageFailure(RemoteFailure):
    """A stage's worker could not (re)join: `state` says what the stage is now, after 'pipeline stage i (address)'
    (e.g. 'is unreachable: …'); the message is the worker's own words."""

    def __init__(self, index: int, state: str, message: str, refused: bool = True):
        super().__init__(message)
        self.index, self.state, self.refused = index, state, refused


WRONG_TOKEN = ("answered, but with another token than this head's; give the head and every worker the same "
               "token (FLOTILLA_TOKEN or --token-file)")


def _wrong_token(e: BaseException) -> bool:
    return isinstance(e, AuthError) and str(e) == TOKEN_MISMATCH


def _said(e: BaseException, peer: StagePeer) -> str:
    """A worker's failure without the 'worker ADDRESS: ' prefix (the stage is named already)."""
    text = _why(e)
    prefix = f"worker {peer.address}: "
    return text[len(prefix):] if text.startswith(prefix) else text


def _why_unreachable(e: BaseException, s: PipelineSettings) -> str:
    """Why the first connection to a worker failed, in words (each bounded by the connect timeout)."""
    if isinstance(e, socket.gaierror):
        return f"unknown host ({e.strerror})"
    if isinstance(e, asyncio.TimeoutError):
        return f"no answer within {s.link.connect_timeout:g} s"
    if isinstance(e, ProtocolError) and not isinstance(e, AuthError):
        return f"something answered, but not a flotilla worker ({e})"
    if isinstance(e, TLSHandshakeError):
        return (f"the TLS handshake failed ({e}): a worker without TLS (then start it with --tls-cert/"
                f"--tls-key/--tls-ca too, or leave them out here), or certificates that do not match")
    if s.link.ssl is None and isinstance(e, asyncio.IncompleteReadError) and not e.partial:
        return ("it closed the connection without a word: a worker with TLS (then give this head the same "
                "--tls-cert/--tls-key/--tls-ca), or another program on that port")
    return _why(e)


def _why(e: BaseException) -> str:
    text = str(e)
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return f"{type(e).__name__}: {text}" if text and not isinstance(e, FlotillaError) else (text or type(e).__name__)
