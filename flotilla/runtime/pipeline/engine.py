"""`PipelineEngine`: the LLMEngine over a pipeline of remote stages, several micro-batches in flight.

The scheduler already never schedules a sequence whose step is still being computed (its
`num_computed_tokens` advances when the step is scheduled, and a decode has nothing uncomputed
until its token comes back). So `step()` here is:

    fill:     while fewer than `depth` micro-batches are in flight, schedule the sequences that
              are ready and submit them, cut into micro-batches of about running / depth
              sequences (contiguous runs of the schedule, so within-step prefix hits keep their
              writer first);
    collect:  wait briefly for any micro-batch to come back and postprocess it as the local
              engine does (a sequence finished or aborted meanwhile is skipped).

Every stage runs the steps in the order the head sent them, which is what keeps KV writes before
the reads that depend on them, as in the local engine.

Overlap (one micro-batch in flight: stages that share a GPU; on by default there, `--no-overlap`
turns it off), as the local engine's (runtime/engine.py): a plain decode step is sent with
`feed`, and at once the decode after it (`Scheduler.schedule_ahead`), whose input tokens are
"the ids the last stage samples for the step before" (`prev_rows`): stage 0 holds it until the
last stage has sent it those ids, so the ring turns stage 0 -> ... -> last -> stage 0 while the
head reads the step before, detokenizes it and checks its stops. Whatever could change the next
schedule (an arrival, preemption, a prefill chunk, penalties, logprobs) takes the plain path. A
sequence that a stop ends (or an abort) is known only once the step before is read: the step
sent ahead is then dropped (its result ignored, its other sequences' tokens and blocks rolled
back) and they are scheduled afresh, so the tokens are always those of the plain ring. The
dropped step's writes land in slots that are written again, or in blocks freed behind it: every
stage runs steps in the order sent, so nothing later reads them.

Speculative decoding: the head proposes (n-gram lookup, or a draft model on its own KV cache
here) before each schedule, for the sequences that are not in flight; a verifying sequence's
1 + k tokens travel the ring like a short prefill chunk, the last stage verifies them with the
same rejection sampler, and the head rolls the rejected drafts' slots back and commits the
proposer per micro-batch when its result comes back. Draft distributions ride in the step frame
as float32; a micro-batch is cut short so they never take more than a quarter of the frame
limit, and no sequence proposes more sampled drafts than that quarter holds.

Faults (the pipeline's `generation` changed): everything in flight is lost; every running
sequence goes back to the queue to be re-prefilled from its tokens so far (prompt + generated),
and the prefix cache is forgotten (a restarted stage has none of it); the proposer forgets the
paused sequences (a draft model's KV included) and proposes afresh once they decode again.
Greedy and seeded sampling continue with the same tokens, since a token's random draw depends
only on its request's seed and its index (with speculation, a seeded sampled token also depends
on which drafts were verified with it: the lost verify step becomes a plain one, so from there
the tokens are a different draw of the same distribution). While the ring is down nothing is
scheduled; past `stage_timeout` seconds every request ends with an error naming the missing
stage, and new requests get the same answer until the stage is back.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from flotilla.runtime.engine import EngineConfig, LLMEngine, _Launched
from flotilla.runtime.output import RequestOutput
from flotilla.runtime.sampler import SamplerOutput
from flotilla.runtime.scheduler import SchedulerOutput
from flotilla.runtime.sequence import FinishReason, Sequence
from flotilla.runtime.spec.decoder import SpecDecoder

from .executor import PipelineExecutor

log = logging.getLogger("flotilla.pipeline")

POLL_SECONDS = 0.05  # longest wait for a result before step() returns (new requests are admitted between)


class PipelineEngine(LLMEngine):
    def __init__(self, executor: PipelineExecutor, config: EngineConfig, tokenizer=None,
                 eos_token_ids: tuple[int, ...] = (), vocab_size: int | None = None, stage_timeout: float = 60.0,
                 spec: SpecDecoder | None = None):
        super().__init__(executor, config, tokenizer, eos_token_ids, vocab_size, spec)
        if spec is not None and vocab_size:
            spec.max_prob_rows = max(1, executor.max_prob_bytes // (4 * vocab_size))
        self.stage_timeout = stage_timeout
        self._inflight: dict[int, SchedulerOutput] = {}
        self._generation = executor.generation
        self.num_rewinds = 0
        self.overlap = self.overlap and executor.depth == 1
        self._early: dict[int, SamplerOutput] = {}  # the result of the step sent ahead, before it is kept
        self.num_ahead = 0  # decodes sent before the step before them was read
        self.num_dropped = 0  # of those, dropped (a sequence in them ended)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        ex = self.executor
        if ex.generation != self._generation:
            self._rewind()
        if not ex.ready:
            return self._while_down()
        outputs = []
        if self._ahead is not None and not self._inflight:
            outputs += self._keep_ahead()
        self._fill()
        for mb, result in ex.results(POLL_SECONDS if self._inflight or self._ahead else 0.0):
            piece = self._inflight.pop(mb, None)
            if piece is not None:
                outputs += self._postprocess(*_live(piece, result))
            elif self._ahead is not None and mb == self._ahead.step.mb:
                self._early[mb] = result
        return outputs

    def _fill(self) -> None:
        ex = self.executor
        while len(self._inflight) < ex.depth and self._ahead is None:
            if self.spec is not None:
                self.spec.propose(self.scheduler.running, self.seeds)
            scheduled = self.scheduler.schedule()
            if not scheduled:
                return
            for piece in self._pieces(scheduled):
                step = self._step_input(piece)
                feed = self.overlap and self._launches(piece, step)
                mb = ex.submit(step, self._generation, feed=feed)
                self._inflight[mb] = piece
                if feed:
                    self._send_ahead(_Launched(piece, step.sampling, _Sent(mb)))

    # ------------------------------------------------------------------ overlap
    def _send_ahead(self, current: _Launched) -> None:
        """`current` is sent: send the decode after it too, its tokens those current samples."""
        ahead = self.scheduler.schedule_ahead(current.scheduled)
        if ahead is not None:
            step = self._ahead_input(ahead, current)
            mb = self.executor.submit(step, self._generation, prev_mb=current.step.mb, feed=True)
            self._ahead = _Launched(ahead, step.sampling, _Sent(mb))
            self.num_ahead += 1

    def _keep_ahead(self) -> list[RequestOutput]:
        """The step before the one sent ahead has been read: keep that one (and send the next
        ahead of it), or drop it if a sequence in it has ended (LLMEngine._take_ahead rolls the
        others back; the executor ignores its result)."""
        mb = self._ahead.step.mb
        kept = self._take_ahead()
        early = self._early.pop(mb, None)
        if kept is None:
            self.executor.discard(mb)
            self.num_dropped += 1
            return []
        self._send_ahead(kept)
        if early is None:  # still on the ring: collected as any step in flight
            self._inflight[mb] = kept.scheduled
            return []
        return self._postprocess(*_live(kept.scheduled, early))

    def _pieces(self, scheduled: SchedulerOutput) -> list[SchedulerOutput]:
        """Micro-batches: contiguous runs of about running / depth sequences, each cut short
        before its draft distributions pass the executor's byte budget."""
        size = max(1, -(-len(self.scheduler.running) // self.executor.depth))
        budget = self.executor.max_prob_bytes if self.spec is not None else 0
        pieces, piece, nbytes = [], [], 0
        for s in scheduled.scheduled:
            b = self.spec.prob_bytes(s) if self.spec is not None else 0
            if piece and (len(piece) == size or nbytes + b > budget):
                pieces.append(SchedulerOutput(piece))
                piece, nbytes = [], 0
            piece.append(s)
            nbytes += b
        pieces.append(SchedulerOutput(piece))
        return pieces

    # ------------------------------------------------------------------ faults
    def _rewind(self) -> None:
        self._inflight.clear()
        self._ahead = None
        self._early.clear()
        self.executor.reset()
        seqs = self.scheduler.preempt_all()
        self.block_manager.reset_prefix_cache()
        if self.spec is not None:
            for seq in seqs:
                self.spec.forget_drafts(seq.request_id)
        self._generation = self.executor.generation
        self.num_rewinds += 1
        log.warning("pipeline fault: %d running requests paused; they are re-prefilled once it is back", len(seqs))

    def _while_down(self) -> list[RequestOutput]:
        since = self.executor.down_since
        if since is not None and time.monotonic() - since > self.stage_timeout and self.has_unfinished():
            return self._fail_all(self.executor.describe_down())
        self.executor.wait_ready(0.1)
        return []

    def _fail_all(self, reason: str) -> list[RequestOutput]:
        outputs = []
        since = self.executor.down_since
        stopped = 0
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            out = self.outputs.aborted(seq)
            if since is not None and seq.arrival_time >= since:  # it came while the pipeline was down
                out.error = (f"{reason}; the pipeline has been down for {time.monotonic() - since:.1f}s, so the "
                             f"request was refused")
            else:
                stopped += 1
                out.error = (f"{reason}; the request was stopped after {seq.num_output_tokens} generated tokens "
                             f"(the stage did not come back within --stage-timeout {self.stage_timeout:g}s)")
            self._finish(seq, FinishReason.ABORT)
            outputs.append(out)
        if stopped:  # the clients are told; the log says it once (the ones refused later get the same answer)
            log.warning("pipeline: %d request%s failed, down longer than --stage-timeout %gs: %s", stopped,
                        "s" * (stopped != 1), self.stage_timeout, reason)
        return outputs

    # ------------------------------------------------------------------ bookkeeping
    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        super()._finish(seq, reason)
        self.executor.release(seq.request_id)

    def abort(self, request_id: str) -> RequestOutput | None:
        out = super().abort(request_id)
        self.executor.release(request_id)
        return out

    def problems(self) -> list[str]:
        since = self.executor.down_since
        if since is not None and time.monotonic() - since > self.stage_timeout:
            what = f"down longer than --stage-timeout {self.stage_timeout:g}s: requests fail until it is back"
        else:
            what = f"requests are paused and fail after --stage-timeout {self.stage_timeout:g}s"
        return [f"{p}; {what}" for p in self.executor.problems()]

    def fatal(self) -> list[str]:
        """What keeps the pipeline from ever serving again (a local worker left down): the server exits."""
        return self.executor.fatal()

    def close(self) -> None:
        self.executor.close()


@dataclass(frozen=True)
class _Sent:
    """A step on the ring, by its micro-batch id (what _Launched.step is for the local engine)."""

    mb: int


def _live(piece: SchedulerOutput, result: SamplerOutput) -> tuple[SchedulerOutput, SamplerOutput]:
    """The piece and its result without sequences that finished (aborted) while it was in flight."""
    if not any(s.seq.is_finished for s in piece.scheduled):
        return piece, result
    keep, rows, seqs, row = [], [], [], 0
    for b, s in enumerate(piece.scheduled):
        if s.samples:
            row += 1
        if s.seq.is_finished:
            continue
        keep.append(s)
        seqs.append(b)
        if s.samples:
            rows.append(row - 1)
    pick = lambda xs: None if xs is None else [xs[r] for r in rows]  # noqa: E731
    prompt = None if result.prompt_logprobs is None else [result.prompt_logprobs[b] for b in seqs]  # per sequence
    return SchedulerOutput(keep), SamplerOutput(pick(result.token_ids), pick(result.logprobs),
                                                pick(result.top_logprobs), pick(result.accepted), prompt)
