"""POST /v1/chat/completions, POST /v1/completions, GET /v1/models — OpenAI's wire format."""
from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from .engine_client import EngineUnavailable
from .errors import ApiError
from .generation import Generation, log_ignored, new_request_id
from .protocol import GenerationRequest, parse_chat, parse_completion
from .reasoning import ReasoningSplitter, prompt_end, split_reasoning
from .responses import (EchoedPrompt, Shapes, TokenText, chat_logprobs, completion_logprobs, join_logprobs,
                        vllm_prompt_logprobs)
from .sse import EventStream
from .state import ServerState

log = logging.getLogger("flotilla.server")

LARGE_BODY = 32 * 1024  # bytes; larger requests are validated and tokenized off the event loop
CANCELLED = "the request was cancelled because the server is shutting down; retry it"


class OpenAIRoutes:
    def __init__(self, state: ServerState):
        self.state = state
        self.token_text = TokenText(state.engine.tokenizer)

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)

    # ----------------------------------------------------------------------------- models
    def _model_card(self) -> dict:
        engine = self.state.engine
        return {"id": engine.model_name, "object": "model", "created": self.state.started, "owned_by": "flotilla",
                "max_model_len": engine.max_model_len}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.state.engine.model_name:
            raise ApiError(404, f"the model '{name[:100]}' does not exist here; this server serves "
                                f"'{self.state.engine.model_name}'", param="model", code="model_not_found")
        return web.json_response(self._model_card())

    # ------------------------------------------------------------------------ generation
    async def chat(self, request: web.Request) -> web.StreamResponse:
        arrival = time.perf_counter()
        self.state.admission.check_open()
        req = await self._parse(request, parse_chat)
        return await self._serve(request, req, new_request_id("chatcmpl"), arrival)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.perf_counter()
        self.state.admission.check_open()
        req = await self._parse(request, parse_completion)
        return await self._serve(request, req, new_request_id("cmpl"), arrival)

    async def _parse(self, request: web.Request, parse) -> GenerationRequest:
        body = await self.state.read_json(request)
        self.state.admission.check_fits(_sequences_asked(body))  # before tokenizing prompts that could never run
        args = (body, self.state.engine, self.state.config.max_n)
        if (request.content_length or 0) > LARGE_BODY:  # tokenizing it would stall every other stream
            return await asyncio.to_thread(parse, *args)
        return parse(*args)

    async def _serve(self, request: web.Request, req: GenerationRequest, rid: str, arrival: float):
        log_ignored(req, rid)
        shapes = Shapes(req.kind, rid, req.model)
        with self.state.admission.admit(req.num_choices):
            async with Generation(self.state.engine, self.state.metrics, req, rid, arrival) as gen:
                if req.stream:
                    return await self._stream(request, req, gen, shapes)
                return await self._collect(req, gen, shapes)

    def _logprobs(self, req: GenerationRequest, items, offsets: list[int]) -> dict | None:
        if not req.params[0].logprobs:
            return None
        if req.kind == "chat":
            return chat_logprobs(self.token_text, items)
        return completion_logprobs(self.token_text, items, offsets)

    def _echo(self, req: GenerationRequest, index: int) -> EchoedPrompt:
        p = index // req.n
        return EchoedPrompt(self.token_text, self.state.engine.tokenizer, req.prompts[p],
                            req.prompt_texts[p] if req.prompt_texts else None)

    def _echoed(self, req: GenerationRequest, choice, text: str, logprobs: dict | None) -> tuple[str, dict | None]:
        """A completions choice's text and logprobs (from its first output on) with its prompt before them;
        sets choice.echoed to the prompt text's length (the shift of the later offsets)."""
        echo = self._echo(req, choice.index)
        if logprobs is not None:
            logprobs = join_logprobs(echo.logprobs(choice.prompt_logprobs, req.params[0].top_logprobs), logprobs,
                                     len(echo.text))
        choice.echoed = len(echo.text)
        return echo.text + text, logprobs

    def _prompt_logprobs(self, req: GenerationRequest, choice) -> list | None:
        """vLLM's prompt_logprobs of a choice's prompt, when the request asked for them."""
        if req.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self.token_text, req.prompts[choice.index // req.n], choice.prompt_logprobs,
                                    req.prompt_logprobs)

    async def _collect(self, req: GenerationRequest, gen: Generation, shapes: Shapes) -> web.Response:
        async for choice, out in gen.outputs():
            if out.finish_reason == "abort":
                raise ApiError(503, CANCELLED, code="cancelled")
            choice.offsets.extend(out.text_offsets[:len(out.logprobs)])
            choice.text.append(out.text)
            choice.logprobs.extend(out.logprobs)
        choices = []
        for c in sorted(gen.choices.values(), key=lambda c: c.index):
            text, logprobs = "".join(c.text), self._logprobs(req, c.logprobs, c.offsets)
            if req.kind == "chat":
                parser = self.state.config.reasoning_parser
                reasoning, content = split_reasoning(parser, text, self._prompt_end(req)) if parser else (False, text)
                choices.append(Shapes.chat_choice(c.index, content if parser else text, c.finish_reason, logprobs,
                                                  c.stop_reason, reasoning))
                continue
            if req.echo:
                text, logprobs = self._echoed(req, c, text, logprobs)
            choices.append(Shapes.completion_choice(c.index, text, c.finish_reason, logprobs, c.stop_reason))
            if req.prompt_logprobs is not None:
                choices[-1]["prompt_logprobs"] = self._prompt_logprobs(req, c)
        if req.kind == "chat":
            body = shapes.chat_response(choices, gen.usage())
            if req.prompt_logprobs is not None:  # vLLM's: one prompt, at the top of a chat response
                body["prompt_logprobs"] = self._prompt_logprobs(req, gen.choices[0])
        else:
            body = shapes.completion_response(choices, gen.usage())
        return web.json_response(body)

    def _prompt_end(self, req: GenerationRequest) -> str:
        return prompt_end(self.state.engine.tokenizer, req.prompts[0])

    def _chat_delta(self, req: GenerationRequest, choice, text: str, last: bool) -> dict:
        """A chat chunk's delta: the text as content, or (serve --reasoning-parser) split into reasoning and
        content, a piece of a tag held back until the next text (or the last output) says what it is."""
        parser = self.state.config.reasoning_parser
        if parser is None:
            return {"content": text}
        if choice.reasoning is None:
            choice.reasoning = ReasoningSplitter(parser, self._prompt_end(req))
        reasoning, content = choice.reasoning.feed(text)
        if last:
            r, c = choice.reasoning.finish()
            reasoning, content = reasoning + r, content + c
        delta = {"reasoning": reasoning, "reasoning_content": reasoning} if reasoning else {}
        if content:
            delta["content"] = content
        return delta

    async def _stream(self, request: web.Request, req: GenerationRequest, gen: Generation, shapes: Shapes):
        stream = EventStream(request)
        await stream.open()
        chat, usage = req.kind == "chat", gen.usage() if req.continuous_usage else req.include_usage
        try:
            if chat:
                await stream.send(*(shapes.chat_chunk(i, {"role": "assistant", "content": ""}, usage=usage)
                                    for i in sorted(gen.choices)))
            async for choice, out in gen.outputs():
                if out.finish_reason == "abort":
                    await stream.send(ApiError(503, CANCELLED, code="cancelled").body())
                    await stream.done()
                    return stream.response
                chunks = []
                echo = req.echo and choice.echoed is None  # the prompt goes out in the choice's first chunk
                if out.text or out.logprobs or echo or (choice.reasoning is not None and out.finish_reason):
                    text, lp = out.text, self._logprobs(req, out.logprobs, list(out.text_offsets[:len(out.logprobs)]))
                    if echo:
                        text, lp = self._echoed(req, choice, text, lp)
                    elif req.echo and lp is not None:  # offsets count from the start of the echoed prompt
                        lp["text_offset"] = [o + choice.echoed for o in lp["text_offset"]]
                    delta = self._chat_delta(req, choice, text, out.finish_reason is not None) if chat else None
                    if req.continuous_usage:
                        usage = gen.usage()  # the tokens so far, in every chunk (vLLM's continuous_usage_stats)
                    if delta or lp or not chat:
                        chunks.append(shapes.chat_chunk(choice.index, delta, None, lp, usage) if chat
                                      else shapes.completion_chunk(choice.index, text, None, lp, usage))
                if out.finish_reason is not None:
                    stop = out.stop_reason
                    usage = gen.usage() if req.continuous_usage else usage
                    chunks.append(shapes.chat_chunk(choice.index, {}, out.finish_reason, usage=usage, stop_reason=stop)
                                  if chat else shapes.completion_chunk(choice.index, "", out.finish_reason, usage=usage,
                                                                       stop_reason=stop))
                if chunks:
                    await stream.send(*chunks)
            if req.include_usage:
                await stream.send(shapes.usage_chunk(gen.usage()))
            await stream.done()
        except ConnectionResetError:
            pass  # the client left; leaving the Generation aborts its sequences
        except EngineUnavailable as e:  # e.g. a pipeline stage that did not come back in time
            await stream.send(ApiError(503, f"the engine cannot serve: {e}", code="engine_unavailable").body())
            await stream.done()
        except Exception:  # a bug past the point where a status code can be sent: end the stream visibly
            log.exception("stream %s failed", shapes.id)
            await stream.send(ApiError(500, "internal server error while streaming (the server log has the "
                                            "traceback)", code="internal_error").body())
            await stream.done()
        return stream.response


def _sequences_asked(body) -> int:
    """The sequences (prompts x n) a request body asks for, as far as its raw JSON tells (parsing checks it all)."""
    if not isinstance(body, dict):
        return 1
    prompt, n = body.get("prompt"), body.get("n")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and not all(type(t) is int for t in prompt) else 1
    return prompts * (n if type(n) is int and n > 0 else 1)
