"""Everything the server needs from the engine goes through this module.

`EngineClient` is the server's whole view of the runtime: a tokenizer, the model's name and
context length, `generate()` (an async iterator of `StepOutput`s per request), `abort()`,
`stats()` for /metrics and `problems()` for /health. No other server module imports
`flotilla.runtime`, so reconciling with a changed engine API touches this file only.

Backend today: `SerialBackend`, one sequence at a time over `flotilla.runtime.simple`'s
contiguous KV cache, in a worker thread. It is replaced by the batching `AsyncEngine` when the
engine lands.
"""
from __future__ import annotations

import argparse
import asyncio
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator

import torch

from flotilla.errors import FlotillaError
from flotilla.runtime.cli import add_model_args
from flotilla.runtime.loader import LoadedModel, load_model
from flotilla.runtime.sampling import SamplingParams
from flotilla.runtime.simple import ContiguousKVCache, sample_next

__all__ = ["EngineClient", "EngineStats", "EngineUnavailable", "SamplingParams", "StepOutput", "TokenLogprob",
           "add_engine_args"]


class EngineUnavailable(Exception):
    """The engine cannot serve (its loop died, or it is shut down): a 503, not the user's fault."""


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(frozen=True)
class StepOutput:
    """What one engine step added to one request."""
    token_ids: tuple[int, ...]
    text: str  # the text delta (never splits a UTF-8 character; stop strings cut out)
    finish_reason: str | None = None  # "stop", "length" or "abort" on the last output
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total if self.kv_blocks_total else 0.0


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)


