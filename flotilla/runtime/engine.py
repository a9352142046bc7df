"""LLMEngine: the engine loop. `step()` = schedule -> run -> sample -> postprocess.

Overlap (on by default where the executor prefers it: a GPU). A decode step whose sampling needs
nothing from the host is launched (`executor.launch`): its sampled ids stay on the device and go
to the host behind an event. Before waiting for them the engine schedules the next decode of the
same sequences (`Scheduler.schedule_ahead`) and launches it too, its input tokens read on the
device from the step before; then it reads the first step's ids, detokenizes and checks stops
while the second runs. So in a steady decode the host's work for a step hides behind the GPU's
work for the one before. Whatever could make the next schedule differ falls back to the plain
synchronous step: an arrival, a sequence outside the step, preemption, prefill chunks,
speculation, penalties or logprobs, too few free blocks.

A sequence that a stop token or string ends (known only once its step is read) has already been
scheduled into the step after: its row there is discarded, and its blocks are freed at once (the
device runs the steps in order, so nothing later sees them before that step has written). The
other rows are kept where the executor says each row is computed alone at both batch sizes
(`same_rows`: the same CUDA graph bucket); otherwise that step is cancelled (its sequences'
computed tokens and blocks rolled back) and recomputed without the finished sequence, so the
tokens are always those of the synchronous engine. An abort between steps is handled the same way.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from flotilla.errors import FlotillaError
from flotilla.models.tokenizer import Tokenizer

from .block_manager import BlockManager, HybridBlockManager
from .model_runner import LaunchedStep, StepInput
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
    overlap: bool | None = None  # launch each decode before the last one's tokens are read (None: where the executor prefers it)
    # every layer attends within this many tokens (ModelConfig.kv_window; 0: not so): the blocks behind it are given back
    sliding_window: int = 0
    # a hybrid cache (HybridBlockManager): each group of layers' sliding window (0: the whole context), group 0's
    # table the sequences' block_table; (): one table a sequence
    group_windows: tuple[int, ...] = ()

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
    cache_queried_tokens_total: int  # prompt tokens looked up in the prefix cache at admissions
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


class LaunchingExecutor(Executor, Protocol):
    """An executor that can also start a step without waiting for its tokens (ModelRunner)."""

    max_launch_rows: int  # the most sequences a launched step holds (0: it launches none)
    prefers_overlap: bool  # whether overlapping steps pays here

    def launch(self, step: StepInput) -> LaunchedStep: ...

    def same_rows(self, num_rows: int, fewer: int) -> bool: ...


@dataclass(frozen=True)
class _Launched:
    """A launched step whose tokens have not been read yet."""

    scheduled: SchedulerOutput
    sampling: SamplingBatch
    step: LaunchedStep


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
        if config.group_windows:
            self.block_manager = HybridBlockManager(config.num_blocks, config.group_windows, config.block_size,
                                                    config.enable_prefix_caching)
        else:
            self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                              config.sliding_window)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.outputs = OutputProcessor(tokenizer)
        self.seqs: dict[str, Sequence] = {}
        self.seeds: dict[str, int] = {}
        self._rng = random.Random()
        self._counters = {"prompt": 0, "generation": 0, "steps": 0}
        self._finished: dict[str, int] = {r.value: 0 for r in FinishReason}
        want = config.overlap if config.overlap is not None else getattr(executor, "prefers_overlap", False)
        self.overlap = bool(want) and spec is None and getattr(executor, "max_launch_rows", 0) > 0
        self._ahead: _Launched | None = None  # launched before the step before it was read

    # ------------------------------------------------------------------ requests
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise a FlotillaError if the request can never be served (reads only the config)."""
        n, limit = len(prompt_token_ids), self.config.context_len
        if n == 0:
            raise FlotillaError("the prompt is empty: at least one token is needed")
        if n >= limit + (params.max_tokens == 0):  # a prompt only scored (max_tokens 0) may fill the context
            raise FlotillaError(f"the prompt has {n} tokens; this engine serves at most {limit - 1} prompt tokens "
                                f"(context {limit}, limited by the model and the KV cache)")
        if self.vocab_size is not None and (min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size):
            raise FlotillaError(f"the prompt holds token ids outside the vocabulary [0, {self.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise FlotillaError("stop strings need a tokenizer; this engine has none")
        if params.prompt_logprobs is not None and not getattr(self.executor, "computes_prompt_logprobs", False):
            raise FlotillaError("prompt logprobs (echo with logprobs, prompt_logprobs) are not computed by this "
                                "engine's executor; leave them out")

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
        if self._ahead is not None:
            launched = self._take_ahead()
            if launched is not None:
                return self._read(launched)
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, self.seeds)
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        step = self._step_input(scheduled)
        if self._launches(scheduled, step):
            return self._read(_Launched(scheduled, step.sampling, self.executor.launch(step)))
        result = self.executor.execute(step)
        return self._postprocess(scheduled, result)

    # ------------------------------------------------------------------ overlap
    def _launches(self, out: SchedulerOutput, step: StepInput) -> bool:
        """Whether to launch this step (then the next can be launched before its tokens are read):
        plain decodes that all sample, sampling that reads no earlier tokens and reports no logprobs."""
        return (self.overlap and step.num_seqs <= self.executor.max_launch_rows and all(step.sample)
                and all(s.num_new_tokens == 1 and not s.num_spec for s in out.scheduled)
                and not step.sampling.any_penalty and not step.sampling.any_logprobs)

    def _read(self, current: _Launched) -> list[RequestOutput]:
        """`current` is launched: launch the decode after it, then wait for `current`'s tokens and
        postprocess them while that one runs."""
        ahead = self.scheduler.schedule_ahead(current.scheduled)
        if ahead is not None:  # current's sequences and parameters: launchable as current was
            step = self._ahead_input(ahead, current)
            self._ahead = _Launched(ahead, step.sampling, self.executor.launch(step))
        return self._postprocess(*_live(current.scheduled, self._wait(current)))

    def _wait(self, launched: _Launched) -> SamplerOutput:
        """The launched step's tokens: the one host wait of an overlapped step (its own method so
        that bench/step_host.py can time it)."""
        return launched.step.result()

    def _take_ahead(self) -> _Launched | None:
        """The step launched ahead, if its rows still serve: None when every sequence in it has
        ended, or when one has and the others' rows would not be what a step without it gives
        (then it is cancelled and the step is scheduled afresh)."""
        launched, self._ahead = self._ahead, None
        rows = launched.scheduled.scheduled
        live = sum(1 for s in rows if not s.seq.is_finished)
        if live == len(rows):
            return launched
        if live and self.executor.same_rows(len(rows), live):
            return launched
        for s in rows:  # cancelled: its sequences' tokens and blocks go back to before it
            if not s.seq.is_finished:
                s.seq.num_computed_tokens = s.start
                self.block_manager.truncate(s.seq)
        return None

    def _ahead_input(self, out: SchedulerOutput, prev: _Launched) -> StepInput:
        """The input of a decode step scheduled while `prev` is running: each sequence's token is
        the one `prev` samples for it, read on the device from prev's row."""
        row = {id(s.seq): r for r, s in enumerate(prev.scheduled.scheduled)}
        seqs = [s.seq for s in out.scheduled]
        n = len(seqs)
        if n == len(row) and all(s.seq is p.seq for s, p in zip(out.scheduled, prev.scheduled.scheduled)):
            sampling = replace(prev.sampling, steps=[k + 1 for k in prev.sampling.steps])  # one token later
        else:
            sampling = SamplingBatch.build([(seq.params, self.seeds[seq.request_id], [], []) for seq in seqs],
                                           steps=[seq.num_output_tokens + 1 for seq in seqs],
                                           eos_token_ids=self.eos_token_ids)
        return StepInput(
            request_ids=[seq.request_id for seq in seqs],
            token_ids=[0] * n,
            starts=[s.start for s in out.scheduled],
            query_lens=[1] * n,
            block_tables=[seq.block_table for seq in seqs],
            group_tables=self._group_tables(seqs),
            num_decodes=n,
            sample=[True] * n,
            sampling=sampling,
            prev_rows=[row[id(seq)] for seq in seqs],
        )

    def _group_tables(self, seqs: list[Sequence]) -> list[list[list[int]]] | None:
        """A hybrid cache's tables of groups 1, 2, ... (StepInput.group_tables)."""
        groups = range(1, len(self.config.group_windows))
        return [[seq.group_tables[g] for seq in seqs] for g in groups] if groups else None

    # ------------------------------------------------------------------ steps
    def _step_input(self, out: SchedulerOutput) -> StepInput:
        token_ids, sampling_rows, steps = [], [], []
        for s in out.scheduled:
            seq = s.seq
            if s.num_new_tokens == 1 and not s.num_spec:
                token_ids.append(seq.token_ids[s.start])
            else:
                token_ids += seq.token_ids[s.start:s.start + s.num_new_tokens - s.num_spec] + s.spec_token_ids
            if s.samples:  # one row per logits row: after the real tokens, then after each draft
                params, seed, pen = seq.params, self.seeds[seq.request_id], seq.params.has_penalty
                prompt = seq.prompt_token_ids if pen else []  # the ids are read only under a penalty
                output = seq.output_token_ids if pen else []
                for i in range(s.num_spec + 1):
                    sampling_rows.append((params, seed, prompt, output + s.spec_token_ids[:i] if pen else []))
                    steps.append(seq.num_output_tokens + i)
        speculating = any(s.num_spec for s in out.scheduled)
        prompt = [_prompt_targets(s) for s in out.scheduled]
        return StepInput(
            request_ids=[s.seq.request_id for s in out.scheduled],
            token_ids=token_ids,
            starts=[s.start for s in out.scheduled],
            query_lens=[s.num_new_tokens for s in out.scheduled],
            block_tables=[s.seq.block_table for s in out.scheduled],  # replaced when they grow, never changed in place
            group_tables=self._group_tables([s.seq for s in out.scheduled]),
            num_decodes=out.num_decodes,
            sample=[s.samples for s in out.scheduled],
            sampling=SamplingBatch.build(sampling_rows, steps, self.eos_token_ids),
            spec_token_ids=[s.spec_token_ids for s in out.scheduled] if speculating else None,
            draft_probs=self.spec.draft_probs(out.scheduled) if speculating else None,
            prompt_logprobs=prompt if any(ids for _, ids in prompt) else None,
        )

    def _postprocess(self, out: SchedulerOutput, result: SamplerOutput) -> list[RequestOutput]:
        self._counters["steps"] += 1
        outputs, row = [], 0
        sampled = [s.seq for s in out.scheduled if s.samples]  # before the appends below change `samples`
        for b, s in enumerate(out.scheduled):
            seq = s.seq
            self._counters["prompt"] += max(0, min(s.start + s.num_new_tokens, seq.num_prompt_tokens) - s.start)
            if result.prompt_logprobs is not None and result.prompt_logprobs[b]:
                got = result.prompt_logprobs[b]
                seq.prompt_logprobs[s.start + 1:s.start + 1 + len(got)] = got
            if not s.samples:
                continue
            if seq.params.max_tokens == 0:  # the prompt only: the sampled token is not kept
                row += 1
                outputs.append(self._prompt_only(seq))
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
            self.spec.commit(sampled, self.scheduler.running)
        return outputs

    def _append(self, seq: Sequence, tokens: list[int], logprob, top) -> RequestOutput:
        """Append a step's tokens one at a time, as if each came from its own step: the first
        that finishes the request (eos, stop token or string, max_tokens, context) is the last."""
        merged = None
        for token in tokens:
            seq.append_token(token)
            self._counters["generation"] += 1
            output, reason = self.outputs.token(seq, token, seq.check_stop(token), logprob, top)
            if not seq.prompt_logprobs_done:  # the first output after the prompt carries its logprobs
                output.prompt_logprobs, seq.prompt_logprobs_done = seq.prompt_logprobs, True
            merged = output if merged is None else merged.extend(output)
            if reason is not None:
                self._finish(seq, reason)
                break
        return merged

    def _prompt_only(self, seq: Sequence) -> RequestOutput:
        """A request for no tokens (max_tokens 0, as echo does to score a prompt) ends once its prompt is
        computed: its output holds no token, and the prompt's logprobs where asked for."""
        output = self.outputs.prompt_only(seq)
        output.prompt_logprobs, seq.prompt_logprobs_done = seq.prompt_logprobs, True
        self._finish(seq, FinishReason.LENGTH)
        return output

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
            cache_queried_tokens_total=self.scheduler.num_queried_tokens_total,
            preemptions_total=self.scheduler.num_preemptions,
            requests_finished_total=dict(self._finished),
            steps_total=self._counters["steps"],
            **(self.spec.counters() if self.spec is not None else {}),
        )

    def check_integrity(self) -> None:
        self.block_manager.check_integrity()
        if self.spec is not None:
            self.spec.check_integrity()


def _prompt_targets(s) -> tuple[int, list[int]]:
    """A scheduled sequence's StepInput.prompt_logprobs entry: its k, and the prompt tokens its rows
    predict (the row at position p predicts the token at p + 1, up to the prompt's last)."""
    seq = s.seq
    if not seq.needs_prompt_logprobs or s.start >= seq.num_prompt_tokens - 1:
        return 0, []
    end = min(s.start + s.num_new_tokens, seq.num_prompt_tokens - 1)
    return seq.params.prompt_logprobs, seq.token_ids[s.start + 1:end + 1]


def _live(out: SchedulerOutput, result: SamplerOutput) -> tuple[SchedulerOutput, SamplerOutput]:
    """A launched step (every sequence samples one token) without the rows of sequences that
    ended while it ran."""
    keep = [r for r, s in enumerate(out.scheduled) if not s.seq.is_finished]
    if len(keep) == len(out.scheduled):
        return out, result
    return SchedulerOutput([out.scheduled[r] for r in keep]), SamplerOutput([result.token_ids[r] for r in keep])
