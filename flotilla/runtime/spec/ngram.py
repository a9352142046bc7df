"""Prompt lookup: propose the continuation of the longest earlier match of the context's end.

For a context t[0..L-1], find the earlier position j (j < L-1) where the longest suffix of the
context also ends, t[j-n+1..j] == t[L-n..L-1] with ngram_min <= n <= ngram_max, and propose the
tokens that followed it, t[j+1..j+k]. Ties in length go to the most recent match. Proposals are
deterministic, so the verifier treats them as a point-mass draft distribution.

Work per sequence is O(L) numpy comparisons (one pass for the last token, then ngram_max - 1
checks on its occurrences only); no Python loop over tokens.
"""
from __future__ import annotations

import numpy as np

from ..sequence import Sequence
from .proposer import Proposal


def ngram_lookup(tokens: np.ndarray, k: int, ngram_min: int = 1, ngram_max: int = 4) -> np.ndarray:
    """Up to k tokens that followed the longest (then latest) earlier match of the context's
    last n tokens (ngram_min <= n <= ngram_max); empty when nothing matches."""
    L = tokens.shape[0]
    if L < ngram_min + 1 or k <= 0:
        return tokens[:0]
    ends = np.flatnonzero(tokens[:L - 1] == tokens[L - 1])  # earlier positions ending like the context
    if ends.size == 0:
        return tokens[:0]
    length = np.ones(ends.shape, dtype=np.int64)  # match length of each candidate so far
    alive = np.ones(ends.shape, dtype=bool)
    for d in range(1, min(ngram_max, L - 1)):  # compare one more token back (at most ngram_max - 1 times)
        ok = alive & (ends - d >= 0)
        ok[ok] = tokens[ends[ok] - d] == tokens[L - 1 - d]
        length += ok
        alive = ok
        if not alive.any():
            break
    best = length.max()
    if best < ngram_min:
        return tokens[:0]
    j = ends[np.flatnonzero(length == best)[-1]]  # the latest of the longest matches
    return tokens[j + 1:j + 1 + k]


class NgramProposer:
    """Drafts from the sequence's own tokens (prompt and output); holds no state."""

    needs_probs = False

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, seqs: list[Sequence], ks: list[int], seeds: dict[str, int]) -> list[Proposal]:
        out = []
        for seq, k in zip(seqs, ks):
            tokens = np.fromiter(seq.token_ids, dtype=np.int64, count=seq.num_tokens)
            out.append(Proposal(ngram_lookup(tokens, k, self.ngram_min, self.ngram_max).tolist()))
        return out

    def commit(self, seqs: list[Sequence], running: list[Sequence]) -> None:
        pass

    def drop(self, request_id: str) -> None:
        pass

    def check_integrity(self) -> None:
        pass
