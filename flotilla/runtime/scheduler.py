"""Continuous batching with one token budget per step.

Each step every running sequence's `num_computed_tokens` catches up with its `num_tokens` as far
as the budget allows: one token for a decode, a chunk of prompt for a prefill (chunked prefill),
nothing for the tokens a prefix-cache hit already covers. There are no separate prefill and
decode phases.

Policies, each a small method:

- order: running sequences first (decodes before prefill chunks, each by arrival), then
  admissions from the waiting queue in arrival order (FCFS; the head is never skipped, so nothing
  starves behind a later, smaller request).
- admission: bounded by `max_num_seqs`, the token budget, and free blocks (keeping a small
  watermark free for the running sequences' next tokens).
- preemption: when a running sequence needs a block and none is free, the latest-arrived
  running sequence not yet scheduled this step gives its blocks back and is recomputed later
  from its tokens (its full blocks usually survive in the prefix cache).

`num_computed_tokens` advances when a step is scheduled, so a sequence whose token is still
being computed has nothing left to schedule and is skipped (what lets a pipeline keep several
steps in flight).

Speculative decoding: a decode whose sequence carries draft tokens (`seq.spec_token_ids`) is
scheduled with them, 1 + k new tokens, as far as the budget and the free blocks allow (drafts
are dropped before anyone is preempted); the engine rolls `num_computed_tokens` and the block
table back over the rejected ones after the step.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager, HybridBlockManager, HybridBlocks, KVBlocks
from .sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    watermark: float = 0.01  # fraction of blocks kept free when admitting

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # num_computed_tokens before this step: position of the first new token
    num_new_tokens: int  # the draft tokens included
    spec_token_ids: list[int] = field(default_factory=list)  # drafts verified after the last real token

    @property
    def num_spec(self) -> int:
        return len(self.spec_token_ids)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence's tokens (so a token is sampled)."""
        return self.start + self.num_new_tokens - self.num_spec == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes first
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if s.num_new_tokens == 1)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager | HybridBlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()  # arrival order
        self.running: list[Sequence] = []  # arrival order
        self.num_preemptions = 0
        self.num_cached_tokens_total = 0  # tokens served by the prefix cache at admissions
        self.num_queried_tokens_total = 0  # tokens looked up there at admissions

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # stable: decodes first
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        scheduled: set[str] = set()
        for seq in self._running_order():
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            spec = seq.spec_token_ids[:budget - 1] if seq.num_uncomputed_tokens == 1 else []
            while self.block_manager.allocate_slots(seq, n + len(spec)) is None:
                if spec:  # drop the drafts before preempting anyone
                    spec = []
                    continue
                victim = self._pick_victim(scheduled)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self._add(out, seq, n + len(spec), spec)
                scheduled.add(seq.request_id)
                budget -= n + len(spec)
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            computed, num_cached = self.block_manager.get_computed_blocks(seq)
            n = min(seq.num_tokens - num_cached, budget)
            if not self._room_to_admit(seq, n, computed):
                break
            if self.block_manager.allocate_slots(seq, n, computed) is None:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            seq.num_computed_tokens = seq.num_cached_tokens = num_cached
            self.num_cached_tokens_total += num_cached
            if self.block_manager.enable_caching and not seq.needs_prompt_logprobs:  # looked up (as vLLM counts)
                self.num_queried_tokens_total += seq.num_tokens
            self.running.append(seq)
            self._add(out, seq, n)
            budget -= n

    def schedule_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """The decode step after `prev` while `prev` is still being computed (its sampled tokens
        not yet known): what `schedule()` gives once they are, whenever nothing else can change
        it. Each sequence's new token is the one `prev` samples for it. None where something
        could change it: a request waiting, a running sequence outside `prev`, a step of `prev`
        that was not a plain decode, too few free blocks. Sequences that `prev`'s token ends for
        their length are left out; one that a stop token or string ends is known only after `prev`
        is read, and the engine discards its row (runtime/engine.py)."""
        live = [s.seq for s in prev.scheduled if not s.seq.is_finished]
        if self.waiting or len(live) != len(self.running) or any(s.num_new_tokens != 1 for s in prev.scheduled):
            return None
        seqs = [seq for seq in live if not seq.ends_for_length_after(1)]
        bm = self.block_manager
        if not seqs or not bm.has_room_for_decodes(seqs):
            return None
        out = SchedulerOutput()
        for seq in seqs:  # prev's order: the order schedule() keeps (decodes, by arrival)
            bm.allocate_slots(seq, 1)
            self._add(out, seq, 1)
        return out

    # ------------------------------------------------------------------ policies
    def _running_order(self) -> list[Sequence]:
        todo = [s for s in self.running if s.num_uncomputed_tokens > 0]
        return sorted(todo, key=lambda s: s.num_uncomputed_tokens != 1)  # stable: decodes first

    def _pick_victim(self, scheduled: set[str]) -> Sequence:
        """The latest arrival not scheduled this step and not in flight (a sequence whose last
        step is still being computed, in a pipeline, has nothing uncomputed and is kept)."""
        for seq in reversed(self.running):
            if seq.request_id not in scheduled and seq.num_uncomputed_tokens > 0:
                return seq
        raise AssertionError("no sequence left to preempt")

    def _room_to_admit(self, seq: Sequence, num_new_tokens: int, computed: KVBlocks | HybridBlocks) -> bool:
        """Admission keeps a watermark of free blocks for the running sequences' next tokens."""
        return self.block_manager.has_room(seq, num_new_tokens, computed, self.config.watermark if self.running else 0.0)

    @staticmethod
    def _add(out: SchedulerOutput, seq: Sequence, n: int, spec: list[int] | None = None) -> None:
        out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n, spec or []))
        seq.num_computed_tokens += n

    # ------------------------------------------------------------------ state changes
    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def preempt_all(self) -> list[Sequence]:
        """Send every running sequence back to the queue, to be recomputed from its tokens (what a
        pipeline does when a stage has lost its KV cache); returns them."""
        seqs = list(self.running)
        for seq in reversed(seqs):  # appendleft in reverse keeps the arrival order
            self._preempt(seq)
        return seqs

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence (stopped, length, or aborted) and return its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
