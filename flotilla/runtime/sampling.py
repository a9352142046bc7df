"""Sampling parameters of one request, validated once at the door."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from flotilla.errors import FlotillaError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    min_tokens: int = 0  # no eos / stop token / stop string ends the request before this many tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), as OpenAI's logit_bias
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text (vLLM's option)
    # each prompt token's logprob (given the tokens before it) and the `prompt_logprobs` likeliest there, as
    # vLLM's prompt_logprobs (and what echo with logprobs shows); None: not computed. The prefix cache is
    # not read for such a request until its prompt is computed (a cached block has no logits).
    prompt_logprobs: int | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))  # hashable, as keyed
        checks = [
            (self.max_tokens >= 0, "max_tokens must be at least 0 (0: the prompt is computed, no token generated)"),
            (math.isfinite(self.temperature) and self.temperature >= 0,
             "temperature must be a finite number >= 0 (0: greedy)"),
            (self.top_k >= 0, "top_k must be >= 0 (0 turns it off)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
             "repetition_penalty must be a finite number > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (0 <= self.top_logprobs <= 20, "top_logprobs must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs must be in [0, 20]"),
            (0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens ({self.max_tokens})], got {self.min_tokens}"),
            (all(math.isfinite(b) and -100 <= b <= 100 for _, b in self.logit_bias),
             "logit_bias values must be in [-100, 100]"),
        ]
        for ok, message in checks:
            if not ok:
                raise FlotillaError(message)

    def end_token_ids(self, eos_token_ids) -> frozenset[int]:
        """The ids that end a request of these params: its stop tokens, and the model's eos unless it
        ignores them."""
        return frozenset(self.stop_token_ids) | frozenset(() if self.ignore_eos else eos_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalty(self) -> bool:
        """Whether sampling reads the request's earlier tokens (a repetition, presence or frequency penalty)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
