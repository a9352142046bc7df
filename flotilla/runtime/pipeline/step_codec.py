"""Steps as diffs: the head's `StepEncoder` turns an engine `StepInput` into a `Step` message, each
worker's `StageSequences` turns it back into the same `StepInput`.

Both sides keep a mirror of every running sequence, keyed by a small integer handle:

- block tables: a step carries only the block ids appended since the sequence's previous step
  (a new handle carries its whole table). A table that shares a first part with the one the
  workers hold but then differs (rejected drafts gave their last block back, or the sequence was
  preempted and re-admitted with its prefix cached) is trimmed to that part (`trims`) and extended;
  one that shares nothing gets a new handle, and the old one is dropped. Blocks given back behind a
  sliding window (the null block took their place at the table's head) travel as a count (`nulls`),
  so a sliding window costs two ints a sequence every block_size tokens, not its table again.
- sampling parameters: sent once, with the sequence's first sampling step, and kept by the last
  stage; the index of the token being sampled (which seeds its random draw) follows from the
  step's positions. Penalties need the tokens generated so far: they come with the parameters,
  and the last stage appends each token it samples.
- finished sequences: their handles ride on the next step as `dropped`.
- overlapped decodes: a step sent before the head read the step before it names that step
  (`prev_mb`) and, per sequence, the row of its sampled ids that is its input token
  (`prev_rows`); stage 0 fills the tokens in from the last stage's `Sampled` (`fill_tokens`).
- speculative decoding: a verifying sequence's new tokens end with its drafts
  (`spec_token_ids`); its sampling rows (one per verified position) follow from its drafts and
  the parameters the last stage holds. Draft distributions travel as one float32 tensor holding
  the rows of the sequences that sample; greedy requests' drafts are point masses whatever their
  distribution (the verifier compares them with the argmax), so the last stage rebuilds those.
  The result carries each row's accepted drafts, which the penalty mirror appends too.

So a decode step costs a few bytes a sequence besides its hidden states. Every step goes through
every stage in the order the head sent it, which keeps the mirrors equal.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from flotilla.runtime.block_pool import NULL_BLOCK_ID
from flotilla.runtime.model_runner import StepInput
from flotilla.runtime.sampler import SamplerOutput, SamplingBatch

from .messages import PromptLogprob, PromptRows, SeqSampling, Step, StepResult


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

    def encode(self, step: StepInput, epoch: int, mb: int, prev_mb: int = 0, feed: bool = False) -> Step:
        """`prev_mb`: the step whose sampled ids `step.prev_rows` point at (an overlapped decode);
        `feed`: the last stage sends this step's ids to stage 0 (a decode may follow it that way)."""
        handles, blocks, sampling, trims, nulls = [], [], [], [], []
        spec = step.spec_token_ids or [[]] * step.num_seqs
        row = 0
        for b, rid in enumerate(step.request_ids):
            table = step.block_tables[b]
            known = self._known.get(rid)
            if known is not None and table[:len(known.table)] != known.table:
                head = _null_head(table, len(known.table))
                if head and known.table[:head] != table[:head]:  # given back behind a sliding window
                    nulls.append([known.handle, head])
                    known.table[:head] = table[:head]
            if known is not None and table[:len(known.table)] != known.table:
                keep = _common_prefix(table, known.table)
                if keep:
                    trims.append([known.handle, keep])
                    del known.table[keep:]
                else:
                    self._dropped.append(known.handle)
                    known = None
            if known is None:
                known = self._known[rid] = _Known(self._next_handle, [])
                self._next_handle += 1
            blocks.append(table[len(known.table):])
            known.table = list(table)
            handles.append(known.handle)
            if step.sample[b]:
                if not known.sampling_sent:
                    sampling.append(_sampling_row(known.handle, step, b, row, len(spec[b])))
                    known.sampling_sent = True
                row += 1 + len(spec[b])
        dropped, self._dropped = self._dropped, []
        speculating = step.spec_token_ids is not None
        return Step(epoch, mb, handles, list(step.starts), list(step.query_lens), step.num_decodes, list(step.sample),
                    blocks, sampling, dropped, list(step.token_ids), None, None,
                    [list(d) for d in spec] if speculating else None,
                    _sampled_draft_probs(step) if speculating else None, trims or None,
                    prev_mb if step.prev_rows is not None else 0,
                    list(step.prev_rows) if step.prev_rows is not None else None, feed,
                    prompt_logprobs=[PromptRows(k, list(ids)) for k, ids in step.prompt_logprobs]
                    if step.prompt_logprobs is not None else None, nulls=nulls or None)


