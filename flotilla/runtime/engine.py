"""LLMEngine: the synchronous engine loop. `step()` = schedule -> run -> sample -> postprocess."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from flotilla.errors import FlotillaError
from flotilla.models.tokenizer import Tokenizer

from .block_manager import BlockManager
from .model_runner import StepInput
from .output import OutputProcessor, RequestOutput
from .sampler import SamplerOutput, SamplingBatch
from .sampling import SamplingParams
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .sequence import FinishReason, Sequence

if TYPE_CHECKING:
    from .spec.decoder import SpecDecoder


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int  # KV blocks in the pool, the null block included
    block_size: int = 16
    max_model_len: int = 2048  # capped at what the pool can hold
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    enable_prefix_caching: bool = True

    @property
    def context_len(self) -> int:
        """Longest sequence served: the model's limit, and never more than the whole pool."""
        return min(self.max_model_len, (self.num_blocks - 1) * self.block_size)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float  # fraction of blocks in use (cached free blocks count as free)
    prompt_tokens_total: int  # prompt tokens computed (prefix-cache hits excluded, recomputation included)
    generation_tokens_total: int
    cached_tokens_total: int  # tokens served by the prefix cache at admissions
    preemptions_total: int
    requests_finished_total: dict[str, int]  # by finish reason
    steps_total: int
    spec_draft_tokens_total: int = 0  # speculative decoding: draft tokens verified
    spec_accepted_tokens_total: int = 0  # of those, accepted
    spec_verify_steps_total: int = 0  # sequence-steps that verified at least one draft

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens_total / self.spec_draft_tokens_total if self.spec_draft_tokens_total else 0.0

    @property
    def spec_accepted_tokens_per_step(self) -> float:
        """Drafts accepted per verifying sequence-step (each also yields one token of its own)."""
        return self.spec_accepted_tokens_total / self.spec_verify_steps_total if self.spec_verify_steps_total else 0.0


class Executor(Protocol):
    """What runs a step: a local ModelRunner, or a pipeline of remote stages whose last one samples."""

    def execute(self, step: StepInput) -> SamplerOutput: ...