class EngineClient:
    def __init__(self, lm: LoadedModel, backend: "SerialBackend", model_name: str, max_model_len: int):
        self.lm = lm
        self.tokenizer = lm.tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_num_seqs = backend.max_num_seqs
        self._backend = backend

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineClient":
        return cls.load(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                        served_model_name=args.served_model_name)

    @classmethod
    def load(cls, model=None, *, device: str | None = None, dtype: str | None = None,
             max_model_len: int | None = None, served_model_name: str | None = None) -> "EngineClient":
        return cls.from_loaded(load_model(model, device, dtype), max_model_len=max_model_len,
                               served_model_name=served_model_name)

    @classmethod
    def from_loaded(cls, lm: LoadedModel, *, max_model_len: int | None = None,
                    served_model_name: str | None = None) -> "EngineClient":
        """A new engine over an already loaded model (tests start several servers on one model)."""
        if lm.tokenizer is None:
            raise FlotillaError(f"{lm.path}: the server needs the model's tokenizer")
        limit = lm.config.max_model_len
        if max_model_len is not None:
            if not 1 < max_model_len <= limit:
                raise FlotillaError(f"--max-model-len must be in 2..{limit} (the model's context), got {max_model_len}")
            limit = max_model_len
        name = served_model_name or _default_name(lm)
        return cls(lm, SerialBackend(lm, limit), name, limit)

    async def start(self) -> None:
        self._backend.start(asyncio.get_running_loop())

    async def shutdown(self) -> None:
        await asyncio.to_thread(self._backend.stop)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[StepOutput]:
        """Stream one request's outputs; the last one carries a finish_reason. Leaving early aborts it."""
        outputs: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._backend.submit(request_id, prompt_ids, params, outputs)
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finish_reason is not None
                yield out
        finally:
            if not finished:
                self._backend.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Cancel a request. A no-op for a finished request."""
        self._backend.abort(request_id)

    async def abort_all(self) -> None:
        self._backend.abort_all()

    def stats(self) -> EngineStats:
        return self._backend.stats()

    def problems(self) -> list[str]:
        return self._backend.problems()

    def num_requests(self) -> int:
        s = self.stats()
        return s.num_running + s.num_waiting


def _default_name(lm: LoadedModel) -> str:
    from flotilla.runtime.default_model import DEFAULT_MODEL_NAME, default_model_path

    try:
        if lm.path.resolve() == default_model_path(fetch=False).resolve():
            return DEFAULT_MODEL_NAME
    except FlotillaError:
        pass
    return lm.path.stem if lm.path.is_file() else lm.path.name


# ----------------------------------------------------------------------------- serial backend

@dataclass
class _Job:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    outputs: asyncio.Queue


class SerialBackend:
    """One sequence at a time in a worker thread, over a contiguous KV cache."""

    max_num_seqs = 1

    def __init__(self, lm: LoadedModel, max_model_len: int):
        self.lm = lm
        self.max_model_len = max_model_len
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting: dict[str, _Job] = {}
        self._aborted: set[str] = set()
        self._running: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: str | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._work, name="flotilla-serial-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.abort_all()
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join()

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, outputs: asyncio.Queue) -> None:
        job = _Job(request_id, list(prompt_ids), params, outputs)
        with self._lock:
            self._waiting[request_id] = job
        self._jobs.put(job)

    def abort(self, request_id: str) -> None:
        with self._lock:
            job = self._waiting.pop(request_id, None)
            if self._running == request_id:
                self._aborted.add(request_id)
        if job is not None:
            self._emit(job, StepOutput((), "", "abort"))

    def abort_all(self) -> None:
        with self._lock:
            ids = list(self._waiting) + ([self._running] if self._running else [])
        for rid in ids:
            self.abort(rid)

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(int(self._running is not None), len(self._waiting), 0, 0)

    def problems(self) -> list[str]:
        problems = []
        if self._thread is not None and not self._thread.is_alive():
            problems.append("the engine thread has stopped" + (f": {self._error}" if self._error else ""))
        return problems

    def _emit(self, job: _Job, out: StepOutput) -> None:
        self._loop.call_soon_threadsafe(job.outputs.put_nowait, out)

    def _work(self) -> None:
        torch.set_num_threads(torch.get_num_threads())
        while (job := self._jobs.get()) is not None:
            with self._lock:
                if self._waiting.pop(job.request_id, None) is None:
                    continue  # aborted while waiting
                self._running = job.request_id
            try:
                self._run(job)
            except Exception as e:  # an engine bug: end this request, keep serving the others
                self._error = f"{type(e).__name__}: {e}"
                self._emit(job, StepOutput((), "", "abort"))
            finally:
                with self._lock:
                    self._running = None
                    self._aborted.discard(job.request_id)

    @torch.inference_mode()
    def _run(self, job: _Job) -> None:
        model, tok, params = self.lm.model, self.lm.tokenizer, job.params
        device = self.lm.device
        max_len = min(self.max_model_len, len(job.prompt_ids) + params.max_tokens)
        cache = ContiguousKVCache(model, max_len)
        generator = torch.Generator(device=device).manual_seed(params.seed) if params.seed is not None else None
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tok.eos_token_ids))
        detok = tok.detokenizer(job.prompt_ids)
        stops = StopStrings(params.stop)
        tokens = torch.tensor(job.prompt_ids, device=device)
        budget = max_len - len(job.prompt_ids)
        for i in range(budget):
            if job.request_id in self._aborted:
                self._emit(job, StepOutput((), "", "abort"))
                return
            positions = torch.arange(cache.length, cache.length + tokens.shape[0], device=device)
            cache.begin(tokens.shape[0])
            hidden = model(tokens, positions, cache)
            cache.end()
            logits = model.compute_logits(hidden[-1:])[0].float()
            next_id = sample_next(logits, params, generator)
            logprobs = (_logprob(logits, next_id, params.top_logprobs),) if params.logprobs else ()
            if next_id in stop_ids:
                tail = stops.feed(detok.flush())[0] + stops.flush()
                self._emit(job, StepOutput((next_id,), tail, "stop", logprobs))
                return
            text, stopped = stops.feed(detok.add(next_id))
            last = i == budget - 1
            if stopped:
                self._emit(job, StepOutput((next_id,), text, "stop", logprobs))
                return
            if last:
                text += stops.feed(detok.flush())[0] + stops.flush()
            self._emit(job, StepOutput((next_id,), text, "length" if last else None, logprobs))
            tokens = torch.tensor([next_id], device=device)


def _logprob(logits: torch.Tensor, token_id: int, top: int) -> TokenLogprob:
    lp = torch.log_softmax(logits, dim=-1)
    best = torch.topk(lp, top) if top else None
    pairs = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
    return TokenLogprob(token_id, float(lp[token_id]), pairs)


class StopStrings:
    """Cuts generated text at the first stop string; holds back a tail that could start one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        if not self.stops or self.stopped:
            return ("" if self.stopped else delta), self.stopped
        self.pending += delta
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            text, self.pending = self.pending[:cut], ""
            return text, True
        keep = len(self.pending) - self.hold
        text, self.pending = (self.pending[:keep], self.pending[keep:]) if keep > 0 else ("", self.pending)
        return text, False

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text
