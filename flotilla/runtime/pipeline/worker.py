"""A pipeline worker (`runtime worker`): serves one stage of a model to an authenticated head.

Connections, all authenticated by the token handshake (connection.py); the first frame after it
says what the peer is:

    the head            Probe/LoadStage/Configure/Ping/… (control), and on stage 0 the Steps
    the previous stage  Upstream, then Steps (a DeviceLane first where its outputs can skip the
                        socket: stages of one host, lane.py)
    the last stage      (to stage 0, in a ring of several) Upstream, then Sampled: the ids of steps
                        sent with `feed`, the input tokens of the overlapped decodes that follow
                        (or their slot in its ids lane)
    the head's results  ResultsLink (to the last stage, once per epoch): answered by Configured, then
                        this epoch's StepResults go there (results.py reads them on the engine's thread)

Anything else — a failed handshake, an oversized frame, malformed msgpack, an unknown or
unexpected message — closes that one connection; the worker goes on serving its head. A new head
connection replaces the old one where that head has been silent for HEAD_QUIET seconds (a restarted
head: a head whose process ended closed its connection already); while the old head is heard (it pings
every second), the new one is answered Failure, so a second `runtime serve` pointed at busy workers
says so and leaves the first head's requests alone. The loaded stage is kept.

The asyncio loop does all network I/O and answers heartbeats; the steps themselves (which run
where, in what order, and where their output goes) are step_path.py's. `Configure` starts a new
epoch.
"""
from __future__ import annotations

import asyncio
import logging
import ssl
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from flotilla.errors import FlotillaError
from flotilla.models.llama import Stage
from flotilla.runtime.host_memory import lean_cpu_load
from flotilla.runtime.tp import load_model_parallel

from .connection import (STREAM_LIMIT, AuthError, Connection, connect, format_address, parse_address,
                         server_handshake)
from .messages import (Configure, Configured, DeviceLane, Failure, Fault, FileChunk, FileEnd, LoadStage, NeedFiles, Ping,
                       Pong, Probe, ResultsLink, Sampled, StageLoaded, StatsRequest, Step, Upstream,
                       WorkerStats)
from .probe import worker_info
from .outbox import GONE as _GONE, Outbox
from .stage_runtime import StageRuntime, StageTimes, on_device
from .step_path import Counters, Link, StepPath
from .stream import start_server
from .weight_push import ShardReceiver, WeightCache, fingerprint
from .wire import DEFAULT_MAX_FRAME, ProtocolError

log = logging.getLogger("flotilla.pipeline.worker")


def version() -> str:
    try:
        from importlib.metadata import version as v
        return f"flotilla {v('flotilla')}"
    except Exception:  # noqa: BLE001 - running from a source tree
        return "flotilla (source)"


REFUSAL_LOG_S = 60.0  # a refusal of one host for one reason is logged at most once this often (a head retries)
HEAD_QUIET = 5.0  # seconds of silence from the current head (it pings every second) before another may take over


