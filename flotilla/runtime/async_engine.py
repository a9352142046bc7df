"""AsyncEngine: the LLMEngine for asyncio, with one async stream per request and cancellation.

The engine loop runs on its own thread, so the event loop stays responsive while a step
computes. The two talk through an inbox (new requests, aborts) that the engine thread drains
between steps, and `call_soon_threadsafe` for outputs:

    engine = AsyncEngine(llm_engine)
    stream = engine.add_request("req-1", prompt_ids, SamplingParams(max_tokens=64))
    async for out in stream:          # RequestOutput: new_token_ids, text (a delta), finish_reason
        ...
    await engine.abort("req-1")       # returns once the request's KV blocks are back in the pool

Leaving a stream early (`break` inside `async with stream`, `await stream.aclose()`, or the
consuming task being cancelled) aborts its request.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass

import torch

from flotilla.errors import FlotillaError

from .engine import EngineStats, LLMEngine
from .loader import with_index
from .output import RequestOutput
from .sampling import SamplingParams

log = logging.getLogger("flotilla.runtime")
_ids = itertools.count()


class EngineDeadError(FlotillaError):
    """The engine loop failed; no request can be served any more."""


class RequestFailed(FlotillaError):
    """The engine had to end this request (its output's `error` says why); the engine lives on."""


@dataclass
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams


@dataclass
class _Abort:
    request_id: str
    done: asyncio.Future | None
    loop: asyncio.AbstractEventLoop | None


class RequestStream:
    """An async iterator of one request's outputs; ends after the output with finished=True."""

    def __init__(self, request_id: str, engine: "AsyncEngine", loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def _push(self, item) -> None:  # on the event loop
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self._abort_soon()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    async def aclose(self) -> None:
        """Stop listening; aborts the request if it has not finished."""
        if not self.finished:
            self.finished = True
            await self._engine.abort(self.request_id)

    def _abort_soon(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine._submit(_Abort(self.request_id, None, None))

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: deque = deque()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._stats: EngineStats = engine.stats()
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="flotilla-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the asyncio side
    def add_request(self, request_id: str | None, prompt: list[int] | str,
                    params: SamplingParams | None = None) -> RequestStream:
        """Queue a request; returns its stream. Raises FlotillaError at once for a request that
        can never be served (empty or too long prompt, bad token ids, a duplicate id)."""
        self._check_alive()
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise FlotillaError("a text prompt needs a tokenizer; pass token ids")
            prompt = self.engine.tokenizer.encode(prompt)
        request_id = request_id or f"req-{next(_ids)}"
        if request_id in self._streams:
            raise FlotillaError(f"request id {request_id!r} is already in use")
        self.engine.validate(prompt, params)
        stream = RequestStream(request_id, self, asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._submit(_Add(request_id, list(prompt), params))
        return stream

    async def abort(self, request_id: str) -> None:
        """Cancel a request; returns once its blocks are free (within one engine step)."""
        if self._error is not None or not self._thread.is_alive():
            return
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._submit(_Abort(request_id, done, loop))
        await done

    def stats(self) -> EngineStats:
        """The latest snapshot (updated by the engine thread after every step)."""
        return self._stats

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None

    async def shutdown(self) -> None:
        """Abort everything and stop the engine thread."""
        for rid in list(self._streams):
            await self.abort(rid)
        self._stop = True
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # ------------------------------------------------------------------ the engine thread
    def _submit(self, item) -> None:
        self._inbox.append(item)
        self._wake.set()

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._error!r}")
        if self._stop:
            raise EngineDeadError("the engine is shut down")

    def _run(self) -> None:
        try:
            device = getattr(self.engine.executor, "device", None)
            if isinstance(device, torch.device) and device.type == "cuda":
                torch.cuda.set_device(with_index(device))  # per thread: launches go to the model's GPU
            while not self._stop:
                self._wake.clear()
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._wake.wait()
                    continue
                outputs = self.engine.step()
                self._stats = self.engine.stats()
                self._deliver(outputs)
        except BaseException as e:  # the loop must not die silently: every stream hears of it
            if isinstance(e, FlotillaError):  # a failure that says what it is (a tensor-parallel rank died)
                log.error("engine loop failed: %s", e)
                log.debug("engine loop failed", exc_info=e)
            else:
                log.exception("engine loop failed")
            self._error = e
            self._fail_all(e)

    def _drain_inbox(self) -> None:
        if not self._inbox:
            return
        resolved = []
        while self._inbox:
            item = self._inbox.popleft()
            if isinstance(item, _Add):
                try:
                    self.engine.add_request(item.request_id, item.prompt, item.params)
                except FlotillaError as e:
                    self._deliver_to(item.request_id, e)
            else:
                out = self.engine.abort(item.request_id)
                stream = self._streams.pop(item.request_id, None)
                if stream is not None and out is not None:
                    stream._loop.call_soon_threadsafe(stream._push, out)
                if item.done is not None:
                    resolved.append(item)
        self._stats = self.engine.stats()  # before the aborts' callers resume
        for item in resolved:
            item.loop.call_soon_threadsafe(_resolve, item.done)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            item = RequestFailed(out.error) if out.error is not None else out
            by_loop.setdefault(stream._loop, []).append((stream, item))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_push_all, items)

    def _deliver_to(self, request_id: str, item) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream._loop.call_soon_threadsafe(stream._push, item)

    def _fail_all(self, error: BaseException) -> None:
        dead = EngineDeadError(f"the engine stopped after an error: {error!r}")
        for rid in list(self._streams):
            self._deliver_to(rid, dead)
        while self._inbox:
            item = self._inbox.popleft()
            if isinstance(item, _Abort) and item.done is not None:
                item.loop.call_soon_threadsafe(_resolve, item.done)


def _push_all(items) -> None:
    for stream, out in items:
        stream._push(out)


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
