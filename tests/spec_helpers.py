"""Speculative decoding on the echo model: a fake target that verifies drafts through the real
rejection sampler, and a proposer whose drafts are right with a given probability.

The echo target (fake_executor.py) stores each new token id in a paged cache at the step's slot
mapping and "predicts" a hash of the context it reads back through the block table. Here it
predicts at every verified position (the real token's and each draft's) and hands one-hot logits
to the real `RejectionSampler`. Rejected drafts leave their ids in the cache: a rollback that
kept their slots counted, a block table that did not shrink, or a block reused while still held
changes what later steps read back, hence the tokens.
"""
from __future__ import annotations

import random

import torch

from fake_executor import EchoKVExecutor, echo_next
from flotilla.runtime.engine import EngineConfig, LLMEngine
from flotilla.runtime.model_runner import StepInput, prepare_step
from flotilla.runtime.sampler import Sampler, SamplerOutput
from flotilla.runtime.scheduler import SchedulerConfig
from flotilla.runtime.sequence import Sequence
from flotilla.runtime.spec.config import SpeculativeConfig
from flotilla.runtime.spec.decoder import SpecDecoder
from flotilla.runtime.spec.proposer import Proposal
from flotilla.runtime.spec.rejection import RejectionSampler


class SpecEchoExecutor(EchoKVExecutor):
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 1000):
        super().__init__(num_blocks, block_size, vocab_size)
        self.verifier = RejectionSampler(Sampler(vocab_size))

    def execute(self, step: StepInput) -> SamplerOutput:
        if step.spec_token_ids is None:
            return super().execute(step)
        self.steps.append(step)
        _, meta = prepare_step(step, self.block_size, torch.device("cpu"))
        assert not (meta.slot_mapping < self.block_size).any(), "a token was written to the null block"
        self.cache[meta.slot_mapping] = torch.tensor(step.token_ids)
        predictions, drafts = [], []
        for b, (start, qlen, table) in enumerate(zip(step.starts, step.query_lens, step.block_tables)):
            if not step.sample[b]:
                continue
            k = len(step.spec_token_ids[b])
            n = start + qlen
            pos = torch.arange(n)
            context = self.cache[torch.tensor(table)[pos // self.block_size] * self.block_size + pos % self.block_size]
            assert (context >= 0).all(), f"{step.request_ids[b]}: read an unwritten slot"
            ctx = context.tolist()
            predictions += [echo_next(ctx[:n - k + i], self.vocab_size) for i in range(k + 1)]
            drafts.append(step.spec_token_ids[b])
        logits = torch.full((len(predictions), self.vocab_size), -30.0)
        logits[torch.arange(len(predictions)), torch.tensor(predictions)] = 30.0
        return self.verifier(logits, step.sampling, drafts, step.draft_probs)


class OracleProposer:
    """Drafts the echo model's own continuation, each token right with probability `hit` (then
    the rest of the draft follows the wrong token's echo); k tokens, or a random number up to k
    with `random_length`. Counts what it proposed."""

    needs_probs = False

    def __init__(self, hit: float, vocab_size: int = 1000, seed: int = 0, random_length: bool = False):
        self.hit, self.vocab_size, self.random_length = hit, vocab_size, random_length
        self.rng = random.Random(seed)
        self.proposed = 0

    def propose(self, seqs: list[Sequence], ks: list[int], seeds: dict[str, int]) -> list[Proposal]:
        out = []
        for seq, k in zip(seqs, ks):
            ctx, drafts = list(seq.token_ids), []
            for _ in range(self.rng.randint(0, k) if self.random_length else k):
                t = echo_next(ctx, self.vocab_size) if self.rng.random() < self.hit else self.rng.randrange(self.vocab_size)
                drafts.append(t)
                ctx.append(t)
            self.proposed += len(drafts)
            out.append(Proposal(drafts))
        return out

    def commit(self, seqs) -> None:
        pass

    def drop(self, request_id: str) -> None:
        pass

    def check_integrity(self) -> None:
        pass


def spec_echo_engine(proposer, k: int = 4, num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                     max_num_batched_tokens: int = 32, caching: bool = True, eos: tuple[int, ...] = (),
                     vocab_size: int = 1000, tokenizer=None, **spec_options) -> LLMEngine:
    config = EngineConfig(num_blocks=num_blocks, block_size=block_size, max_model_len=1 << 20,
                          scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens),
                          enable_prefix_caching=caching)
    spec = SpecDecoder(SpeculativeConfig("ngram", k, **spec_options), proposer)
    return LLMEngine(SpecEchoExecutor(num_blocks, block_size, vocab_size), config, tokenizer=tokenizer,
                     eos_token_ids=eos, vocab_size=vocab_size, spec=spec)


def plain_echo_engine(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                      max_num_batched_tokens: int = 32, caching: bool = True, eos: tuple[int, ...] = (),
                      vocab_size: int = 1000, tokenizer=None) -> LLMEngine:
    """The same engine without speculation: the reference."""
    config = EngineConfig(num_blocks=num_blocks, block_size=block_size, max_model_len=1 << 20,
                          scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens),
                          enable_prefix_caching=caching)
    return LLMEngine(EchoKVExecutor(num_blocks, block_size, vocab_size), config, tokenizer=tokenizer,
                     eos_token_ids=eos, vocab_size=vocab_size)
