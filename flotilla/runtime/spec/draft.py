"""A draft model that proposes tokens for the target to verify, with its own paged KV cache.

The draft keeps, per request, the KV of a prefix of the request's tokens (its own block table
over its own pool; no prefix caching). To propose k tokens for a sequence of n committed tokens
it runs k batched passes over all proposing sequences:

    pass 1:      the committed tokens it has not seen yet (usually one or two)  -> d1
    pass i > 1:  d(i-1) at position n + i - 2                                  -> di

so after proposing, its cache holds n + k - 1 tokens: the committed ones and d1..d(k-1).
`commit`, after the target's verification, keeps the KV of the drafts that were accepted (the
committed tokens now continue with them) and gives back the slots of the rest, so the next
proposal starts from a cache that agrees with the committed tokens. A proposal settles the
sequence the same way first, so drafts that were never verified (not scheduled, or lost in a
pipeline fault) leave nothing behind; a sequence whose verify step is in flight is neither
proposed for nor committed until its tokens come back.

Drafts for greedy requests are the draft's argmax (point masses). For sampled requests each
draft is drawn from the draft's processed distribution (the request's penalties, temperature,
top-k, top-p, min-p applied to the draft's logits) with its own seeded stream, and that
distribution goes with the proposal for the rejection sampler.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flotilla.errors import FlotillaError

from ..block_manager import BlockManager
from ..kv_cache import KVCache
from ..model_runner import ModelRunner, StepInput
from ..sampler import SamplingBatch
from ..sequence import Sequence
from .proposer import Proposal

_DRAFT_STREAM = 0xD2AF_7000_5EED_0001  # the draft's sampling noise, apart from the target's


class _DraftSeq:
    """What the draft's BlockManager tracks of a request: the tokens whose KV its cache holds."""

    __slots__ = ("request_id", "num_computed_tokens", "block_table", "block_hashes", "base", "fed")

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.num_computed_tokens = 0  # KV in the draft cache for positions [0, num_computed_tokens)
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # unused: the draft pool caches no prefixes
        self.base = 0  # committed tokens when the last proposal was made
        self.fed: list[int] = []  # drafts whose KV sits at positions base, base + 1, ...


@dataclass
class _Pass:
    """One batched draft forward: which sequences, their input tokens and first positions."""

    seqs: list[Sequence]
    states: list[_DraftSeq]
    tokens: list[list[int]]


