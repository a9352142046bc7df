"""The engine's side of speculative decoding: who speculates how far, and what came of it.

Each step, before scheduling, `propose` asks the proposer for drafts for every running sequence
that is decoding (one uncomputed token) and sets `seq.spec_token_ids`; the scheduler schedules
them with their decode, the runner verifies them (spec/rejection.py), and the engine reports
back through `observe` (per sequence) and `commit` (per step: once its sequences' tokens are
final, so a draft model can drop the KV of what was rejected).

A pipeline keeps several steps (micro-batches) in flight: `propose` leaves a sequence whose step
is being computed alone (it has nothing uncomputed), the draft distributions of a step are
handed over (and forgotten here) when its input is built, and `commit` is per micro-batch.

Per-sequence K: at most num_speculative_tokens, never more than the tokens the request may
still generate minus one (the step always yields one token of its own) nor past the context;
none for requests that ask for logprobs. A sequence whose acceptance rate (an exponential
average over its verify steps) falls below `min_acceptance` stops speculating for a while
(`backoff_steps`, doubling on each relapse, reset by a good step), then tries again.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scheduler import ScheduledSeq
from ..sequence import Sequence
from .config import SpeculativeConfig
from .proposer import Proposer


@dataclass
class _Acceptance:
    rate: float = 1.0  # exponential average of accepted / proposed
    off_steps: int = 0  # steps left without speculation
    backoff: int = 0  # length of the next pause


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_len: int | None = None):
        self.config = config
        self.proposer = proposer
        self.max_len = max_len  # the proposer's longest context (a draft model's), None: no limit
        # most drafts with distributions per sequence and step (a pipeline's frame limit); None: K
        self.max_prob_rows: int | None = None
        self._seqs: dict[str, _Acceptance] = {}
        self._probs: dict[str, torch.Tensor] = {}  # the last proposal's draft distributions, by request
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verify_steps = 0

    # ------------------------------------------------------------------ before the step
    def propose(self, running: list[Sequence], seeds: dict[str, int]) -> None:
        """Set `spec_token_ids` of every running sequence (empty where it does not speculate);
        a sequence whose step is in flight (nothing uncomputed) is left as it is."""
        seqs, ks = [], []
        for seq in running:
            if seq.num_uncomputed_tokens < 1:
                continue
            seq.spec_token_ids = []
            k = self.num_tokens_for(seq)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
        self._probs.clear()
        if not seqs:
            return
        for seq, proposal in zip(seqs, self.proposer.propose(seqs, ks, seeds)):
            seq.spec_token_ids = proposal.token_ids
            if proposal.probs is not None:
                self._probs[seq.request_id] = proposal.probs

    def num_tokens_for(self, seq: Sequence) -> int:
        """K for this sequence this step (0: no speculation); counts down a pause."""
        if seq.num_uncomputed_tokens != 1 or seq.params.logprobs:
            return 0
        state = self._seqs.setdefault(seq.request_id, _Acceptance(backoff=self.config.backoff_steps))
        if state.off_steps > 0:
            state.off_steps -= 1
            return 0
        k = min(self.config.num_speculative_tokens, seq.params.max_tokens - seq.num_output_tokens - 1)
        for limit in (seq.max_model_len, self.max_len):
            if limit is not None:
                k = min(k, limit - seq.num_tokens - 1)
        if self.max_prob_rows is not None and self.proposer.needs_probs and not seq.params.greedy:
            k = min(k, self.max_prob_rows)
        return max(k, 0)

    def prob_bytes(self, s: ScheduledSeq) -> int:
        """Bytes of fp32 draft distributions that a scheduled sequence's drafts carry."""
        probs = self._probs.get(s.seq.request_id)
        return 0 if probs is None or not s.num_spec else s.num_spec * probs.shape[1] * 4

    def draft_probs(self, scheduled: list[ScheduledSeq]) -> torch.Tensor | None:
        """The draft distributions [drafts, vocab] of a step's scheduled drafts, in order (point
        masses for sequences whose drafts have none), or None when all are point masses. They
        go with the step: this decoder forgets them."""
        spec = [s for s in scheduled if s.num_spec]
        probs = {s.seq.request_id: self._probs.pop(s.seq.request_id) for s in spec if s.seq.request_id in self._probs}
        if not probs:
            return None
        vocab = next(iter(probs.values())).shape[1]
        rows = []
        for s in spec:
            p = probs.get(s.seq.request_id)
            if p is None:
                p = torch.nn.functional.one_hot(torch.tensor(s.spec_token_ids), vocab).float()
            rows.append(p[:s.num_spec])
        return torch.cat(rows)

    # ------------------------------------------------------------------ after the step
    def observe(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """A sequence verified `num_proposed` drafts and kept `num_accepted`."""
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        self.num_verify_steps += 1
        state = self._seqs.get(seq.request_id)
        if state is None:
            return
        w = self.config.acceptance_weight
        state.rate = (1 - w) * state.rate + w * num_accepted / num_proposed
        if state.rate < self.config.min_acceptance:
            state.off_steps, state.rate = state.backoff, 1.0
            state.backoff = min(2 * state.backoff, self.config.max_backoff_steps)
        elif num_accepted == num_proposed:
            state.backoff = self.config.backoff_steps

    def commit(self, seqs: list[Sequence], running: list[Sequence]) -> None:
        """A step is over: the tokens of its sequences `seqs` are final for now; the proposer
        forgets whatever it holds for sequences no longer `running`."""
        self.proposer.commit(seqs, running)

    def forget_drafts(self, request_id: str) -> None:
        """Drop what the proposer holds for a request (a pipeline fault: it proposes afresh),
        keeping its acceptance history."""
        self._probs.pop(request_id, None)
        self.proposer.drop(request_id)

    def drop(self, request_id: str) -> None:
        """The request finished or was aborted."""
        self._seqs.pop(request_id, None)
        self._probs.pop(request_id, None)
        self.proposer.drop(request_id)

    # ------------------------------------------------------------------ introspection
    def counters(self) -> dict[str, int]:
        """EngineStats fields."""
        return {"spec_draft_tokens_total": self.num_draft_tokens,
                "spec_accepted_tokens_total": self.num_accepted_tokens,
                "spec_verify_steps_total": self.num_verify_steps}

    def check_integrity(self) -> None:
        self.proposer.check_integrity()
