"""OpenAI request bodies (and websocket chat frames) validated into a `GenerationRequest`.

Everything a user can get wrong is checked here, before the engine sees the request: types,
ranges, the model name, the messages, the prompt length against the context and max_tokens
against what is left of it. Each mistake is a 4xx `ApiError` whose message says what to fix.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Protocol

from flotilla.errors import FlotillaError

from .engine_client import SamplingParams
from .errors import ApiError, bad_request
from .fields import Fields, describe, text

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 16
MAX_STOP_LEN = 256
MAX_LOGIT_BIAS = 300
MAX_TEMPLATE_KWARGS, MAX_TEMPLATE_KWARGS_BYTES = 16, 4096
SEED_MAX = 2**63 - 1
# vLLM's request fields that constrain or reshape what is generated: refused with a 400 rather than
# ignored, so that a client never takes free text for constrained output
UNSUPPORTED = {
    "guided_json": "guided decoding", "guided_regex": "guided decoding", "guided_choice": "guided decoding",
    "guided_grammar": "guided decoding", "guided_whitespace_pattern": "guided decoding",
    "guided_decoding_backend": "guided decoding", "structured_outputs": "structured outputs",
    "use_beam_search": "beam search",
    "allowed_token_ids": "token allow-lists", "bad_words": "banned words", "logits_processors": "logits processors",
    "chat_template": "request-supplied chat templates (it uses the model's)", "documents": "document templates",
}
# OpenAI's request fields that change nothing here and that clients send as a matter of course: left out of
# the log line that names a request's ignored fields (GenerationRequest.ignored)
SILENT = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "safety_identifier",
                    "prompt_cache_key"})
# chat_template_kwargs may not set what the request or the tokenizer sets (the conversation, the flags, the
# template itself, the special tokens): a client-sent template is code run by the server
TEMPLATE_NAMES = ("messages", "add_generation_prompt", "continue_final_message", "tools", "documents", "chat_template",
                  "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
                  "return_assistant_tokens_mask", "tokenizer_kwargs", "conversation", "sanitize_control_tokens")


class ModelInfo(Protocol):
    model_name: str
    max_model_len: int
    tokenizer: object


@dataclass(frozen=True)
class GenerationRequest:
    """One validated request: prompts (token ids) x n choices, each with its sampling params."""
    kind: str  # "chat" or "completion"
    model: str
    prompts: tuple[tuple[int, ...], ...]
    params: tuple[SamplingParams, ...]  # one per prompt (max_tokens may depend on its length)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: the usage so far in every chunk
    echo: bool = False  # completions: each choice's text starts with its prompt (and its logprobs with the prompt's)
    prompt_texts: tuple[str | None, ...] = ()  # echo: the prompts as sent (None: token ids, or truncated)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: the prompt's logprobs and this many likeliest
    ignored: tuple[str, ...] = ()  # the body's fields that no part of the request read (a typo, another server's)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def choices(self) -> list[tuple[int, tuple[int, ...], SamplingParams]]:
        """(choice index, prompt ids, params) for every sequence; seeds differ across the n choices."""
        out = []
        for i, (prompt, params) in enumerate(zip(self.prompts, self.params)):
            for j in range(self.n):
                p = params
                if j and params.seed is not None:
                    p = dataclasses.replace(params, seed=(params.seed + j) % SEED_MAX)
                out.append((i * self.n + j, prompt, p))
        return out


def parse_chat(data: dict, model: ModelInfo, max_n: int) -> GenerationRequest:
    f = Fields(data)
    check_model(f, model)
    _reject_unsupported(f)
    if f.boolean("echo", False):
        raise bad_request("'echo' is not supported for chat; leave it out or set it to false (the completions "
                          "API's echo is)", param="echo")
    prompt = render_chat(f, parse_messages(f), model)
    logprobs = f.boolean("logprobs", False)
    top = f.integer("top_logprobs", 0, 0, 20)
    if top and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    key = "max_completion_tokens" if f.has("max_completion_tokens") else "max_tokens"
    return _finish(f, "chat", model, [prompt], "messages", key, None, logprobs, top, max_n)


def parse_completion(data: dict, model: ModelInfo, max_n: int) -> GenerationRequest:
    f = Fields(data)
    check_model(f, model)
    _reject_unsupported(f)
    if f.string("suffix"):
        raise bad_request("'suffix' (insertion) is not supported; leave it out", param="suffix")
    if f.has("top_logprobs"):
        raise bad_request("'top_logprobs' is the chat API's; the completions API takes 'logprobs': N (the N "
                          "likeliest tokens)", param="top_logprobs")
    prompts = parse_prompts(f, model)
    top = f.integer("logprobs", None, 0, 20)
    n = f.integer("n", 1, 1, max_n, hint=" (the server's --max-n)")
    best_of = f.integer("best_of", n, 1, max_n)
    if best_of != n:
        raise bad_request(f"'best_of' is not supported unless it equals 'n' ({n})", param="best_of")
    echo = f.boolean("echo", False)
    return _finish(f, "completion", model, prompts, "prompt", "max_tokens", 16, top is not None, top or 0, max_n,
                   echo=echo, prompt_texts=tuple(_prompt_items(f)) if echo else ())


def render_chat(f: Fields, messages: list[dict], model: ModelInfo) -> list[int]:
    """The prompt ids of `messages` as the request asks them rendered: add_generation_prompt,
    continue_final_message and chat_template_kwargs (vLLM's fields)."""
    continue_final = f.boolean("continue_final_message", False)
    add_generation_prompt = f.boolean("add_generation_prompt", not continue_final)
    if continue_final and add_generation_prompt:
        raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true: the reply "
                          "either continues the last message or starts a new one", param="continue_final_message")
    try:
        return model.tokenizer.apply_chat_template(messages, add_generation_prompt, continue_final,
                                                   _template_kwargs(f))
    except FlotillaError as e:
        raise bad_request(f"'messages': {e}", param="messages") from None