@dataclass(frozen=True)
class WorkerConfig:
    token: bytes
    device: torch.device
    cache_dir: Path
    model: Path | None = None  # the worker's own copy of the model, if any
    ssl_server: ssl.SSLContext | None = None
    ssl_client: ssl.SSLContext | None = None
    max_frame: int = DEFAULT_MAX_FRAME
    handshake_timeout: float = 10.0
    tp: int = 1  # tensor-parallel ranks of the stage (this process is rank 0; `runtime worker --tp`)
    local: bool = False  # started by its head (serve --pp's local workers): the head's leaving is no news


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.cache = WeightCache(config.cache_dir)
        self.path = StepPath(config.device, self._fault)
        self.head: Outbox | None = None
        self._head_peer, self._head_heard = "", 0.0  # the current head's address, when it last sent a frame
        self.upstream: Connection | None = None
        self.shard_bytes_received = 0
        self.rejected = 0  # connections closed for failing the handshake or breaking the protocol
        self._refusals: dict[tuple[str, str], tuple[float, int]] = {}  # (host, why) -> (last logged, since)
        self._fingerprint: str | None = None
        self._server: asyncio.AbstractServer | None = None
        self._threads = torch.get_num_threads()  # the stage's CPU threads (`--threads`)
        self._closing = False

    @property
    def runtime(self) -> StageRuntime | None:
        return self.path.runtime

    def idle(self) -> bool:
        """Whether the compute thread has nothing to do (spin.py polls only then)."""
        return self.path.idle()

    @property
    def on_step(self):
        return self.path.on_step

    @on_step.setter
    def on_step(self, fn) -> None:  # each step's arrival (spin.SpinSelector.arm)
        self.path.on_step = fn

    # ------------------------------------------------------------------ lifecycle
    async def start(self, host: str | None, port: int | None, sock=None) -> tuple[str, int]:
        """Listen (on `sock`, an inherited listening socket, where given); returns the bound address
        (port 0 picks a free one)."""
        if self.config.device.type == "cuda":
            torch.cuda.set_device(self.config.device)  # decode steps launch from the loop's thread
        self.path.start(asyncio.get_running_loop())
        self._server = await start_server(self._accept, host, port, STREAM_LIMIT, self.config.ssl_server, sock=sock)
        sock = self._server.sockets[0].getsockname()
        return sock[0], sock[1]

    async def close(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
        path = self.path
        for box in (self.head, *(link.outbox for link in (path.downstream, path.results, path.feedback) if link)):
            if box is not None:
                box.close()
        if self.upstream is not None:
            self.upstream.close()
        path.drop_downstream()  # and its lanes' shared files
        path.stop()
        await asyncio.to_thread(path.swap, None)

    # ------------------------------------------------------------------ connections
    def _refused(self, writer: asyncio.StreamWriter, why: str) -> None:
        """Count a refused connection and log it (`_warn_limited`)."""
        self.rejected += 1
        host = str((writer.get_extra_info("peername") or ("?",))[0])
        self._warn_limited(host, f"refused a connection from {host}: {why}")

    def _warn_limited(self, host: str, text: str, level: int = logging.WARNING) -> None:
        """Log a refusal once per REFUSAL_LOG_S for one host and text (a head refused retries every few seconds),
        then with how many went unlogged since."""
        now = time.monotonic()
        last, since = self._refusals.get((host, text), (None, 0))
        if len(self._refusals) > 1000:  # bounded: a scan of many hosts forgets every count
            self._refusals.clear()
        if last is None or now - last >= REFUSAL_LOG_S:
            more = f" ({since} more like it since, not logged)" if since else ""
            log.log(level, "%s%s", text, more)
            self._refusals[(host, text)] = (now, 0)
        else:
            self._refusals[(host, text)] = (last, since + 1)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = "%s:%s" % (writer.get_extra_info("peername") or ("?", "?"))[:2]
        try:
            conn, _ = await server_handshake(reader, writer, self.config.token, self.config.handshake_timeout,
                                             self.config.max_frame)
        except (AuthError, ProtocolError) as e:
            self._refused(writer, str(e))
            return
        except _GONE as e:
            self._refused(writer, f"the handshake did not complete ({type(e).__name__})")
            return
        first = None
        try:
            first = await conn.recv()
            if isinstance(first, Upstream):
                await self._serve_upstream(conn, first)
            elif isinstance(first, ResultsLink):
                await self._serve_results(conn, first)
            else:
                await self._serve_head(conn, first)
        except ProtocolError as e:
            self.rejected += 1
            log.warning("closing the connection from %s: %s", peer, e)
        except _GONE:
            # a ring link's end is a fault (said by _fault); the head's leaving is said, unless this worker's own
            # head started it (it stops the worker next) or this worker stops
            head = first is not None and not isinstance(first, (Upstream, ResultsLink))
            quiet = self._closing or self.config.local or not head
            log.log(logging.DEBUG if quiet else logging.INFO, "the connection from %s closed", peer)
        finally:
            conn.close()

    async def _serve_head(self, conn: Connection, first) -> None:
        if self.head is not None:
            quiet = time.monotonic() - self._head_heard
            if quiet < HEAD_QUIET:
                self._warn_limited(str(conn.peer).rsplit(":", 1)[0],
                                   f"refused a second head from {conn.peer}: serving the head at {self._head_peer}")
                await conn.send(Failure(f"this worker serves another head (at {self._head_peer}, heard from "
                                        f"{quiet:.1f}s ago); stop that head first, or give this one other workers"))
                return
            log.info("a new head connected from %s; dropping the previous one (silent for %.0fs)", conn.peer, quiet)
            self.head.close()
        outbox = self.head = Outbox(conn, self.path.count)
        self._head_peer, self._head_heard = conn.peer, time.monotonic()
        control: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(self._control_loop(outbox, control))

        def handle(msg) -> None:  # in the connection's data callback, as each frame arrives
            if self.head is outbox:
                self._head_heard = time.monotonic()
            if isinstance(msg, Ping):
                outbox.put(Pong(msg.nonce))
            elif isinstance(msg, Step):
                self.path.step_arrived(msg)  # stage 0's data comes from the head
            elif isinstance(msg, (Probe, LoadStage, Configure, StatsRequest, FileChunk, FileEnd)):
                control.put_nowait(msg)
            else:
                raise ProtocolError(f"unexpected {msg.WIRE_NAME} from the head")

        try:
            handle(first)
            await conn.serve(handle)
        finally:
            task.cancel()
            outbox.close()
            if self.head is outbox:
                self.head = None

    async def _serve_upstream(self, conn: Connection, first: Upstream) -> None:
        if self.upstream is not None:
            self.upstream.close()
        self.upstream = conn

        def handle(msg) -> None:  # in the connection's data callback, as each frame arrives
            if isinstance(msg, Step):
                self.path.step_arrived(msg)
            elif isinstance(msg, Sampled):
                self.path.sampled_arrived(msg)
            elif isinstance(msg, DeviceLane):
                self.path.lane_offered(msg)
            else:
                raise ProtocolError(f"unexpected {msg.WIRE_NAME} on a stage-to-stage connection")

        try:
            await conn.serve(handle)
        except _GONE:
            if self.upstream is conn:
                self._fault(first.epoch, f"the connection from stage {first.stage_index} was lost")
            raise

    async def _serve_results(self, conn: Connection, first: ResultsLink) -> None:
        """The head's result connection for this epoch: confirmed once the StepResults go there."""
        path = self.path
        if first.epoch != path.epoch or path.downstream is not None:
            raise ProtocolError(f"a result link for epoch {first.epoch}, but this worker is "
                                f"{'not the last stage' if path.downstream is not None else f'in epoch {path.epoch}'}")
        path.drop_results()
        link = path.results = Link(conn, Outbox(conn, path.count), first.epoch)
        link.outbox.put(Configured(first.epoch))
        try:
            msg = await conn.recv()  # the head sends nothing more on it
            raise ProtocolError(f"unexpected {msg.WIRE_NAME} on the result connection")
        finally:
            if path.results is link:
                path.results = None

    # ------------------------------------------------------------------ control
    async def _control_loop(self, outbox: Outbox, inbox: asyncio.Queue) -> None:
        while True:
            msg = await inbox.get()
            try:
                reply = await self._control(msg, outbox, inbox)
            except FlotillaError as e:
                reply = Failure(str(e))
            except Exception as e:  # noqa: BLE001 - reported to the head, logged here
                log.exception("%s failed", msg.WIRE_NAME)
                reply = Failure(f"{msg.WIRE_NAME} failed on the worker: {type(e).__name__}: {e}")
            outbox.put(reply)

    async def _control(self, msg, outbox: Outbox, inbox: asyncio.Queue):
        if isinstance(msg, Probe):
            return await asyncio.to_thread(on_device, self.config.device, worker_info, msg, self.config.device,
                                           version(), self.config.tp)
        if isinstance(msg, LoadStage):
            return await self._load(msg, outbox, inbox)
        if isinstance(msg, Configure):
            return await self._configure(msg)
        if isinstance(msg, StatsRequest):
            path = self.path
            c = path.counters
            t = self.runtime.times if self.runtime is not None else StageTimes()
            stats = WorkerStats(c.steps, c.tokens, c.decode_steps, c.decode_tokens, c.decode_bytes, c.bytes_sent,
                                self.shard_bytes_received, c.compute_seconds, t.prepare, t.execute, t.output,
                                c.send_seconds, path.gate.parked_steps, *path.lane_counts())
            if msg.reset:
                path.reset_lane_counts()
                path.counters = Counters()
                path.gate.parked_steps = 0
                if self.runtime is not None:
                    self.runtime.times = StageTimes()
            return stats
        raise FlotillaError(f"unexpected {msg.WIRE_NAME}: no weight push is in progress")

    async def _load(self, req: LoadStage, outbox: Outbox, inbox: asyncio.Queue) -> StageLoaded:
        if self.runtime is not None and self.runtime.serves(req):
            if not req.exact_blocks:  # a new head sizes the pool afresh, from all the free memory
                self.path.epoch = -1
                await asyncio.to_thread(on_device, self.config.device, self.path.locked, self.runtime.drop_pool)
            return StageLoaded(self.runtime.capacity(req), f"already loaded, {self.runtime.source}", 0)
        self.path.epoch = -1  # drop whatever steps are still queued for the old stage
        received, directory = 0, None
        if self.config.model is not None and await asyncio.to_thread(self._model_fingerprint) == req.fingerprint:
            directory, source = self.config.model, f"from its --model {self.config.model}"
        else:
            if self.config.model is not None:
                self._warn_limited("head", f"its --model {self.config.model} is another model than the head's; the "
                                           f"stage comes from the cache or the head instead", logging.INFO)
            directory, missing = await asyncio.to_thread(self.cache.prepare, req, self.config.model)
            if missing:
                outbox.put(NeedFiles(missing))
                received = await self._receive(directory, req, missing, inbox)
                source = f"pushed by the head ({received / 2**20:.1f} MiB)"
            else:
                source = f"from its cache {directory}"
        await asyncio.to_thread(self.path.swap, None)  # free the old stage's memory first
        stage = Stage(req.start, req.end, req.num_layers)
        torch.set_num_threads(self._threads)  # a TP group divides them among its ranks at each load
        with lean_cpu_load(self.config.device):  # the `runtime worker` process
            lm = await asyncio.to_thread(on_device, self.config.device, load_model_parallel, directory,
                                         str(self.config.device), req.dtype, self.config.tp, stage, False, False)
        runtime = StageRuntime(lm, req, source)
        capacity = runtime.capacity(req)
        await asyncio.to_thread(self.path.swap, runtime)
        log.info("loaded layers %d-%d, %s; room for %d KV blocks (+1 padding block)", req.start, req.end - 1,
                 source, capacity - 1)
        return StageLoaded(capacity, source, received)

    async def _receive(self, directory: Path, req: LoadStage, names: list[str], inbox: asyncio.Queue) -> int:
        receiver = ShardReceiver(directory, req.shards, names)
        try:
            while not receiver.done:
                msg = await inbox.get()
                if isinstance(msg, FileChunk):
                    await asyncio.to_thread(receiver.chunk, msg)
                elif isinstance(msg, FileEnd):
                    await asyncio.to_thread(receiver.end, msg)
                else:
                    raise FlotillaError(f"unexpected {msg.WIRE_NAME} during a weight push")
        finally:
            receiver.abort()
            self.shard_bytes_received += receiver.received_bytes
        return receiver.received_bytes

    async def _configure(self, msg: Configure) -> Configured:
        if self.runtime is None:
            raise FlotillaError("Configure before LoadStage: this worker has no stage loaded")
        path = self.path
        path.epoch = msg.epoch
        path.stage_index = msg.stage_index
        path.inline_query_len = max(1, msg.graph_query_len)
        await asyncio.to_thread(on_device, self.config.device, path.locked, self.runtime.configure, msg)
        path.drop_downstream()
        path.drop_results()
        path.drop_lanes_before(msg.epoch)
        path.gate.reset()
        if msg.downstream is not None:
            path.downstream = await self._open_link(msg, msg.downstream, "the next stage", "hidden")
        if msg.feedback is not None:
            path.feedback = await self._open_link(msg, msg.feedback, "stage 0", "ids")
        log.info("epoch %d: stage %d, %d KV blocks, next hop %s", msg.epoch, msg.stage_index, msg.num_blocks,
                 msg.downstream or "the head")
        return Configured(msg.epoch)

    async def _open_link(self, msg: Configure, address: str, whom: str, lane: str) -> Link:
        """This epoch's link to the next stage (Steps), or the last stage's to stage 0 (Sampled),
        with the offer of its device lane of kind `lane` where this stage can make one."""
        host, port = parse_address(address)
        try:
            conn = await connect(host, port, self.config.token, f"stage-{msg.stage_index}", self.config.ssl_client,
                                 self.config.handshake_timeout, self.config.max_frame)
        except (AuthError, ProtocolError, *_GONE) as e:
            raise FlotillaError(f"stage {msg.stage_index} cannot reach {whom} at {address}: "
                                f"{type(e).__name__}: {e}") from None
        link = Link(conn, Outbox(conn, self.path.count), msg.epoch)
        link.outbox.put(Upstream(msg.epoch, msg.stage_index))
        offer = self.path.open_lane(lane, msg.epoch)
        if offer is not None:
            link.outbox.put(offer)
        link.watch = asyncio.create_task(self._watch_link(link, whom))
        return link

    async def _watch_link(self, link: Link, whom: str) -> None:
        """The receiver never talks back on a link; its end is a fault of the current epoch."""
        try:
            msg = await link.conn.recv()
            log.warning("unexpected %s from %s; closing the link", msg.WIRE_NAME, whom)
        except (ProtocolError, *_GONE):
            pass
        if link in (self.path.downstream, self.path.feedback):
            self._fault(link.epoch, f"stage {self.path.stage_index} lost its connection to {whom}")
            self.path.drop_downstream()

    def _fault(self, epoch: int, message: str) -> None:
        if self.head is None or self._closing:  # the head left, or this worker stops: the ring is being taken down
            log.debug("%s (no head is running the pipeline)", message)
            return
        log.warning("%s", message)
        if epoch == self.path.epoch:
            self.head.put(Fault(epoch, message))

    def _model_fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.config.model)
        return self._fingerprint

    def address(self) -> str:
        host, port = self._server.sockets[0].getsockname()[:2]
        return format_address(host, port)
