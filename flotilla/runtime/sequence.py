"""One request's tokens and progress through the engine."""
from __future__ import annotations

import enum
import itertools
import time

from .sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks and is scheduled each step
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS / stop token id / stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # cancelled by the caller


_arrivals = itertools.count()


class Sequence:
    """A request as the scheduler sees it.

    `token_ids` is the prompt followed by the generated tokens. Each step the scheduler lets
    `num_computed_tokens` (tokens whose keys and values sit in the KV cache) catch up with
    `num_tokens`: a whole or partial prompt (chunked prefill), or the one token sampled last
    (decode). Preemption throws the KV away (`num_computed_tokens` = 0) and the sequence is
    recomputed from its tokens later, generated ones included.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), max_model_len: int | None = None):
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        self.request_id = request_id
        self.arrival = next(_arrivals)  # FCFS order
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None  # its first admission (time.monotonic())
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at the last admission
        self.block_table: list[int] = []  # logical block i -> physical block id (kept by the BlockManager)
        self.group_tables: dict[int, list[int]] = {}  # a hybrid model's other groups of layers (HybridBlockManager)
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of token_ids, grown lazily
        self.spec_token_ids: list[int] = []  # draft tokens proposed for the next step (runtime/spec)
        self.num_preemptions = 0
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)  # ending it, as stop tokens do
        self.stop_token_ids = params.end_token_ids(eos_token_ids)
        self.max_model_len = max_model_len
        # per prompt position (None at 0): (logprob, rank, [(token id, logprob) of the likeliest]) of the
        # prompt token there, filled as the prompt's chunks are computed; None when not asked for
        self.prompt_logprobs: list | None = None if params.prompt_logprobs is None else [None] * len(prompt_token_ids)
        self.prompt_logprobs_done = params.prompt_logprobs is None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether the prompt's logprobs are still to compute (then the prefix cache is not read)."""
        return not self.prompt_logprobs_done

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def ends_for_length_after(self, num_new_tokens: int) -> bool:
        """Whether `num_new_tokens` more tokens end the sequence for its length, whatever they are."""
        return (self.num_output_tokens + num_new_tokens >= self.params.max_tokens
                or (self.max_model_len is not None and self.num_tokens + num_new_tokens >= self.max_model_len))

    def check_stop(self, token_id: int) -> FinishReason | None:
        """The finish reason that the token just appended causes, if any (stop strings are
        checked by the output processor, which owns the text)."""
        if token_id in self.stop_token_ids and self.num_output_tokens > self.params.min_tokens:
            return FinishReason.STOP
        if self.num_output_tokens >= self.params.max_tokens:
            return FinishReason.LENGTH
        if self.max_model_len is not None and self.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
