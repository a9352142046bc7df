"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize, GET /tokenizer_info — what lm-eval's remote
tokenizer (`tokenizer_backend=remote`, or `auto`, which looks for them) asks a server for, so that it scores a
served model without a local copy of its tokenizer. Guarded by the API key as /v1/* is."""
from __future__ import annotations

from aiohttp import web

from .errors import bad_request
from .fields import Fields, describe, text
from .protocol import check_model, parse_messages, render_chat
from .state import ServerState

MAX_TOKENS = 1 << 20  # token ids one /detokenize may send (the body limit bounds it too)


class TokenizerRoutes:
    def __init__(self, state: ServerState):
        self.state = state

    def register(self, app: web.Application) -> None:
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/tokenizer_info", self.info)

    async def tokenize(self, request: web.Request) -> web.Response:
        """{"prompt": text, "add_special_tokens": true} or {"messages": [...], "add_generation_prompt": true}
        -> {"count", "max_model_len", "tokens"}, as vLLM answers."""
        f = Fields(await self.state.read_json(request))
        engine = self.state.engine
        check_model(f, engine)
        if f.has("messages"):
            ids = render_chat(f, parse_messages(f), engine)
        else:
            prompt = f.raw("prompt")
            if not isinstance(prompt, str):
                raise bad_request(f"'prompt' must be a string (or send 'messages'), got {describe(prompt)}",
                                  param="prompt")
            ids = engine.tokenizer.encode(text(prompt, "prompt"), add_special_tokens=f.boolean("add_special_tokens", True))
        return web.json_response({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids})

    async def detokenize(self, request: web.Request) -> web.Response:
        """{"tokens": [ids]} -> {"prompt": text}."""
        f = Fields(await self.state.read_json(request))
        engine = self.state.engine
        check_model(f, engine)
        vocab = engine.tokenizer.vocab_size
        ids = f.int_list("tokens", 0, vocab - 1, MAX_TOKENS) if f.has("tokens") else None
        if ids is None:
            raise bad_request("'tokens' is required: an array of token ids", param="tokens")
        return web.json_response({"prompt": engine.tokenizer.decode(list(ids))})

    async def info(self, request: web.Request) -> web.Response:
        """The tokenizer's special tokens and chat template (vLLM's /tokenizer_info fields lm-eval reads)."""
        tok = self.state.engine.tokenizer
        body = {name: tok.special_token(name) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        body.update(chat_template=tok.chat_template, model_max_length=self.state.engine.max_model_len,
                    tokenizer_class=type(tok.hf).__name__)
        return web.json_response(body)