def check_model(f: Fields, model: ModelInfo) -> str:
    """'model' may be left out (the server serves one; vLLM and llama.cpp's server take it so); a name given
    must be the served one."""
    name = f.string("model")
    if not name:  # some clients send "" for "the default model"
        return model.model_name
    if name != model.model_name:
        raise ApiError(404, f"the model '{name[:100]}' does not exist here; this server serves "
                            f"'{model.model_name}' (GET /v1/models lists it)", param="model", code="model_not_found")
    return name


def parse_messages(f: Fields) -> list[dict]:
    messages = f.raw("messages")
    if messages is None:
        raise bad_request("'messages' is required: an array of {\"role\": ..., \"content\": ...} objects",
                          param="messages")
    if not isinstance(messages, list) or not messages:
        got = "an empty array" if isinstance(messages, list) else describe(messages)
        raise bad_request(f"'messages' must be a non-empty array of {{\"role\", \"content\"}} objects, "
                          f"got {got}", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"'{where}' must be an object with 'role' and 'content', got {describe(m)}", param=where)
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"'{where}.role' must be one of {', '.join(ROLES)}, got {describe(role)}",
                              param=f"{where}.role")
        for key in ("tool_calls", "function_call"):
            if m.get(key):  # the template would drop them and the model would answer a conversation it never saw
                raise bad_request(f"'{where}.{key}' is not supported: this server has no tools, so a conversation "
                                  f"with tool calls cannot be rendered; send the call as the message's 'content' "
                                  f"or leave the message out", param=f"{where}.{key}")
        out.append({"role": "system" if role == "developer" else role, "content": _content(m, where)})
    return out


