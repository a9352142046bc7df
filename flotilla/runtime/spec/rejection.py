"""Verification of draft tokens: keep the target model's output distribution exactly.

A sequence that brings k drafts d1..dk to a step gets k + 1 rows of target logits: row i is the
target's distribution p_i for the token after d1..di (row 0: after the committed tokens). Each
row is processed as the plain sampler processes it — penalties (counting the drafts before it
as output), temperature, top-k, top-p, min-p — so p_i is what non-speculative sampling would
draw from at that point.

- Greedy rows: d_i+1 is accepted while it equals the argmax of row i; the first mismatch is
  replaced by that argmax. The tokens are those of greedy decoding, whatever the drafts.
- Sampled rows (speculative sampling, Leviathan et al. / Chen et al. 2023): d_i+1, drawn from
  the draft distribution q_i, is accepted with probability min(1, p_i(d) / q_i(d)); the first
  rejected one is replaced by a draw from the normalized max(0, p_i - q_i). A draft without a
  distribution (n-gram lookup) is a point mass, q_i(d) = 1: accepted with probability p_i(d),
  else replaced by a draw from p_i without d. Each token emitted is then distributed as p.
- When every draft is accepted, the last row gives one more token, drawn from p_k.

Randomness: a row's draw (the last row's, or a rejected row's residual) uses the exponential
race of the plain sampler with the same (request seed, token index) generator, so a sequence
without drafts samples exactly the token it would without speculation; the acceptance test
uses a uniform hashed from (request seed, token index) on a separate stream. A seeded request
is reproducible whatever else is in the batch.

One host sync per step (accepted counts and final tokens together).
"""
from __future__ import annotations

import itertools

import torch

from ..sampler import Sampler, SamplerOutput, SamplingBatch, row_seed

_ACCEPT_STREAM = 0x5EC0_ACCE_97ED_0001  # separates acceptance uniforms from the sampling noise


def acceptance_uniform(seed: int, step: int) -> float:
    """U[0, 1) for the acceptance test of the draft for output token `step` of a request."""
    return row_seed(seed ^ _ACCEPT_STREAM, step) / 2.0**63


class RejectionSampler:
    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch, drafts: list[list[int]],
                 draft_probs: torch.Tensor | None = None) -> SamplerOutput:
        """logits [R, V]: 1 + len(drafts[s]) rows per sampling sequence s, in order; batch: one
        row per logits row (steps = the output index each row samples); draft_probs [D, V]:
        the distribution of each of the D drafts (None: point masses). Returns, per sequence,
        the accepted drafts (`accepted`) and the one token after them (`token_ids`)."""
        sampler, dev = self.sampler, logits.device
        raw = logits.float()
        logits = sampler.process_logits(raw, batch) if batch.any_processing else raw
        greedy_ids = logits.max(dim=-1).indices  # [R]
        ks = [len(d) for d in drafts]
        offsets = [0, *itertools.accumulate(ks)][:-1]  # first draft of each sequence
        first = [o + s for s, o in enumerate(offsets)]  # first logits row of each sequence
        last_rows = torch.tensor([f + k for f, k in zip(first, ks)], device=dev)  # [S]
        draft_rows = torch.tensor([f + i for f, k in zip(first, ks) for i in range(k)], dtype=torch.long, device=dev)
        tokens = torch.tensor([t for d in drafts for t in d], dtype=torch.long, device=dev)  # [D]
        if batch.all_greedy:
            candidates = greedy_ids
            target = greedy_ids[draft_rows]
            accept, replacement = target == tokens, target
        else:
            candidates, accept, replacement = self._sampled(logits, greedy_ids, batch, draft_rows, tokens, draft_probs)
        num_accepted = _leading_run(accept, ks, dev)  # [S]
        k = torch.tensor(ks, device=dev)
        final = candidates[last_rows]  # the token after all k drafts, when all are accepted
        if tokens.numel():
            rejected_at = (torch.tensor(offsets, device=dev) + num_accepted).clamp(max=tokens.numel() - 1)
            final = torch.where(num_accepted < k, replacement[rejected_at], final)
        counts, token_ids = torch.stack([num_accepted, final]).tolist()
        accepted = [d[:n] for d, n in zip(drafts, counts)]
        if not batch.any_logprobs:
            return SamplerOutput(token_ids, accepted=accepted)
        # logprobs are served for sequences without drafts only (the engine gives them none)
        rows = [f + n for f, n in zip(first, counts)]
        out = sampler.logprobs(raw[rows], torch.tensor(token_ids, device=dev), token_ids, batch.select(rows))
        return SamplerOutput(token_ids, out.logprobs, out.top_logprobs, accepted)

    def _sampled(self, logits: torch.Tensor, greedy_ids: torch.Tensor, batch: SamplingBatch,
                 draft_rows: torch.Tensor, tokens: torch.Tensor, draft_probs: torch.Tensor | None):
        """(the token each row would sample [R], whether each draft is accepted [D], the token
        that replaces each draft if it is the first rejected [D]) for a batch with sampled rows."""
        dev = logits.device
        greedy = torch.tensor([t == 0 or k == 1 for t, k in zip(batch.temperature, batch.top_k)], device=dev)
        probs = self.sampler.processed_probs(logits, batch)  # [R, V], rows not normalized
        noise = self.sampler.exponentials(logits, batch)  # [R, V], ones on greedy rows
        candidates = torch.where(greedy, greedy_ids, (probs / noise).argmax(dim=-1))
        if tokens.numel() == 0:
            return candidates, tokens.bool(), tokens
        p = probs[draft_rows]
        p = p / p.sum(dim=-1, keepdim=True)  # [D, V]: the target's distribution at each draft
        p_tok = p.gather(1, tokens[:, None])[:, 0]
        if draft_probs is None:  # point masses: q(d) = 1, residual = p without d
            q_tok = torch.ones_like(p_tok)
            residual = p.scatter(1, tokens[:, None], 0.0)
        else:
            q = draft_probs.to(device=dev, dtype=p.dtype)
            q_tok = q.gather(1, tokens[:, None])[:, 0]
            residual = (p - q).clamp_min_(0.0)
        # p == q leaves no residual mass, but then the draft is always accepted; keep p as a guard
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, p, residual)
        rows = draft_rows.tolist()
        u = torch.tensor([acceptance_uniform(batch.seeds[r], batch.steps[r]) for r in rows], dtype=p.dtype, device=dev)
        accept_sampled = u * q_tok < p_tok  # u < p/q without dividing (q(d) > 0 for a drawn draft)
        resampled = (residual / noise[draft_rows]).argmax(dim=-1)
        g = greedy[draft_rows]
        target = greedy_ids[draft_rows]
        accept = torch.where(g, target == tokens, accept_sampled)
        return candidates, accept, torch.where(g, target, resampled)


def _leading_run(accept: torch.Tensor, ks: list[int], dev: torch.device) -> torch.Tensor:
    """Per sequence, how many of its drafts are accepted before the first rejection [S]."""
    S, kmax = len(ks), max(ks, default=0)
    if kmax == 0:
        return torch.zeros(S, dtype=torch.long, device=dev)
    grid = torch.zeros(S, kmax, dtype=torch.long, device=dev)  # [S, Kmax], padding = rejected
    seq = torch.repeat_interleave(torch.arange(S, device=dev), torch.tensor(ks, device=dev))
    pos = torch.cat([torch.arange(k, device=dev) for k in ks])
    grid[seq, pos] = accept.long()
    return grid.cumprod(dim=1).sum(dim=1)
