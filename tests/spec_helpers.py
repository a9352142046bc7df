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
        self.steps.append(step)
        spec = step.spec_token_ids or [[] for _ in step.request_ids]  # steps without drafts: k = 0 everywhere
        _, meta, _ = prepare_step(step, self.block_size, torch.device("cpu"))
        assert not (meta.slot_mapping < self.block_size).any(), "a token was written to the null block"
        self.cache[meta.slot_mapping] = torch.tensor(step.token_ids)
        predictions, drafts = [], []
        for b, (start, qlen, table) in enumerate(zip(step.starts, step.query_lens, step.block_tables)):
            if not step.sample[b]:
                continue
            k = len(spec[b])
            n = start + qlen
            pos = torch.arange(n)
            context = self.cache[torch.tensor(table)[pos // self.block_size] * self.block_size + pos % self.block_size]
            assert (context >= 0).all(), f"{step.request_ids[b]}: read an unwritten slot"
            ctx = context.tolist()
            predictions += [echo_next(ctx[:n - k + i], self.vocab_size) for i in range(k + 1)]
            drafts.append(spec[b])
        if not predictions:
            return SamplerOutput([])
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

    def commit(self, seqs, running) -> None:
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


# ---------------------------------------------------------------------------------- statistics

def chi2_sf(x: float, dof: int) -> float:
    """P(X > x) for X ~ chi-square(dof): scipy's when installed, else the regularized upper
    incomplete gamma function Q(dof/2, x/2) from torch."""
    try:
        from scipy.stats import chi2
    except ImportError:
        return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                             torch.tensor(x / 2, dtype=torch.float64)))
    return float(chi2.sf(x, dof))


def goodness_of_fit(counts: dict, probs: dict, min_expected: float = 5.0) -> float:
    """p-value of observed counts against exact cell probabilities (Pearson's chi-square); cells
    expected fewer than `min_expected` times are pooled into one."""
    n = sum(counts.values())
    assert set(counts) <= {c for c, p in probs.items() if p > 0}, "a sample fell outside the distribution's support"
    obs, exp, pooled_obs, pooled_exp = [], [], 0, 0.0
    for cell, p in probs.items():
        if n * p >= min_expected:
            obs.append(counts.get(cell, 0))
            exp.append(n * p)
        else:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += n * p
    if pooled_exp > 0:
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return chi2_sf(stat, len(obs) - 1)


def two_sample(a: dict, b: dict, min_count: int = 10) -> float:
    """p-value that two samples come from one distribution (chi-square test of homogeneity on a
    2 x cells table; cells seen fewer than `min_count` times in both together are pooled)."""
    cells = sorted(set(a) | set(b), key=lambda c: -(a.get(c, 0) + b.get(c, 0)))
    rows = [[], []]
    rest = [0, 0]
    for c in cells:
        if a.get(c, 0) + b.get(c, 0) >= min_count:
            rows[0].append(a.get(c, 0))
            rows[1].append(b.get(c, 0))
        else:
            rest[0] += a.get(c, 0)
            rest[1] += b.get(c, 0)
    if sum(rest):
        rows[0].append(rest[0])
        rows[1].append(rest[1])
    na, nb = sum(rows[0]), sum(rows[1])
    stat = 0.0
    for oa, ob in zip(*rows):
        col = oa + ob
        for o, n in ((oa, na), (ob, nb)):
            e = col * n / (na + nb)
            stat += (o - e) ** 2 / e
    return chi2_sf(stat, len(rows[0]) - 1)