def _content(m: dict, where: str) -> str:
    content = m.get("content")
    if content is None and m.get("role") == "assistant":
        return ""
    if isinstance(content, str):
        return text(content, f"{where}.content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"'{where}.content[{j}]' must be {{\"type\": \"text\", \"text\": ...}}; "
                                  f"only text content is supported", param=f"{where}.content")
            parts.append(text(part["text"], f"{where}.content"))
        return "\n".join(parts)  # as vLLM joins text parts
    raise bad_request(f"'{where}.content' must be a string or an array of text parts, got {describe(content)}",
                      param=f"{where}.content")


def _prompt_items(f: Fields) -> list:
    """The prompts of a completions request: strings or token-id arrays."""
    prompt = f.raw("prompt")
    expected = "a string, an array of strings, an array of token ids or an array of token-id arrays"
    if prompt is None:
        raise bad_request(f"'prompt' is required: {expected}", param="prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_ids(prompt)):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        return prompt
    got = "an empty array" if prompt == [] else describe(prompt)
    raise bad_request(f"'prompt' must be {expected}, got {got}", param="prompt")


def parse_prompts(f: Fields, model: ModelInfo) -> list[list[int]]:
    items = _prompt_items(f)
    vocab = model.tokenizer.vocab_size
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            ids = model.tokenizer.encode(text(item, "prompt"))
        elif isinstance(item, list) and _is_ids(item):
            bad = [t for t in item if not 0 <= t < vocab]
            if bad:
                raise bad_request(f"'prompt' token id {bad[0]} is out of range; ids must be in 0..{vocab - 1}",
                                  param="prompt")
            ids = list(item)
        elif item == []:
            raise bad_request(f"'prompt[{i}]' is an empty array; send at least one token id", param="prompt")
        else:
            raise bad_request(f"'prompt[{i}]' must be a string or an array of token ids, got {describe(item)}",
                              param="prompt")
        if not ids:
            raise bad_request("'prompt' is empty; send at least one token of text", param="prompt")
        out.append(ids)
    return out


def _seed(f: Fields) -> int | None:
    """'seed': any 64-bit integer, as OpenAI and vLLM take it (folded into 0..2^63-1), except -1: llama.cpp's
    "a random seed"; or absent."""
    if f.raw("seed") == -1:
        return None
    seed = f.integer("seed", None, -2**63, 2**64 - 1, hint=" (-1 for a random one)")
    return None if seed is None else seed % (SEED_MAX + 1)  # 0..2^63-1 as given


def _is_ids(items: list) -> bool:
    return bool(items) and all(isinstance(t, int) and not isinstance(t, bool) for t in items)


def _template_kwargs(f: Fields) -> dict:
    """'chat_template_kwargs': more variables for the chat template (vLLM's; e.g. enable_thinking)."""
    extra = f.raw("chat_template_kwargs", {})
    if (not isinstance(extra, dict) or len(extra) > MAX_TEMPLATE_KWARGS
            or len(json.dumps(extra)) > MAX_TEMPLATE_KWARGS_BYTES):
        raise bad_request(f"'chat_template_kwargs' must be an object of at most {MAX_TEMPLATE_KWARGS} names and "
                          f"{MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON, got {describe(extra)}",
                          param="chat_template_kwargs")
    taken = [k for k in extra if k in TEMPLATE_NAMES or k.endswith("_token")]
    if taken:
        raise bad_request(f"'chat_template_kwargs.{taken[0]}' is set by the request or the model, not here",
                          param="chat_template_kwargs")
    return extra


def _logit_bias(f: Fields, vocab: int) -> tuple[tuple[int, float], ...]:
    """'logit_bias': {"token id": bias in -100..100}, as OpenAI's."""
    bias = f.raw("logit_bias", {})
    expected = (f"an object mapping token ids (as strings) to numbers between -100 and 100, at most "
                f"{MAX_LOGIT_BIAS} of them")
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' must be {expected}", param="logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"'logit_bias' key {describe(key)} is not a token id; {expected}",
                              param="logit_bias") from None
        if not 0 <= token < vocab:
            raise bad_request(f"'logit_bias' token id {token} is out of range; ids must be in 0..{vocab - 1}",
                              param="logit_bias")
        if (not isinstance(value, (int, float)) or isinstance(value, bool) or value != value
                or not -100 <= value <= 100):
            raise bad_request(f"'logit_bias[\"{key}\"]' must be a number between -100 and 100, got "
                              f"{describe(value)}", param="logit_bias")
        if token in out:
            raise bad_request(f"'logit_bias' names token {token} twice", param="logit_bias")
        out[token] = float(value)
    return tuple(out.items())


def _reject_unsupported(f: Fields) -> None:
    for key in ("tools", "functions"):
        if f.raw(key) not in (None, []):  # an empty list asks for nothing
            raise bad_request(f"'{key}' is not supported by this server; leave it out", param=key)
    choice = f.raw("tool_choice", "none")
    if choice not in ("none", "auto"):
        raise bad_request(f"'tool_choice' {describe(choice)} asks for a tool call, but this server has no tools "
                          f"(and the request gives none); leave it out", param="tool_choice")
    for key, what in UNSUPPORTED.items():
        if f.raw(key, False) not in (False, [], {}, ""):  # an empty value means the field's default, as absent
            raise bad_request(f"'{key}' is not supported: this server has no {what}; leave it out", param=key)
    if f.raw("skip_special_tokens", True) is not True:
        raise bad_request("'skip_special_tokens': false is not supported; the text never holds special tokens "
                          "(logprobs name them)", param="skip_special_tokens")
    fmt = f.obj("response_format")
    if fmt is not None and fmt.raw("type") != "text":  # OpenAI's requires its type
        raise bad_request("'response_format' other than {\"type\": \"text\"} is not supported", param="response_format")


def _finish(f: Fields, kind: str, model: ModelInfo, prompts: list[list[int]], prompt_field: str,
            max_tokens_key: str, default_max_tokens: int | None, logprobs: bool, top_logprobs: int,
            max_n: int, echo: bool = False, prompt_texts: tuple = ()) -> GenerationRequest:
    context = model.max_model_len
    keep = f.integer("truncate_prompt_tokens", None, -1, None, hint=" (-1: the context)")
    if keep == 0:
        raise bad_request("'truncate_prompt_tokens' must be at least 1, or -1 for the context",
                          param="truncate_prompt_tokens")
    if keep is not None:  # vLLM's: only the prompt's last `keep` tokens (-1: as many as the context holds)
        prompts = [p[-(context - 1 if keep == -1 else keep):] for p in prompts]
        prompt_texts = tuple(None for _ in prompt_texts)  # echo shows the tokens kept
    longest = max(len(p) for p in prompts)
    scoring = echo and f.raw(max_tokens_key) == 0  # the prompt scored alone: it may fill the context
    if longest >= context + scoring:
        raise bad_request(f"{longest} tokens of {prompt_field}, but the context holds {context} tokens "
                          f"(including the reply); shorten the {prompt_field}", param=prompt_field,
                          code="context_length_exceeded")
    room = context - longest
    # max_tokens 0 with echo: the prompt scored, nothing generated (OpenAI's legacy API, vLLM)
    max_tokens = f.integer(max_tokens_key, None, 0 if echo else 1, None, hint=" (0 only with echo)" if kind == "completion" and not echo else "")
    min_tokens = f.integer("min_tokens", 0, 0, max_tokens if max_tokens is not None else room,
                           hint=f" (no more than {max_tokens_key})" if max_tokens is not None else
                           " (no more than the context leaves after the prompt)")
    if max_tokens is not None and max_tokens > room:
        raise bad_request(f"'{max_tokens_key}' is {max_tokens} but {longest} of the {context}-token context go to "
                          f"the {prompt_field}; ask for at most {room}", param=max_tokens_key,
                          code="context_length_exceeded")
    n = f.integer("n", 1, 1, max_n, hint=" (the server's --max-n)")  # prompts x n: admission's bound
    stream = f.boolean("stream", False)
    options = f.obj("stream_options")
    if options is not None and not stream:
        raise bad_request("'stream_options' is only allowed with 'stream': true", param="stream_options")
    include_usage = options.boolean("include_usage", False) if options else False
    continuous_usage = include_usage and options.boolean("continuous_usage_stats", False)  # vLLM: needs both
    ignored_options = tuple(f"stream_options.{k}" for k in options.unread()) if options else ()
    prompt_logprobs = f.integer("prompt_logprobs", None, 0, 20)  # vLLM's
    if prompt_logprobs is not None and stream:
        raise bad_request("'prompt_logprobs' is not available with 'stream': true (as in vLLM); the completions "
                          "API's echo with logprobs streams the prompt's logprobs", param="prompt_logprobs")
    wanted = [k for k in (prompt_logprobs, top_logprobs if echo and logprobs else None) if k is not None]
    if wanted and not getattr(model, "computes_prompt_logprobs", True):
        raise bad_request("prompt logprobs (echo with logprobs, prompt_logprobs) are not computed by this "
                          "server's engine; leave them out", param="prompt_logprobs" if prompt_logprobs is not None
                          else "echo")
    common = dict(
        temperature=f.number("temperature", 1.0, 0, 2),
        top_p=f.number("top_p", 1.0, 0, 1, lo_open=True),
        top_k=max(0, f.integer("top_k", 0, -1, None)),
        min_p=f.number("min_p", 0.0, 0, 1),
        repetition_penalty=f.number("repetition_penalty", 1.0, 0, 10, lo_open=True),
        presence_penalty=f.number("presence_penalty", 0.0, -2, 2),
        frequency_penalty=f.number("frequency_penalty", 0.0, -2, 2),
        seed=_seed(f),
        stop=f.string_list("stop", MAX_STOP, MAX_STOP_LEN),
        stop_token_ids=f.int_list("stop_token_ids", 0, model.tokenizer.vocab_size - 1, MAX_STOP),
        ignore_eos=f.boolean("ignore_eos", False),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        logit_bias=_logit_bias(f, model.tokenizer.vocab_size),
        include_stop_str_in_output=f.boolean("include_stop_str_in_output", False),
        prompt_logprobs=max(wanted) if wanted else None,
    )
    params = []
    for p in prompts:
        limit = max_tokens if max_tokens is not None else min(default_max_tokens or context, context - len(p))
        limit = max(limit, min(min_tokens, context - len(p)))  # the default max_tokens never undercuts min_tokens
        try:
            params.append(SamplingParams(max_tokens=limit, min_tokens=min(min_tokens, limit), **common))
        except FlotillaError as e:
            raise bad_request(str(e)) from None
    return GenerationRequest(kind, model.model_name, tuple(tuple(p) for p in prompts), tuple(params), n,
                             stream, include_usage, continuous_usage, echo,
                             tuple(t if isinstance(t, str) else None for t in prompt_texts), prompt_logprobs,
                             tuple(k for k in f.unread() if k not in SILENT) + ignored_options)
