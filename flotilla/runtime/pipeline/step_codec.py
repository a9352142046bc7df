"""Steps as diffs: the head's `StepEncoder` turns an engine `StepInput` into a `Step` message, each
worker's `StageSequences` turns it back into the same `StepInput`.

Both sides keep a mirror of every running sequence, keyed by a small integer handle:

- block tables: a step carries only the block ids appended since the sequence's previous step
  (a new handle carries its whole table). A table that is not an extension of the one the
  workers hold (the sequence was preempted and re-admitted elsewhere in the pool) gets a new
  handle, and the old one is dropped.
- sampling parameters: sent once, with the sequence's first sampling step, and kept by the last
  stage; the index of the token being sampled (which seeds its random draw) follows from the
  step's positions. Penalties need the tokens generated so far: they come with the parameters,
  and the last stage appends each token it samples.
- finished sequences: their handles ride on the next step as `dropped`.

So a decode step costs a few bytes a sequence besides its hidden states. Every step goes through
every stage in the order the head sent it, which keeps the mirrors equal.
"""
from __future__ import annotations

from dataclasses import dataclass

from flotilla.runtime.model_runner import StepInput
from flotilla.runtime.sampler import SamplerOutput, SamplingBatch

from .messages import SeqSampling, Step, StepResult


@dataclass
class _Known:
    handle: int
    table: list[int]  # as the workers hold it
    sampling_sent: bool = False


class StepEncoder:
    """The head's side. Not thread-safe: the engine thread owns it."""

    def __init__(self):
        self._next_handle = 1
        self.reset()

    def reset(self) -> None:
        """Forget every sequence (a new epoch: the workers start from empty mirrors)."""
        self._known: dict[str, _Known] = {}
        self._dropped: list[int] = []

    def release(self, request_id: str) -> None:
        """The request finished or was aborted: the workers may forget it."""
        known = self._known.pop(request_id, None)
        if known is not None:
            self._dropped.append(known.handle)

    def encode(self, step: StepInput, epoch: int, mb: int) -> Step:
        handles, blocks, sampling = [], [], []
        row = 0
        for b, rid in enumerate(step.request_ids):
            table = step.block_tables[b]
            known = self._known.get(rid)
            if known is None or table[:len(known.table)] != known.table:
                if known is not None:
                    self._dropped.append(known.handle)
                known = self._known[rid] = _Known(self._next_handle, [])
                self._next_handle += 1
            blocks.append(table[len(known.table):])
            known.table = list(table)
            handles.append(known.handle)
            if step.sample[b]:
                if not known.sampling_sent:
                    sampling.append(_sampling_row(known.handle, step, b, row))
                    known.sampling_sent = True
                row += 1
        dropped, self._dropped = self._dropped, []
        return Step(epoch, mb, handles, list(step.starts), list(step.query_lens), step.num_decodes, list(step.sample),
                    blocks, sampling, dropped, list(step.token_ids), None, None)


def _sampling_row(handle: int, step: StepInput, b: int, row: int) -> SeqSampling:
    s = step.sampling
    num_prompt = step.starts[b] + step.query_lens[b] - s.steps[row]
    return SeqSampling(handle, s.temperature[row], s.top_k[row], s.top_p[row], s.min_p[row],
                       s.repetition_penalty[row], s.presence_penalty[row], s.frequency_penalty[row], s.seeds[row],
                       s.top_logprobs[row], num_prompt, list(s.prompt_ids[row]), list(s.output_ids[row]))


def sampler_output(result: StepResult) -> SamplerOutput:
    """The head's view of a StepResult."""
    tops = None
    if result.top_ids is not None:
        tops = [list(zip(ids, vals)) for ids, vals in zip(result.top_ids, result.top_values or [])]
    return SamplerOutput(list(result.token_ids), result.logprobs, tops)


def step_result(epoch: int, mb: int, out: SamplerOutput) -> StepResult:
    """The last stage's answer."""
    top_ids = top_values = None
    if out.top_logprobs is not None:
        top_ids = [[int(t) for t, _ in row] for row in out.top_logprobs]
        top_values = [[float(v) for _, v in row] for row in out.top_logprobs]
    return StepResult(epoch, mb, list(out.token_ids), out.logprobs, top_ids, top_values)


@dataclass
class _Sampling:
    params: SeqSampling
    output_ids: list[int]  # kept only when a penalty needs them

    @property
    def penalised(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


class StageSequences:
    """A worker's mirror of the running sequences (block tables; sampling on the last stage)."""

    def __init__(self):
        self.tables: dict[int, list[int]] = {}
        self.sampling: dict[int, _Sampling] = {}

    def __len__(self) -> int:
        return len(self.tables)

    def apply(self, msg: Step, is_last: bool) -> StepInput:
        """Update the mirror from a step and rebuild the engine's StepInput."""
        for h in msg.dropped:
            self.tables.pop(h, None)
            self.sampling.pop(h, None)
        for p in msg.sampling:
            self.sampling[p.handle] = _Sampling(p, list(p.output_ids))
        tables = []
        for h, new in zip(msg.handles, msg.blocks):
            table = self.tables.setdefault(h, [])
            table.extend(new)
            tables.append(table)
        sampling = self._batch(msg) if is_last else None
        return StepInput(request_ids=[str(h) for h in msg.handles], token_ids=msg.token_ids or [],
                         starts=msg.starts, query_lens=msg.query_lens, block_tables=tables,
                         num_decodes=msg.num_decodes, sample=msg.sample, sampling=sampling)

    def _batch(self, msg: Step) -> SamplingBatch:
        rows = [(self.sampling[h], start + qlen) for h, start, qlen, s in
                zip(msg.handles, msg.starts, msg.query_lens, msg.sample) if s]
        ps = [r.params for r, _ in rows]
        return SamplingBatch(
            temperature=[p.temperature for p in ps], top_k=[p.top_k for p in ps], top_p=[p.top_p for p in ps],
            min_p=[p.min_p for p in ps], repetition_penalty=[p.repetition_penalty for p in ps],
            presence_penalty=[p.presence_penalty for p in ps], frequency_penalty=[p.frequency_penalty for p in ps],
            seeds=[p.seed for p in ps], steps=[end - p.num_prompt_tokens for (_, end), p in zip(rows, ps)],
            top_logprobs=[p.top_logprobs for p in ps], prompt_ids=[p.prompt_ids for p in ps],
            output_ids=[r.output_ids if r.penalised else [] for r, _ in rows],
        )

    def record(self, msg: Step, token_ids: list[int]) -> None:
        """Append the tokens the last stage sampled to the sequences whose penalties need them."""
        sampled = [h for h, s in zip(msg.handles, msg.sample) if s]
        for h, t in zip(sampled, token_ids):
            state = self.sampling.get(h)
            if state is not None and state.penalised:
                state.output_ids.append(t)