class LLMEngine:
    """Not thread-safe: one thread drives it (AsyncEngine's engine thread, or a script's loop)."""

    def __init__(self, executor: Executor, config: EngineConfig, tokenizer: Tokenizer | None = None,
                 eos_token_ids: tuple[int, ...] = (), vocab_size: int | None = None,
                 spec: SpecDecoder | None = None):
        self.executor = executor
        self.spec = spec  # speculative decoding: proposes drafts that the executor verifies
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids) or (tokenizer.eos_token_ids if tokenizer else ())
        self.vocab_size = vocab_size
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.outputs = OutputProcessor(tokenizer)
        self.seqs: dict[str, Sequence] = {}
        self.seeds: dict[str, int] = {}
        self._rng = random.Random()
        self._counters = {"prompt": 0, "generation": 0, "steps": 0}
        self._finished: dict[str, int] = {r.value: 0 for r in FinishReason}

    # ------------------------------------------------------------------ requests
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise a FlotillaError if the request can never be served (reads only the config)."""
        n, limit = len(prompt_token_ids), self.config.context_len
        if n == 0:
            raise FlotillaError("the prompt is empty: at least one token is needed")
        if n >= limit:
            raise FlotillaError(f"the prompt has {n} tokens; this engine serves at most {limit - 1} prompt tokens "
                                f"(context {limit}, limited by the model and the KV cache)")
        if self.vocab_size is not None and (min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size):
            raise FlotillaError(f"the prompt holds token ids outside the vocabulary [0, {self.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise FlotillaError("stop strings need a tokenizer; this engine has none")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.seqs:
            raise FlotillaError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        seq = Sequence(request_id, prompt_token_ids, params, self.eos_token_ids, self.config.context_len)
        self.seqs[request_id] = seq
        self.seeds[request_id] = params.seed if params.seed is not None else self._rng.getrandbits(63)
        self.outputs.add(seq)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request now: its blocks go back to the pool before this returns."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        self.seeds.pop(request_id, None)
        self.scheduler.finish(seq, FinishReason.ABORT)
        if self.spec is not None:
            self.spec.drop(request_id)
        self._finished[FinishReason.ABORT.value] += 1
        return self.outputs.aborted(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, self.seeds)
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        result = self.executor.execute(self._step_input(scheduled))
        return self._postprocess(scheduled, result)

    def _step_input(self, out: SchedulerOutput) -> StepInput:
        token_ids, sampling_rows = [], []
        for s in out.scheduled:
            seq = s.seq
            token_ids += seq.token_ids[s.start:s.start + s.num_new_tokens - s.num_spec] + s.spec_token_ids
            if s.samples:  # one row per logits row: after the real tokens, then after each draft
                seed, prompt, output = self.seeds[seq.request_id], seq.prompt_token_ids, seq.output_token_ids
                sampling_rows += [(seq.params, seed, prompt, output + s.spec_token_ids[:i]) for i in range(s.num_spec + 1)]
        speculating = any(s.num_spec for s in out.scheduled)
        return StepInput(
            request_ids=[s.seq.request_id for s in out.scheduled],
            token_ids=token_ids,
            starts=[s.start for s in out.scheduled],
            query_lens=[s.num_new_tokens for s in out.scheduled],
            block_tables=[list(s.seq.block_table) for s in out.scheduled],
            num_decodes=out.num_decodes,
            sample=[s.samples for s in out.scheduled],
            sampling=SamplingBatch.build(sampling_rows),
            spec_token_ids=[s.spec_token_ids for s in out.scheduled] if speculating else None,
            draft_probs=self.spec.draft_probs(out.scheduled) if speculating else None,
        )

    def _postprocess(self, out: SchedulerOutput, result: SamplerOutput) -> list[RequestOutput]:
        self._counters["steps"] += 1
        outputs, row = [], 0
        for s in out.scheduled:
            seq = s.seq
            self._counters["prompt"] += max(0, min(s.start + s.num_new_tokens, seq.num_prompt_tokens) - s.start)
            if not s.samples:
                continue
            accepted = result.accepted[row] if result.accepted else []
            logprob = result.logprobs[row] if result.logprobs else None
            top = result.top_logprobs[row] if result.top_logprobs else None
            tokens = accepted + [result.token_ids[row]]
            row += 1
            if s.num_spec:
                self._roll_back(s, len(accepted))
            outputs.append(self._append(seq, tokens, logprob, top))
        if self.spec is not None:
            self.spec.commit([s.seq for s in out.scheduled if s.samples], self.scheduler.running)
        return outputs

    def _append(self, seq: Sequence, tokens: list[int], logprob, top) -> RequestOutput:
        """Append a step's tokens one at a time, as if each came from its own step: the first
        that finishes the request (eos, stop token or string, max_tokens, context) is the last."""
        merged = None
        for token in tokens:
            seq.append_token(token)
            self._counters["generation"] += 1
            output, reason = self.outputs.token(seq, token, seq.check_stop(token), logprob, top)
            merged = output if merged is None else merged.extend(output)
            if reason is not None:
                self._finish(seq, reason)
                break
        return merged

    def _roll_back(self, s, num_accepted: int) -> None:
        """Forget the KV slots of a speculative step's rejected drafts: the computed tokens end
        at the last accepted one, and the block table shrinks to cover just those."""
        s.seq.num_computed_tokens -= s.num_spec - num_accepted
        self.block_manager.truncate(s.seq)
        if self.spec is not None:
            self.spec.observe(s.seq, s.num_spec, num_accepted)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.finish(seq, reason)
        self.seqs.pop(seq.request_id, None)
        self.seeds.pop(seq.request_id, None)
        self._finished[reason.value] += 1
        if self.spec is not None:
            self.spec.drop(seq.request_id)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            kv_usage=bm.usage,
            prompt_tokens_total=self._counters["prompt"],
            generation_tokens_total=self._counters["generation"],
            cached_tokens_total=self.scheduler.num_cached_tokens_total,
            preemptions_total=self.scheduler.num_preemptions,
            requests_finished_total=dict(self._finished),
            steps_total=self._counters["steps"],
            **(self.spec.counters() if self.spec is not None else {}),
        )

    def check_integrity(self) -> None:
        self.block_manager.check_integrity()
        if self.spec is not None:
            self.spec.check_integrity()