def _null_head(table: list[int], limit: int) -> int:
    """How many of the table's first `limit` ids are the null block."""
    n = 0
    for x in table[:limit]:
        if x != NULL_BLOCK_ID:
            break
        n += 1
    return n


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _sampled_draft_probs(step: StepInput):
    """The rows of `step.draft_probs` that belong to sequences that sample (not greedy), or None."""
    if step.draft_probs is None:
        return None
    s, keep, row, draft = step.sampling, [], 0, 0
    for samples, drafts in zip(step.sample, step.spec_token_ids):
        if not samples:
            continue
        if drafts and not (s.temperature[row] == 0 or s.top_k[row] == 1):
            keep.extend(range(draft, draft + len(drafts)))
        row += 1 + len(drafts)
        draft += len(drafts)
    if not keep:
        return None
    probs = step.draft_probs if len(keep) == step.draft_probs.shape[0] else step.draft_probs[keep]
    return probs.float().contiguous()


def _sampling_row(handle: int, step: StepInput, b: int, row: int, num_spec: int) -> SeqSampling:
    s = step.sampling
    num_prompt = step.starts[b] + step.query_lens[b] - num_spec - s.steps[row]
    return SeqSampling(handle, s.temperature[row], s.top_k[row], s.top_p[row], s.min_p[row],
                       s.repetition_penalty[row], s.presence_penalty[row], s.frequency_penalty[row], s.seeds[row],
                       s.top_logprobs[row], num_prompt, list(s.prompt_ids[row]), list(s.output_ids[row]),
                       [t for t, _ in s.logit_bias[row]], [float(b) for _, b in s.logit_bias[row]],
                       s.min_tokens[row], list(s.ends[row]))


def fill_tokens(msg: Step, sampled: list[int]) -> Step:
    """Stage 0: an overlapped decode with its input tokens taken from the ids the last stage
    sampled for step `msg.prev_mb`."""
    rows = msg.prev_rows
    tokens = msg.token_ids or []
    if rows is None or len(rows) != len(tokens) or any(r >= len(sampled) for r in rows):
        raise ValueError(f"step {msg.mb}: rows {rows} of step {msg.prev_mb}'s {len(sampled)} sampled ids "
                         f"for {len(tokens)} tokens")
    filled = [sampled[r] if r >= 0 else t for r, t in zip(rows, tokens)]
    return dataclasses.replace(msg, token_ids=filled, prev_mb=0, prev_rows=None)


def lane_tokens(msg: Step, seq: int, sampled: int) -> Step:
    """Stage 0: an overlapped decode whose input ids are in slot `seq` of the ids lane (`sampled`
    ids): its tokens stay on the device (0 in the rows they fill, `prev_rows` kept for the runner)."""
    rows = msg.prev_rows
    tokens = msg.token_ids or []
    if rows is None or len(rows) != len(tokens) or any(r >= sampled for r in rows):
        raise ValueError(f"step {msg.mb}: rows {rows} of step {msg.prev_mb}'s {sampled} sampled ids "
                         f"for {len(tokens)} tokens")
    return dataclasses.replace(msg, token_ids=[0 if r >= 0 else t for r, t in zip(rows, tokens)], lane_seq=seq)


def sampler_output(result: StepResult) -> SamplerOutput:
    """The head's view of a StepResult."""
    tops = None
    if result.top_ids is not None:
        tops = [list(zip(ids, vals)) for ids, vals in zip(result.top_ids, result.top_values or [])]
    prompt = None
    if result.prompt_logprobs is not None:
        prompt = [[(e.logprob, e.rank, list(zip(e.top_ids, e.top_values))) for e in seq] for seq in result.prompt_logprobs]
    return SamplerOutput(list(result.token_ids), result.logprobs, tops, result.accepted, prompt)


def step_result(epoch: int, mb: int, out: SamplerOutput) -> StepResult:
    """The last stage's answer."""
    top_ids = top_values = None
    if out.top_logprobs is not None:
        top_ids = [[int(t) for t, _ in row] for row in out.top_logprobs]
        top_values = [[float(v) for _, v in row] for row in out.top_logprobs]
    prompt = None
    if out.prompt_logprobs is not None:
        prompt = [[PromptLogprob(float(lp), int(rank), [int(t) for t, _ in top], [float(v) for _, v in top])
                   for lp, rank, top in seq] for seq in out.prompt_logprobs]
    return StepResult(epoch, mb, list(out.token_ids), out.logprobs, top_ids, top_values, out.accepted, prompt)


