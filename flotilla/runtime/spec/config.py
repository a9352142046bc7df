"""Speculative decoding options: which proposer, how many tokens, when to stop speculating.

`--speculative` names the proposer:

    ngram         prompt lookup: the continuation of the longest earlier match of the
                  context's last tokens (no second model)
    draft:PATH    a small model (or a lower-bit copy of the target) that shares the target's
                  vocabulary, run with its own paged KV cache
"""
from __future__ import annotations

from dataclasses import dataclass

from flotilla.errors import FlotillaError

METHODS = ("ngram", "draft:PATH")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" or "draft"
    num_speculative_tokens: int = 4  # K: drafts verified per step and sequence (at most)
    draft_path: str | None = None
    ngram_max: int = 4  # longest suffix searched for in the context
    ngram_min: int = 1  # shortest suffix accepted as a match
    # a sequence whose recent acceptance rate (an exponential average) falls below this
    # stops speculating for `backoff_steps` steps, doubling each time it fails again
    min_acceptance: float = 0.3
    acceptance_weight: float = 0.5  # weight of the newest step in the average
    backoff_steps: int = 8
    max_backoff_steps: int = 128

    def __post_init__(self):
        if self.method not in ("ngram", "draft"):
            raise FlotillaError(f"--speculative: unknown method {self.method!r}; valid: {', '.join(METHODS)}")
        if self.method == "draft" and not self.draft_path:
            raise FlotillaError("--speculative draft:PATH needs the path of the draft model after 'draft:'")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise FlotillaError(f"--num-speculative-tokens must be in [1, 32], got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise FlotillaError(f"n-gram sizes must satisfy 1 <= min <= max, got min {self.ngram_min}, "
                                f"max {self.ngram_max}")
        if not 0 <= self.min_acceptance < 1 or not 0 < self.acceptance_weight <= 1:
            raise FlotillaError("min_acceptance must be in [0, 1) and acceptance_weight in (0, 1]")

    def check_draft_path(self) -> None:
        """The draft opens as a model (the loader's own check, headers only): done when the flag is read,
        before the target loads (a typo would otherwise cost the target's load first)."""
        from flotilla.models.sources import open_source

        try:
            open_source(self.draft_path).release()
        except FlotillaError as e:
            raise FlotillaError(f"--speculative draft:{self.draft_path}: {e}") from None

    @classmethod
    def parse(cls, text: str, num_speculative_tokens: int = 4, **options) -> "SpeculativeConfig":
        """'ngram' or 'draft:PATH' (from --speculative) -> a config."""
        text = text.strip()
        method, _, rest = text.partition(":")
        if method == "ngram" and not rest:
            return cls("ngram", num_speculative_tokens, **options)
        if method == "draft":
            return cls("draft", num_speculative_tokens, draft_path=rest, **options)
        raise FlotillaError(f"--speculative {text!r}: expected one of {', '.join(METHODS)}")
