"""What a draft proposer is: the interface the speculative decoder drives every step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..sequence import Sequence


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one sequence, and (for a sampled draft) the distribution each was drawn
    from: probs [len(token_ids), vocab], normalized. None means a point mass on each token
    (n-gram lookup, or a greedy draft)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    needs_probs: bool  # whether proposals carry draft distributions (rejection sampling needs them)

    def propose(self, seqs: list[Sequence], ks: list[int], seeds: dict[str, int]) -> list[Proposal]:
        """Up to ks[i] draft tokens to follow each sequence's tokens (its committed ones)."""
        ...

    def commit(self, seqs: list[Sequence], running: list[Sequence]) -> None:
        """A step is over: the tokens of `seqs` (its sequences) are final for now; forget what
        was not kept, and everything of sequences no longer `running`."""
        ...

    def drop(self, request_id: str) -> None:
        """The request is finished or aborted: free what the proposer holds for it."""
        ...

    def check_integrity(self) -> None:
        ...
