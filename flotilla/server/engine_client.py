"""Everything the server needs from the engine goes through this module.

`EngineClient` is the server's whole view of the runtime: a tokenizer, the model's name and
context length, `generate()` (an async iterator of `StepOutput`s per request), `abort()`,
`stats()` for /metrics and `problems()` for /health. No other server module imports
`flotilla.runtime`, so reconciling with a changed engine API touches this file only.

The engine is `flotilla.runtime.AsyncEngine` (continuous batching over a paged KV cache) built
from the same `EngineArgs` as `runtime generate` and `runtime chat`: over the model in this
process, or with `--pp N` over a pipeline of worker processes or machines (the head loads no
weights; a lost stage shows in `problems()`, and requests it cannot finish end with an error).
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import AsyncIterator

from flotilla.errors import FlotillaError
from flotilla.progress import say_line
from flotilla.runtime.async_engine import AsyncEngine, EngineDeadError, RequestFailed
from flotilla.runtime.cli import add_chat_template_arg, add_model_args, chat_template_arg, load_with_progress, \
    use_chat_template
from flotilla.runtime.engine import LLMEngine
from flotilla.runtime.engine_args import EngineArgs, build_engine
from flotilla.runtime.loader import LoadedModel
from flotilla.runtime.pipeline.cli import add_pipeline_args, is_pipeline, pipeline_engine_from_args
from flotilla.runtime.output import RequestOutput
from flotilla.runtime.sampling import SamplingParams
from flotilla.runtime.tp import add_tp_args

__all__ = ["EngineClient", "EngineStats", "EngineUnavailable", "SamplingParams", "StageState", "StepOutput",
           "TokenLogprob", "add_engine_args"]


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
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (vLLM's field)
    text_offsets: tuple[int, ...] = ()  # per token: where the text it completed starts in the output
    # on the first output, when asked for: per prompt position, None at 0, then (logprob, rank, top) of its token
    prompt_logprobs: tuple | None = None
    queue_time: float | None = None  # seconds it waited in the engine before its first admission


@dataclass(frozen=True)
class StageState:
    """One pipeline stage (serve --pp), for /metrics."""
    index: int
    host: str  # its worker's address, host:port
    device: str  # e.g. cuda:0 or cpu, as the worker said ("" before it did)
    up: bool


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    spec_draft_tokens: int = 0  # speculative decoding: draft tokens verified since the start
    spec_accepted_tokens: int = 0  # of those, accepted
    spec_verify_steps: int = 0  # sequence-steps that verified drafts
    preemptions: int = 0  # sequences preempted since the start
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache at admissions
    prefix_cache_hits: int = 0  # of those, found
    stages: tuple[StageState, ...] = ()  # a pipeline's stages; empty in one process

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_accepted_tokens_per_step(self) -> float:
        return self.spec_accepted_tokens / self.spec_verify_steps if self.spec_verify_steps else 0.0


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_chat_template_arg(p)
    add_tp_args(p)
    EngineArgs.add_args(p)  # includes --max-model-len
    add_pipeline_args(p)


def _convert(out: RequestOutput) -> StepOutput:
    logprobs = ()
    if out.logprobs is not None:
        tops = out.top_logprobs or [[] for _ in out.logprobs]
        logprobs = tuple(TokenLogprob(t, lp, tuple(top)) for t, lp, top in zip(out.new_token_ids, out.logprobs, tops))
    return StepOutput(tuple(out.new_token_ids), out.text, out.finish_reason if out.finished else None, logprobs,
                      out.stop_reason if out.finished else None, tuple(out.text_offsets or ()),
                      tuple(out.prompt_logprobs) if out.prompt_logprobs is not None else None, out.queue_time)


class EngineClient:
    def __init__(self, llm: LLMEngine, model_name: str, parallel=None):
        if llm.tokenizer is None:
            raise FlotillaError(f"{model_name}: the server needs the model's tokenizer")
        self.tokenizer = llm.tokenizer
        self.model_name = model_name
        self._llm = llm
        self._parallel = parallel  # a TensorParallel group to close with the engine
        self.max_model_len = self._llm.config.context_len
        self.max_num_seqs = self._llm.config.scheduler.max_num_seqs
        # whether the engine's executor computes prompt logprobs (every one here does): protocol's check
        self.computes_prompt_logprobs = getattr(llm.executor, "computes_prompt_logprobs", False)
        self._engine: AsyncEngine | None = None
        self._active: set[str] = set()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineClient":
        engine_args = EngineArgs.from_args(args)  # checks the engine flags before the model loads
        template = chat_template_arg(args)
        if is_pipeline(args):  # with --tp M, every local stage is a group of M processes
            from flotilla.runtime.default_model import resolve_model_path

            llm = pipeline_engine_from_args(args, say_line)
            use_chat_template(llm.tokenizer, template)
            return cls(llm, args.served_model_name or _default_name(resolve_model_path(args.model)))
        lm = load_with_progress(args, lambda line: print(f"flotilla: {line}", flush=True))  # stdout: the log
        llm = build_engine(lm, engine_args, report=say_line)
        use_chat_template(llm.tokenizer, template)
        return cls(llm, args.served_model_name or _default_name(lm.path), parallel=lm.parallel)

    @classmethod
    def from_loaded(cls, lm: LoadedModel, *, served_model_name: str | None = None, **engine_args) -> "EngineClient":
        """A new engine over an already loaded model (tests start several servers on one model).
        `engine_args`: EngineArgs fields, e.g. max_num_seqs=4, kv_cache_memory="64MiB"."""
        known = {f.name for f in fields(EngineArgs)}
        unknown = set(engine_args) - known
        if unknown:
            raise TypeError(f"unknown engine options {sorted(unknown)}; valid: {sorted(known)}")
        if lm.tokenizer is None:
            raise FlotillaError(f"{lm.path}: the server needs the model's tokenizer")
        return cls(build_engine(lm, EngineArgs(**engine_args)), served_model_name or _default_name(lm.path),
                   parallel=lm.parallel)

    async def start(self) -> None:
        self._engine = AsyncEngine(self._llm)

    async def shutdown(self) -> None:
        if self._engine is not None:
            await self._engine.shutdown()
        close = getattr(self._llm, "close", None)  # a pipeline: its connections and local workers
        if close is not None:
            close()
        if self._parallel is not None:  # the other tensor-parallel ranks
            self._parallel.close()

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[StepOutput]:
        """Stream one request's outputs; the last one carries a finish_reason. Leaving early aborts
        it. An "abort" output comes only once the request's KV blocks are back in the pool."""
        try:
            stream = self._engine.add_request(request_id, list(prompt_ids), params)
        except EngineDeadError as e:
            raise EngineUnavailable(self._why_dead(e)) from None
        self._active.add(request_id)
        finished = False
        try:
            async for out in stream:
                step = _convert(out)
                finished = step.finish_reason is not None
                if step.finish_reason == "abort":
                    await self._engine.abort(request_id)  # settles: stats() shows the blocks free
                yield step
        except (EngineDeadError, RequestFailed) as e:
            finished = True
            raise EngineUnavailable(self._why_dead(e) if isinstance(e, EngineDeadError) else str(e)) from None
        finally:
            self._active.discard(request_id)
            if not finished:
                await stream.aclose()

    async def abort(self, request_id: str) -> None:
        """Cancel a request; returns once its blocks are free. A no-op for a finished request."""
        if self._engine is not None:
            await self._engine.abort(request_id)

    async def abort_all(self) -> None:
        for rid in list(self._active):
            await self.abort(rid)

    def stats(self) -> EngineStats:
        s = self._engine.stats() if self._engine is not None else self._llm.stats()
        stage_status = getattr(getattr(self._llm, "executor", None), "stage_status", None)  # a pipeline's
        stages = tuple(StageState(*st) for st in stage_status()) if stage_status is not None else ()
        return EngineStats(s.num_running, s.num_waiting, s.num_total_blocks, s.num_free_blocks,
                           s.spec_draft_tokens_total, s.spec_accepted_tokens_total, s.spec_verify_steps_total,
                           s.preemptions_total, s.cache_queried_tokens_total, s.cached_tokens_total, stages)

    def fatal(self) -> list[str]:
        """What keeps this engine from ever serving again (its loop stopped, a tensor-parallel rank died, a
        pipeline's local worker left down); empty while it can (a pipeline stage that is down may come back:
        problems() names it)."""
        out = []
        if self._engine is not None and not self._engine.is_running:
            out.append("the engine loop has stopped (the server log has the error)")
        if self._parallel is not None:
            out += self._parallel.dead_ranks()
        pipeline_fatal = getattr(self._llm, "fatal", None)
        if pipeline_fatal is not None:
            out += pipeline_fatal()
        return out

    def _why_dead(self, e: EngineDeadError) -> str:
        """What a client is told when the engine loop has stopped: in plain words where it is known (a
        tensor-parallel rank died; not the collective's error text)."""
        dead = self._parallel.dead_ranks() if self._parallel is not None else []
        if not dead:
            return str(e)
        return (f"a tensor-parallel rank of this server died ({'; '.join(dead)}); the server cannot answer again "
                f"and is shutting down (retry on another replica, or once it is restarted)")

    def problems(self) -> list[str]:
        fatal = [f"{p}; restart the server" for p in self.fatal()]
        if fatal:
            return fatal
        pipeline_problems = getattr(self._llm, "problems", None)  # e.g. a pipeline stage that is down
        return list(pipeline_problems()) if pipeline_problems is not None else []




def _default_name(path: Path) -> str:
    from flotilla.runtime.default_model import DEFAULT_MODEL_NAME, default_model_path

    try:
        if path.resolve() == default_model_path(fetch=False).resolve():
            return DEFAULT_MODEL_NAME
    except FlotillaError:
        pass
    path = Path(os.path.abspath(path))  # `serve .` is named after the directory, not ""; a link keeps its name
    return path.stem if path.is_file() else path.name
