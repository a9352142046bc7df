"""OpenAI response bodies and stream chunks for chat and (legacy) completions."""
from __future__ import annotations

import time
from functools import lru_cache

from .engine_client import TokenLogprob

FINGERPRINT = "flotilla"


class TokenText:
    """Token id -> its text, for logprobs (special tokens kept, so every id has a name)."""

    def __init__(self, tokenizer):
        self.decode = lru_cache(maxsize=65536)(lambda i: tokenizer.decode([i], skip_special_tokens=False))
        self.raw = lru_cache(maxsize=65536)(tokenizer.token_bytes)

    def entry(self, token_id: int, logprob: float) -> dict:
        """A chat logprob: the token's text and its own bytes (a piece of a multi-byte character is
        "\ufffd" as text, and its raw bytes, which joined with its neighbours' give the character)."""
        return {"token": self.decode(token_id), "logprob": logprob, "bytes": list(self.raw(token_id))}


def chat_logprobs(tt: TokenText, items: list[TokenLogprob]) -> dict:
    return {"content": [{**tt.entry(lp.token_id, lp.logprob), "top_logprobs": [tt.entry(t, v) for t, v in lp.top]}
                        for lp in items]}


def completion_logprobs(tt: TokenText, items: list[TokenLogprob], offsets: list[int]) -> dict:
    """Completions' logprobs. `offsets`: each token's text_offset, where the text it completed
    starts in the choice's text (streamed or not alike: a piece of a multi-byte character, which
    adds no text, has the offset of the character it ends up in)."""
    return {"tokens": [tt.decode(lp.token_id) for lp in items], "token_logprobs": [lp.logprob for lp in items],
            "top_logprobs": [_top_dict(tt, lp) for lp in items], "text_offset": offsets}


class EchoedPrompt:
    """A completions choice's prompt as echo shows it: its text (as sent, or decoded from its ids), each
    token's text_offset in that text, and its logprobs in completions' form when it has them."""

    def __init__(self, tt: TokenText, tokenizer, ids: tuple[int, ...], sent: str | None):
        detok, decoded, self.offsets = tokenizer.detokenizer([]), "", []
        for t in ids:
            self.offsets.append(len(decoded))
            decoded += detok.add(t)
        decoded += detok.flush()
        self.text = sent if sent is not None else decoded
        self.tt, self.ids = tt, ids

    def logprobs(self, entries, k: int) -> dict:
        """Completions' logprobs of the prompt (`entries`: the engine's prompt logprobs, None at 0):
        token_logprobs and top_logprobs are null for the first token, as OpenAI's and vLLM's."""
        tt, lps, tops = self.tt, [None], [None]
        for t, entry in zip(self.ids[1:], (entries or ())[1:]):
            if entry is None:  # not computed (never expected: the engine fills every position)
                lps.append(None)
                tops.append(None)
                continue
            lp, _, top = entry
            lps.append(lp)
            tops.append(_top_dict(tt, TokenLogprob(t, lp, tuple(top[:k]))))
        lps += [None] * (len(self.ids) - len(lps))  # none computed (an engine without them): null, not a 500
        tops += [None] * (len(self.ids) - len(tops))
        return {"tokens": [tt.decode(t) for t in self.ids], "token_logprobs": lps, "top_logprobs": tops,
                "text_offset": list(self.offsets)}


def join_logprobs(first: dict, then: dict, shift: int) -> dict:
    """Completions' logprobs of `first` followed by `then`, whose text starts `shift` characters in."""
    return {"tokens": first["tokens"] + then["tokens"], "token_logprobs": first["token_logprobs"] + then["token_logprobs"],
            "top_logprobs": first["top_logprobs"] + then["top_logprobs"],
            "text_offset": first["text_offset"] + [o + shift for o in then["text_offset"]]}


def vllm_prompt_logprobs(tt: TokenText, ids, entries, k: int) -> list:
    """vLLM's prompt_logprobs: per prompt token, None for the first, then {token id: {logprob, rank,
    decoded_token}} of the token there and the k likeliest."""
    out: list = [None]
    for t, entry in zip(ids[1:], (entries or ())[1:]):
        if entry is None:  # not computed (never expected)
            out.append(None)
            continue
        lp, rank, top = entry
        row = {str(i): {"logprob": v, "rank": r + 1, "decoded_token": tt.decode(i)} for r, (i, v) in enumerate(top[:k])}
        row.setdefault(str(t), {"logprob": lp, "rank": rank, "decoded_token": tt.decode(t)})
        out.append(row)
    return out


def _top_dict(tt: TokenText, lp: TokenLogprob) -> dict[str, float]:
    """Completions' top_logprobs: text -> logprob, most likely first, and the sampled token's own
    (so up to logprobs + 1 entries, as OpenAI's legacy API and vLLM give); where two tokens share
    a text (pieces of multi-byte characters all decode to "\ufffd") the likelier one keeps it."""
    out: dict[str, float] = {}
    for t, v in lp.top:
        out.setdefault(tt.decode(t), v)
    out.setdefault(tt.decode(lp.token_id), lp.logprob)
    return out


class Shapes:
    """Builders bound to one request's id, creation time and model name."""

    def __init__(self, kind: str, request_id: str, model: str):
        self.kind = kind
        self.id = request_id
        self.model = model
        self.created = int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": FINGERPRINT}

    # ------------------------------------------------------------------------------- chat
    def chat_chunk(self, index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None,
                   usage: bool | dict = False, stop_reason: str | int | None = None) -> dict:
        """`usage`: False leaves the key out, True sends null (include_usage), a dict the usage so far
        (continuous_usage_stats)."""
        body = self._base("chat.completion.chunk")
        body["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                            "stop_reason": stop_reason}]
        if usage is not False:
            body["usage"] = None if usage is True else usage
        return body

    def chat_response(self, choices: list[dict], usage: dict) -> dict:
        body = self._base("chat.completion")
        body["choices"] = choices
        body["usage"] = usage
        return body

    @staticmethod
    def chat_choice(index: int, text: str | None, finish_reason: str, logprobs: dict | None,
                    stop_reason: str | int | None = None, reasoning: str | None | bool = False) -> dict:
        """`reasoning` False: no reasoning parser (no such field); else its text or None, under vLLM's name
        and its older one."""
        message = {"role": "assistant", "content": text}
        if reasoning is not False:
            message["reasoning"] = message["reasoning_content"] = reasoning
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    # ------------------------------------------------------------------------- completions
    def completion_chunk(self, index: int, text: str, finish_reason: str | None = None,
                         logprobs: dict | None = None, usage: bool | dict = False, stop_reason: str | int | None = None) -> dict:
        body = self._base("text_completion")
        body["choices"] = [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                            "stop_reason": stop_reason}]
        if usage is not False:
            body["usage"] = None if usage is True else usage
        return body

    def completion_response(self, choices: list[dict], usage: dict) -> dict:
        body = self._base("text_completion")
        body["choices"] = choices
        body["usage"] = usage
        return body

    @staticmethod
    def completion_choice(index: int, text: str, finish_reason: str, logprobs: dict | None,
                          stop_reason: str | int | None = None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    # ------------------------------------------------------------------------------- both
    def usage_chunk(self, usage: dict) -> dict:
        body = self._base("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        body["choices"] = []
        body["usage"] = usage
        return body