@dataclass
class _Sampling:
    params: SeqSampling
    output_ids: list[int]  # kept only when a penalty needs them
    bias: tuple[tuple[int, float], ...] = ()  # the logit bias as the sampler keys it: one tuple for every step

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
            self.sampling[p.handle] = _Sampling(p, list(p.output_ids), tuple(zip(p.bias_ids, p.bias_values)))
        for handle, n in msg.nulls or ():
            if handle not in self.tables or not 0 < n <= len(self.tables[handle]):
                raise ValueError(f"step {msg.mb}: a bad count of released blocks {[handle, n]}")
            self.tables[handle] = [NULL_BLOCK_ID] * n + self.tables[handle][n:]  # a new list (as a trim's)
        for trim in msg.trims or ():
            if len(trim) != 2 or trim[0] not in self.tables or not 0 < trim[1] <= len(self.tables[trim[0]]):
                raise ValueError(f"step {msg.mb}: a bad table trim {trim}")
            # a new list, never a trim in place: graph inputs (cuda_graphs.DecodeInputs) skip a row whose
            # table is the same object of the same length, and a trim + extend keeps the length
            self.tables[trim[0]] = self.tables[trim[0]][:trim[1]]
        tables = []
        for h, new in zip(msg.handles, msg.blocks):
            table = self.tables.setdefault(h, [])
            table.extend(new)
            tables.append(table)
        spec = msg.spec_token_ids
        if spec is not None and (len(spec) != len(msg.handles)
                                 or any(len(d) >= q for d, q in zip(spec, msg.query_lens) if d)):
            raise ValueError(f"step {msg.mb}: drafts for {len(spec)} sequences that do not fit their new tokens")
        sampling = self._batch(msg) if is_last else None
        return StepInput(request_ids=[str(h) for h in msg.handles], token_ids=msg.token_ids or [],
                         starts=msg.starts, query_lens=msg.query_lens, block_tables=tables,
                         num_decodes=msg.num_decodes, sample=msg.sample, sampling=sampling,
                         spec_token_ids=spec if is_last else None,
                         draft_probs=self._draft_probs(msg) if is_last and spec is not None else None,
                         prompt_logprobs=[(r.k, r.targets) for r in msg.prompt_logprobs]
                         if is_last and msg.prompt_logprobs is not None else None)

    def _rows(self, msg: Step):
        """(sampling state, position after the committed tokens, drafts) per sampling sequence."""
        spec = msg.spec_token_ids or [[]] * len(msg.handles)
        return [(self.sampling[h], start + qlen - len(d), d) for h, start, qlen, s, d in
                zip(msg.handles, msg.starts, msg.query_lens, msg.sample, spec) if s]

    def _batch(self, msg: Step) -> SamplingBatch:
        """One row per logits row: per sampling sequence, after its real tokens and after each draft."""
        rows = [(r, end + i, r.output_ids + d[:i] if r.penalised else [])
                for r, end, d in self._rows(msg) for i in range(len(d) + 1)]
        ps = [r.params for r, _, _ in rows]
        bias = [r.bias for r, _, _ in rows]
        return SamplingBatch(
            temperature=[p.temperature for p in ps], top_k=[p.top_k for p in ps], top_p=[p.top_p for p in ps],
            min_p=[p.min_p for p in ps], repetition_penalty=[p.repetition_penalty for p in ps],
            presence_penalty=[p.presence_penalty for p in ps], frequency_penalty=[p.frequency_penalty for p in ps],
            seeds=[p.seed for p in ps], steps=[end - p.num_prompt_tokens for (_, end, _), p in zip(rows, ps)],
            top_logprobs=[p.top_logprobs for p in ps], prompt_ids=[p.prompt_ids for p in ps],
            output_ids=[out for _, _, out in rows],
            logit_bias=bias, min_tokens=[p.min_tokens for p in ps],
            ends=[p.ends for p in ps],
        )

    def _draft_probs(self, msg: Step) -> torch.Tensor | None:
        """[drafts, vocab]: the sent distributions for sampled sequences' drafts, point masses for
        greedy ones' (the verifier never reads those); None when none was sent."""
        sent = msg.draft_probs
        if sent is None:
            return None
        if sent.dim() != 2 or sent.dtype != torch.float32:
            raise ValueError(f"step {msg.mb}: draft distributions must be [drafts, vocab] float32")
        parts, used = [], 0
        for r, _, d in self._rows(msg):
            if not d:
                continue
            p = r.params
            if p.temperature == 0 or p.top_k == 1:
                parts.append(torch.nn.functional.one_hot(torch.tensor(d), sent.shape[1]).float())
            else:
                parts.append(sent[used:used + len(d)])
                used += len(d)
        if used != sent.shape[0]:
            raise ValueError(f"step {msg.mb}: {sent.shape[0]} draft distributions for {used} sampled drafts")
        return torch.cat(parts)

    def record(self, msg: Step, token_ids: list[int], accepted: list[list[int]] | None = None) -> None:
        """Append the tokens the last stage sampled (each after its accepted drafts) to the
        sequences whose penalties need them."""
        sampled = [h for h, s in zip(msg.handles, msg.sample) if s]
        for h, a, t in zip(sampled, accepted or [[]] * len(sampled), token_ids):
            state = self.sampling.get(h)
            if state is not None and state.penalised:
                state.output_ids += [*a, t]
