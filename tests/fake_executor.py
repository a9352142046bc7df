"""A stand-in model for fast engine tests that still checks the KV cache end to end.

It "stores" each new token id in a paged cache at the step's slot mapping (as the model stores
keys and values), and to sample it reads its sequence's whole context back through the block
table: the next token is a hash of that context. A wrong block table, a wrong prefix hit, a
shared block overwritten or a block freed too early changes what is read back, and therefore
the tokens, which tests compare against an unconstrained run.
"""
from __future__ import annotations

import hashlib

import torch

from flotilla.runtime.engine import EngineConfig, LLMEngine
from flotilla.runtime.model_runner import StepInput, prepare_step
from flotilla.runtime.sampler import SamplerOutput
from flotilla.runtime.scheduler import SchedulerConfig


class EchoKVExecutor:
    """`launch` (the engine's overlap) keeps the sampled ids "on the device" (`self.sampled`)
    for the next launched step's `prev_rows`; `rows_alone` answers `same_rows`."""

    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 1000, max_launch_rows: int = 0,
                 rows_alone: bool = True):
        self.block_size, self.vocab_size = block_size, vocab_size
        self.cache = torch.full((num_blocks * block_size,), -1, dtype=torch.long)
        self.steps: list[StepInput] = []
        self.max_launch_rows, self.prefers_overlap, self.rows_alone = max_launch_rows, True, rows_alone
        self.sampled: list[int] = []
        self.num_launched = 0

    def launch(self, step: StepInput) -> "_Done":
        out = self.execute(step)
        self.sampled = out.token_ids
        self.num_launched += 1
        return _Done(out)

    def same_rows(self, num_rows: int, fewer: int) -> bool:
        return self.rows_alone

    def execute(self, step: StepInput) -> SamplerOutput:
        self.steps.append(step)
        positions, meta, _ = prepare_step(step, self.block_size, torch.device("cpu"))
        assert not (meta.slot_mapping < self.block_size).any(), "a token was written to the null block"
        tokens = list(step.token_ids)
        if step.prev_rows is not None:  # tokens the last launched step sampled
            tokens = [self.sampled[r] if r >= 0 else t for t, r in zip(tokens, step.prev_rows)]
        self.cache[meta.slot_mapping] = torch.tensor(tokens)
        out, row = [], 0
        for b, (start, qlen, table) in enumerate(zip(step.starts, step.query_lens, step.block_tables)):
            if not step.sample[b]:
                continue
            n = start + qlen
            pos = torch.arange(n)
            slots = torch.tensor(table)[pos // self.block_size] * self.block_size + pos % self.block_size
            context = self.cache[slots]
            assert (context >= 0).all(), f"{step.request_ids[b]}: read an unwritten slot"
            out.append(echo_next(context.tolist(), self.vocab_size))
            row += 1
        return SamplerOutput(out)


class _Done:
    def __init__(self, out: SamplerOutput):
        self.out = out

    def result(self) -> SamplerOutput:
        return self.out


def echo_next(context: list[int], vocab_size: int) -> int:
    """The token the echo model generates after `context`."""
    digest = hashlib.blake2b(torch.tensor(context, dtype=torch.long).numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % vocab_size


def check_echo_tokens(prompt: list[int], generated: list[int], vocab_size: int = 1000) -> None:
    """Assert that every generated token is what the echo model gives for the true history."""
    ctx = list(prompt)
    for i, t in enumerate(generated):
        assert t == echo_next(ctx, vocab_size), f"token {i} was computed from a corrupted context"
        ctx.append(t)


def echo_engine(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, max_num_batched_tokens: int = 32,
                max_model_len: int = 1 << 20, caching: bool = True, eos: tuple[int, ...] = (),
                vocab_size: int = 1000, overlap: bool = False, rows_alone: bool = True) -> LLMEngine:
    """overlap: the executor launches steps and the engine overlaps them (as on a GPU)."""
    config = EngineConfig(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                          scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens),
                          enable_prefix_caching=caching, overlap=overlap)
    executor = EchoKVExecutor(num_blocks, block_size, vocab_size, max_launch_rows=256 if overlap else 0,
                              rows_alone=rows_alone)
    return LLMEngine(executor, config, eos_token_ids=eos, vocab_size=vocab_size)


def run_all(engine: LLMEngine, max_steps: int = 100_000) -> dict[str, list[int]]:
    """Step until idle; generated tokens per request id. Fails instead of hanging."""
    out: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return out
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError(f"not finished after {max_steps} steps: {engine.stats()}")


class ScriptedExecutor:
    """Generates a fixed script of tokens per request (for text and stop-string tests)."""

    def __init__(self, scripts: dict[str, list[int]]):
        self.scripts = scripts
        self.done: dict[str, int] = {}

    def execute(self, step: StepInput) -> SamplerOutput:
        out = []
        for rid, samples in zip(step.request_ids, step.sample):
            if samples:
                i = self.done.get(rid, 0)
                self.done[rid] = i + 1
                out.append(self.scripts[rid][i])
        return SamplerOutput(out)


def scripted_engine(scripts: dict[str, list[int]], tokenizer, num_blocks: int = 64) -> LLMEngine:
    config = EngineConfig(num_blocks=num_blocks, block_size=16, max_model_len=4096)
    return LLMEngine(ScriptedExecutor(scripts), config, tokenizer=tokenizer)