class DraftProposer:
    needs_probs = True

    def __init__(self, model, cache: KVCache, num_blocks: int, graph_sizes: tuple[int, ...] = (),
                 graph_query_len: int = 1, max_model_len: int | None = None):
        """`graph_sizes`, `graph_query_len`, `max_model_len`: the draft's CUDA graphs (ModelRunner):
        its passes of one or a few tokens a sequence replay them instead of launching eagerly."""
        # freezes the model; its sampler processes draft logits
        self.runner = ModelRunner(model, cache, graph_sizes=graph_sizes, max_model_len=max_model_len,
                                  graph_query_len=graph_query_len)
        self.cache = cache
        self.block_size = cache.spec.block_size
        # no sliding-window release: a round's later passes would give back blocks that a rollback to its first
        # accepted token reads again
        self.blocks = BlockManager(num_blocks, self.block_size, enable_caching=False)
        self.states: dict[str, _DraftSeq] = {}
        self.vocab_size = model.config.vocab_size

    # ------------------------------------------------------------------ proposing
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int], seeds: dict[str, int]) -> list[Proposal]:
        want = {s.request_id: k for s, k in zip(seqs, ks)}
        drafts: dict[str, list[int]] = {s.request_id: [] for s in seqs}
        probs: dict[str, list[torch.Tensor]] = {s.request_id: [] for s in seqs}
        first = _Pass([], [], [])
        for seq in seqs:
            state = self.states.setdefault(seq.request_id, _DraftSeq(seq.request_id))
            self._settle(seq, state)
            first.seqs.append(seq)
            first.states.append(state)
            first.tokens.append(seq.token_ids[state.num_computed_tokens:])
        step = first
        for i in range(max(ks)):
            step = self._run(step, seeds, drafts, probs)
            nxt = _Pass([], [], [])
            for seq, state in zip(step.seqs, step.states):
                if len(drafts[seq.request_id]) < want[seq.request_id]:
                    nxt.seqs.append(seq)
                    nxt.states.append(state)
                    nxt.tokens.append(drafts[seq.request_id][-1:])
            if not nxt.seqs:
                break
            step = nxt
        out = []
        for seq in seqs:
            d, p = drafts[seq.request_id], probs[seq.request_id]
            out.append(Proposal(d, torch.stack(p) if p and not seq.params.greedy else None))
        return out

    def _run(self, step: _Pass, seeds, drafts, probs) -> _Pass:
        """One forward of the draft over a pass; appends one draft to each sequence that got its
        slots (a sequence the draft pool has no room for is dropped from this proposal)."""
        kept = _Pass([], [], [])
        for seq, state, tokens in zip(step.seqs, step.states, step.tokens):
            if self.blocks.allocate_slots(state, len(tokens)) is None:
                self.drop(seq.request_id)  # recomputed from scratch later, when blocks are free
                continue
            kept.seqs.append(seq)
            kept.states.append(state)
            kept.tokens.append(tokens)
        if not kept.seqs:
            return kept
        order = sorted(range(len(kept.seqs)), key=lambda b: len(kept.tokens[b]) != 1)  # decodes first
        kept = _Pass([kept.seqs[b] for b in order], [kept.states[b] for b in order], [kept.tokens[b] for b in order])
        inp = StepInput(
            request_ids=[s.request_id for s in kept.seqs],
            token_ids=[t for ts in kept.tokens for t in ts],
            starts=[st.num_computed_tokens for st in kept.states],
            query_lens=[len(ts) for ts in kept.tokens],
            block_tables=[list(st.block_table) for st in kept.states],
            num_decodes=sum(1 for ts in kept.tokens if len(ts) == 1),
            sample=[True] * len(kept.seqs),
        )
        logits = self.runner.logits(inp)
        rows = [(s.params, seeds[s.request_id] ^ _DRAFT_STREAM, s.prompt_token_ids,
                 s.output_token_ids + drafts[s.request_id]) for s in kept.seqs]
        eos = tuple(set().union(*(s.eos_token_ids for s in kept.seqs)))  # masked below a row's min_tokens
        tokens, q = self._sample(logits, SamplingBatch.build(rows, eos_token_ids=eos))
        for b, (seq, state, fed) in enumerate(zip(kept.seqs, kept.states, kept.tokens)):
            if state.num_computed_tokens < seq.num_tokens:  # the first pass: catching up
                state.base, state.fed = seq.num_tokens, []
            else:
                state.fed += fed
            state.num_computed_tokens += len(fed)
            drafts[seq.request_id].append(tokens[b])
            if q is not None:
                probs[seq.request_id].append(q[b])
        return kept

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[list[int], torch.Tensor | None]:
        """Draft tokens, and for a batch with sampled rows the normalized distributions [B, V]
        they were drawn from (greedy rows: a point mass on the argmax)."""
        sampler = self.runner.sampler
        logits = sampler.process_logits(logits.float(), batch) if batch.any_processing else logits.float()
        ids = logits.max(dim=-1).indices
        if batch.all_greedy:
            return ids.tolist(), None
        greedy = torch.tensor([t == 0 or k == 1 for t, k in zip(batch.temperature, batch.top_k)], device=ids.device)
        probs = sampler.processed_probs(logits, batch)
        ids = torch.where(greedy, ids, (probs / sampler.exponentials(logits, batch)).argmax(dim=-1))
        q = probs / probs.sum(dim=-1, keepdim=True)
        q = torch.where(greedy[:, None], torch.nn.functional.one_hot(ids, q.shape[1]).to(q.dtype), q)
        return ids.tolist(), q

    # ------------------------------------------------------------------ after verification
    def commit(self, seqs: list[Sequence], running: list[Sequence]) -> None:
        """Keep the KV of the accepted drafts of `seqs`, free the rest; forget sequences no longer
        running (preempted ones catch up again when they are back)."""
        live = {s.request_id for s in running}
        for rid in [r for r in self.states if r not in live]:
            self.drop(rid)
        for seq in seqs:
            state = self.states.get(seq.request_id)
            if state is not None:
                self._settle(seq, state)

    def _settle(self, seq: Sequence, state: _DraftSeq) -> None:
        """Make the cache agree with the sequence's tokens: of the drafts fed after `base`, keep
        those that the tokens now continue with; the last token is always fed again (its logits
        give the next draft)."""
        valid = state.num_computed_tokens
        if state.fed:
            kept = 0
            tail = seq.token_ids[state.base:state.base + len(state.fed)]
            while kept < len(tail) and tail[kept] == state.fed[kept]:
                kept += 1
            valid, state.fed = state.base + kept, []
        if valid != state.num_computed_tokens or valid > seq.num_tokens - 1:
            state.num_computed_tokens = min(valid, seq.num_tokens - 1)
            self.blocks.truncate(state)

    def drop(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.blocks.free(state)

    def check_integrity(self) -> None:
        self.blocks.check_integrity()


def check_compatible(target_vocab: int, draft_vocab: int, where: str) -> None:
    if target_vocab != draft_vocab:
        raise FlotillaError(f"{where}: the draft model's vocabulary has {draft_vocab} tokens, the target's "
                            f"{target_vocab}; a draft must share the target's tokenizer")
