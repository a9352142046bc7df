"""One API request in the engine: its choices submitted, their outputs merged, usage and latency
recorded, and whatever is unfinished aborted when the consumer stops (client gone, cancel)."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from .engine_client import EngineClient, StepOutput
from .metrics import ServerMetrics
from .protocol import GenerationRequest

log = logging.getLogger("flotilla.server")
MAX_IGNORED_NAMED = 8  # ignored fields named in the log line
_ignored_logged: set[tuple[str, ...]] = set()  # the sets of ignored fields said so far (at most 100)


def log_ignored(req: GenerationRequest, rid: str) -> None:
    """Name a request's fields this server does not use (a misspelt max_token, another server's option) in the
    log, once per set of names (the last 100 sets remembered), as vLLM says them: the request still runs."""
    if not req.ignored or req.ignored in _ignored_logged:
        return
    if len(_ignored_logged) >= 100:
        _ignored_logged.clear()
    _ignored_logged.add(req.ignored)
    names = ", ".join(repr(k[:40]) for k in req.ignored[:MAX_IGNORED_NAMED])
    more = f" and {len(req.ignored) - MAX_IGNORED_NAMED} more" if len(req.ignored) > MAX_IGNORED_NAMED else ""
    log.warning("%s: fields ignored (not used by this server; said once): %s%s", rid, names, more)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


@dataclass
class Choice:
    index: int
    prompt_tokens: int
    completion_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # completions' text_offset per token
    prompt_logprobs: tuple | None = None  # the engine's, from the choice's first output (when asked for)
    echoed: int | None = None  # echo: the prompt text's length, once it went out (a stream's first chunk)
    reasoning: object = None  # a stream's ReasoningSplitter (serve --reasoning-parser)
    last_time: float | None = None
    first_time: float | None = None  # its first token's
    queue_time: float | None = None  # the engine's, once it said


class Generation:
    def __init__(self, engine: EngineClient, metrics: ServerMetrics, request: GenerationRequest,
                 request_id: str, arrival: float | None = None):
        self.engine = engine
        self.metrics = metrics
        self.request = request
        self.request_id = request_id
        self.arrival = arrival if arrival is not None else time.perf_counter()
        self.choices = {i: Choice(i, len(p)) for i, p, _ in request.choices()}
        self._streams: list = []
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        metrics.prompt_tokens.inc(self.prompt_tokens)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.request.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices.values())

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    async def __aenter__(self) -> "Generation":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def outputs(self) -> AsyncIterator[tuple[Choice, StepOutput]]:
        jobs = self.request.choices()
        if len(jobs) == 1:  # the common case: no task, no queue
            index, prompt, params = jobs[0]
            stream = self.engine.generate(self.request_id, list(prompt), params)
            self._streams.append(stream)
            async for out in stream:
                yield self._record(self.choices[index], out), out
            return
        merged: asyncio.Queue = asyncio.Queue()
        for index, prompt, params in jobs:
            self._tasks.append(asyncio.create_task(self._pump(index, prompt, params, merged)))
        pending = len(jobs)
        while pending:
            item = await merged.get()
            if isinstance(item, BaseException):
                raise item
            index, out = item
            pending -= out.finish_reason is not None
            yield self._record(self.choices[index], out), out

    async def _pump(self, index: int, prompt, params, merged: asyncio.Queue) -> None:
        try:
            async for out in self.engine.generate(f"{self.request_id}-{index}", list(prompt), params):
                merged.put_nowait((index, out))
        except Exception as e:  # surfaced to the consumer
            merged.put_nowait(e)

    def _record(self, choice: Choice, out: StepOutput) -> Choice:
        now = time.perf_counter()
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = out.prompt_logprobs
        if choice.queue_time is None and out.queue_time is not None:
            choice.queue_time = out.queue_time
            self.metrics.queue_time.observe(out.queue_time)
        k = len(out.token_ids)
        if k:
            if choice.last_time is None:
                choice.first_time = now
                self.metrics.ttft.observe(now - self.arrival)
                if k > 1:
                    self.metrics.itl.observe(0.0, k - 1)
            else:
                self.metrics.itl.observe((now - choice.last_time) / k, k)
            choice.last_time = now
            choice.completion_tokens += k
            self.metrics.generation_tokens.inc(k)
        if out.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason
            self.metrics.e2e.observe(now - self.arrival)
            self.metrics.finished.inc(1, out.finish_reason)
            self.metrics.request_prompt.observe(choice.prompt_tokens)
            self.metrics.request_generation.observe(choice.completion_tokens)
            if choice.first_time is not None and choice.queue_time is not None:
                # the phases as vLLM's: admitted -> first token (prefill), first -> last token (decode)
                self.metrics.prefill_time.observe(max(0.0, choice.first_time - self.arrival - choice.queue_time))
                self.metrics.decode_time.observe(now - choice.first_time)
                self.metrics.inference_time.observe(max(0.0, now - self.arrival - choice.queue_time))
        return choice

    def engine_ids(self) -> list[str]:
        jobs = self.request.choices()
        return [self.request_id] if len(jobs) == 1 else [f"{self.request_id}-{i}" for i, _, _ in jobs]

    async def abort(self) -> None:
        """Stop generating now; returns once the KV blocks are free. The outputs end with "abort"."""
        for rid in self.engine_ids():
            await self.engine.abort(rid)  # a no-op for a finished request

    async def close(self) -> None:
        """Abort whatever has not finished; safe to call twice."""
        if not self._closed:  # a dropped client's choices, or an n > 1 request's after one choice failed
            self._closed = True
            self.metrics.finished.inc(sum(c.finish_reason is None for c in self.choices.values()), "abort")
        for stream in self._streams:
            await stream.aclose()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._streams, self._tasks = [], []
