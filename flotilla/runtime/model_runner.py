"""Turns one scheduled step into tensors and runs a model stage over the paged KV cache.

`StepInput` is plain lists, so the head can build it and send it to a remote stage unchanged
(issue: pipeline parallel); the runner works for any stage: the first embeds `token_ids`, later
ones take the previous stage's hidden states, and the last computes logits for the sampling
rows and samples them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from flotilla.kernels.attention import PagedAttentionMetadata
from flotilla.models.llama import CausalLM

from .cuda_graphs import BUCKETS, DecodeGraphRunner, bucket_for
from .kv_cache import KVCache, PagedAttentionBackend
from .sampler import Sampler, SamplerOutput, SamplingBatch
from .spec.rejection import RejectionSampler


@dataclass(frozen=True)
class StepInput:
    """One step's batch: B sequences, decodes (one new token) first."""

    request_ids: list[str]
    token_ids: list[int]  # the T new tokens, flattened in batch order
    starts: list[int]  # position of each sequence's first new token (= tokens already computed)
    query_lens: list[int]  # new tokens per sequence
    block_tables: list[list[int]]  # logical -> physical block ids, covering start + query_len tokens
    num_decodes: int
    sample: list[bool]  # whether each sequence samples a token this step (reaches its end)
    sampling: SamplingBatch | None = None  # one row per logits row: per sampling sequence, 1 + its drafts
    # speculative steps: per sequence, the draft tokens that end its token_ids (verified here),
    # and the distributions they were drawn from ([drafts, vocab], None: point masses)
    spec_token_ids: list[list[int]] | None = None
    draft_probs: torch.Tensor | None = None
    # decodes launched before the previous launched step's ids were read (LLMEngine's overlap):
    # per sequence, the row of that step whose sampled id is its token (token_ids holds 0), or -1
    prev_rows: list[int] | None = None
    # prompt logprobs (SamplingParams.prompt_logprobs), per sequence: (how many likeliest tokens, the prompt
    # tokens that its first rows predict: those after start, up to the prompt's last); None: none this step
    prompt_logprobs: list[tuple[int, list[int]]] | None = None
    # a hybrid cache (HybridBlockManager): per group of layers after the first, its tables, block for block as
    # block_tables (a sliding-window group's hold the null block behind the window); None: one table a sequence
    group_tables: list[list[list[int]]] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.starts)


PROMPT_LOGPROB_ROWS = 256  # prompt rows whose logits are computed at a time (fp32 [rows, vocab])


class ModelRunner:
    computes_prompt_logprobs = True  # StepInput.prompt_logprobs (LLMEngine.validate asks)

    def __init__(self, model: CausalLM, cache: KVCache, sampler: Sampler | None = None,
                 graph_sizes: tuple[int, ...] = (), max_model_len: int | None = None, graph_query_len: int = 1):
        """`graph_sizes`: on CUDA, steps of up to max(graph_sizes) new tokens in which every
        sequence brings at most `graph_query_len` tokens (1: decodes; 1 + k: speculative verify
        steps; prefill chunks that short too, sampling or not) replay CUDA graphs captured now for
        these token buckets (runtime.cuda_graphs), with block tables wide enough for
        `max_model_len` tokens (default: the model's). Any stage: a pipeline stage's steps replay
        too."""
        self.model = model
        model.freeze(logits_kernel(model, cache.device))  # the step loop looks nothing up per layer
        self.cache = cache
        self.device = cache.device
        self.block_size = cache.spec.block_size
        self.scale = model.config.head_dim ** -0.5
        self.sampler = sampler or (Sampler(model.config.vocab_size) if model.stage.is_last else None)
        # the last launched step's sampled ids (`launch`), read on the device by the next one; the
        # last entry stays 0 (rows whose token the host knows)
        rows = max((BUCKETS[-1], *graph_sizes))
        self.sampled = torch.zeros(rows + 1, dtype=torch.long, device=self.device)
        self.max_launch_rows = rows if self.sampler is not None else 0
        self._ids_to_host = _IdsToHost(self.max_launch_rows, self.device)
        self.graphs = None
        if graph_sizes and self.device.type == "cuda":
            self.graphs = DecodeGraphRunner(model, cache, graph_sizes, max_model_len or model.config.max_model_len,
                                            self.scale, max_query_len=graph_query_len, sampled=self.sampled)
        self.verifier = RejectionSampler(self.sampler) if self.sampler is not None else None

    @property
    def prefers_overlap(self) -> bool:
        """Whether launching a step before the previous one's ids are read pays: on a GPU, whose
        work runs apart from the host's (LLMEngine's default)."""
        return self.device.type == "cuda" and self.max_launch_rows > 0

    def same_rows(self, num_rows: int, fewer: int) -> bool:
        """Whether a decode step of `fewer` rows gives each row bit-for-bit what the step of
        `num_rows` gave it: when both replay the same captured graph, whose rows are computed
        each on its own (the engine then keeps a launched step's rows after one of its sequences
        finished). Not promised by the eager kernels."""
        g = self.graphs
        return g is not None and fewer > 0 and bucket_for(num_rows, g.sizes) == bucket_for(fewer, g.sizes) is not None

    def can_launch(self, step: StepInput) -> bool:
        """Whether `launch` takes this step (its sampling must read no host data: the caller's part)."""
        return (0 < step.num_seqs <= self.max_launch_rows and all(step.sample) and step.spec_token_ids is None
                and step.prompt_logprobs is None)

    @torch.inference_mode()
    def launch(self, step: StepInput, hidden: torch.Tensor | None = None,
               sampled: Callable[[torch.Tensor], None] | None = None) -> "LaunchedStep":
        """Run a step of the last stage (the whole model, or a pipeline's last stage given the
        hidden states) and sample it without waiting for the device (every sequence samples one
        token, sampling needs no host data: no penalties, no logprobs). The ids stay in
        `self.sampled`, where the next launched step's `prev_rows` read them, and travel to the
        host behind an event: the returned step's `result()` waits for them. `sampled(ids)` is
        called with the ids [B] on the device once their sampling is queued, before their copy
        to the host (a pipeline's ids lane: stage 0 then waits for the sampling only)."""
        if not self.can_launch(step):
            raise ValueError(f"launch runs steps of at most {self.max_launch_rows} sequences that each "
                             f"sample one token; got {step.num_seqs} sequences")
        if self._replays(step):
            logits = self._replay(step, hidden)
        else:
            if hidden is not None and hidden.device != self.device:
                hidden = hidden.to(self.device, non_blocking=True)
            logits = self.compute_logits(step, self._forward(step, hidden))
        ids = self.sampler.sample_ids(logits, step.sampling, out=self.sampled[:step.num_seqs])  # [B] on the device
        if sampled is not None:
            sampled(ids)
        return self._ids_to_host.start(ids)

    @torch.inference_mode()
    def stage(self, step: StepInput) -> bool:
        """A first stage's step whose token ids are not known yet: write the rest of its inputs
        into its decode graph's static inputs now, if a graph serves it (then `execute(...,
        staged=True)` with the ids replays it; any other step in between undoes this)."""
        if not self.model.stage.is_first or not self._replays(step) or step.prompt_logprobs is not None:
            return False  # (prompt logprobs read the hidden states: never a replay)
        self.graphs.stage(step.token_ids, step.starts, step.block_tables, step.query_lens, step.group_tables)
        return True

    @torch.inference_mode()
    def execute(self, step: StepInput, hidden: torch.Tensor | None = None,
                staged: bool = False) -> SamplerOutput | torch.Tensor:
        """Run the stage: returns sampled tokens on the last stage, else hidden states [T, H].
        `hidden` may be in pinned host memory (a replay copies it in). `staged`: the step went
        to `stage` before; only its token ids go to the device now."""
        replay = staged or (self._replays(step) and step.prompt_logprobs is None)  # the captured graph's rows
        if staged:
            out = self._replay(step, staged=True)
        elif replay:
            out = self._replay(step, hidden)
        else:
            if hidden is not None and hidden.device != self.device:
                hidden = hidden.to(self.device, non_blocking=True)
            out = self._forward(step, hidden)
        if not self.model.stage.is_last:
            return out  # hidden states [T, H]
        prompt = self.prompt_logprobs(step, out) if step.prompt_logprobs is not None and not replay else None
        if not any(step.sample):  # only partial prefill chunks this step
            return SamplerOutput([], prompt_logprobs=prompt)
        logits = out if replay else self.compute_logits(step, out)
        if step.sampling is None:  # a tensor-parallel rank but 0: its share of the logits went to the gather
            return self.sampler(logits, None)
        if step.spec_token_ids is not None:
            drafts = [d for d, samples in zip(step.spec_token_ids, step.sample) if samples]
            result = self.verifier(logits, step.sampling, drafts, step.draft_probs)
        else:
            result = self.sampler(logits, step.sampling)
        return result if prompt is None else dataclasses.replace(result, prompt_logprobs=prompt)

    def prompt_logprobs(self, step: StepInput, hidden: torch.Tensor) -> list[list] | None:
        """Per sequence of the step, the logprobs of the prompt tokens its rows predict (StepInput.
        prompt_logprobs): a list of (logprob, rank, [(token id, logprob) of the k likeliest]), rank 1 for
        the likeliest token. The logits are computed PROMPT_LOGPROB_ROWS rows at a time (a prompt's
        [T, vocab] at once would be gigabytes). None on a tensor-parallel rank but 0 (no logits there)."""
        rows, targets, where = [], [], []  # hidden rows, their target ids, (sequence, k) per row
        first = 0
        for b, (qlen, (k, ids)) in enumerate(zip(step.query_lens, step.prompt_logprobs)):
            rows += range(first, first + len(ids))
            targets += ids
            where += [(b, k)] * len(ids)
            first += qlen
        out: list[list] = [[] for _ in step.query_lens]
        k_max = max((k for k, _ in step.prompt_logprobs), default=0)
        for i in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            idx = torch.tensor(rows[i:i + PROMPT_LOGPROB_ROWS], dtype=torch.long, device=hidden.device)
            logits = self.model.compute_logits(hidden.index_select(0, idx))  # a gather under TP: every rank
            if logits.shape[-1] == 0:
                continue
            lp = torch.log_softmax(logits, dim=-1)
            tgt = torch.tensor(targets[i:i + PROMPT_LOGPROB_ROWS], dtype=torch.long, device=lp.device)
            chosen = lp.gather(1, tgt[:, None])
            ranks = (lp > chosen).sum(dim=1) + 1
            top_v, top_i = lp.topk(k_max, dim=-1) if k_max else (lp[:, :0], lp[:, :0].long())
            for (b, k), v, rank, tv, ti in zip(where[i:], chosen[:, 0].tolist(), ranks.tolist(), top_v.tolist(),
                                               top_i.tolist()):
                out[b].append((v, rank, list(zip(ti[:k], tv[:k]))))
        return out if any(out) or not rows else None

    @torch.inference_mode()
    def logits(self, step: StepInput) -> torch.Tensor:
        """fp32 logits of a whole-model step's sampling rows (`compute_logits`), without sampling:
        through a captured graph where one serves the step (a draft model's passes)."""
        return self._replay(step) if self._replays(step) else self.compute_logits(step, self._forward(step, None))

    def _forward(self, step: StepInput, hidden: torch.Tensor | None) -> torch.Tensor:
        positions, meta, group_metas = prepare_step(step, self.block_size, self.device)
        attn = PagedAttentionBackend(self.cache, meta, self.scale, group_metas)
        if not self.model.stage.is_first:
            return self.model(hidden, positions, attn)
        x = _to(np.asarray(step.token_ids, dtype=np.int64), self.device)  # [T]
        sampled = None
        if step.prev_rows is not None:  # decodes whose tokens the last launched step sampled
            rows = np.asarray(step.prev_rows, dtype=np.int64)
            sampled = (self.sampled, _to(np.where(rows < 0, self.sampled.numel() - 1, rows), self.device))
        return self.model(x, positions, attn, sampled=sampled)

    def _replays(self, step: StepInput) -> bool:
        """Whether a captured CUDA graph serves this step: every sequence brings at most
        `graph_query_len` tokens, one graph row each (a prefill chunk that short too; only the
        sampling sequences' rows are read)."""
        return self.graphs is not None and self.graphs.can_run(step.token_ids, step.query_lens, step.block_tables)

    def _replay(self, step: StepInput, hidden: torch.Tensor | None = None, staged: bool = False) -> torch.Tensor:
        """The last stage's logits of the sampling rows; an earlier stage's hidden states [T, H]."""
        if staged:
            out = self.graphs.run_staged(step.token_ids, step.prev_rows)
        else:
            out = self.graphs.run(step.token_ids, step.starts, step.block_tables, step.query_lens, hidden,
                                  step.prev_rows, step.group_tables)
        if not self.model.stage.is_last:
            return out
        logits, rows = out, logit_rows(step)  # [T, vocab]
        if len(rows) < logits.shape[0]:  # some sequence brought more tokens than it samples (a chunk, a catch-up)
            logits = logits.index_select(0, _to(np.asarray(rows, dtype=np.int64), logits.device))
        return logits

    def compute_logits(self, step: StepInput, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, vocab] of the last new token of each sampling sequence (of its last
        1 + k tokens, for a sequence verifying k drafts)."""
        ends = logit_rows(step)
        if len(ends) < hidden.shape[0]:
            hidden = hidden.index_select(0, torch.tensor(ends, dtype=torch.long, device=hidden.device))
        return self.model.compute_logits(hidden)


class LaunchedStep:
    """A launched step's sampled ids on their way to the host."""

    def __init__(self, host: torch.Tensor, num_rows: int, copied: "torch.cuda.Event | None"):
        self._host, self._n, self._copied = host, num_rows, copied

    def result(self) -> SamplerOutput:
        """The step's tokens: waits for their copy (the host sync of an overlapped step)."""
        if self._copied is not None:
            self._copied.synchronize()
        return SamplerOutput(self._host[:self._n].tolist())


class _IdsToHost:
    """Copies sampled ids to the host without waiting: two pinned buffers in turn (a step's ids
    are read before the step after next is launched), each with the event of its copy."""

    def __init__(self, rows: int, device: torch.device):
        cuda = device.type == "cuda" and rows > 0
        self._bufs = [torch.zeros(rows, dtype=torch.long, pin_memory=True) for _ in range(2)] if cuda else []
        self._events = [torch.cuda.Event() for _ in self._bufs]
        self._turn = 0

    def start(self, ids: torch.Tensor) -> LaunchedStep:
        if not self._bufs:  # on the CPU the ids are computed already (a copy: `ids` may be the sampled buffer)
            return LaunchedStep(ids.clone(), ids.shape[0], None)
        host, copied = self._bufs[self._turn], self._events[self._turn]
        self._turn ^= 1
        host[:ids.shape[0]].copy_(ids, non_blocking=True)
        copied.record()
        return LaunchedStep(host, ids.shape[0], copied)


def logit_rows(step: StepInput) -> list[int]:
    """The rows of the step's T new tokens that give logits: the last token of each sampling
    sequence, and the k before it for a sequence verifying k drafts."""
    ends, end = [], 0
    spec = step.spec_token_ids or [()] * step.num_seqs
    for qlen, samples, drafts in zip(step.query_lens, step.sample, spec):
        end += qlen
        if samples:
            ends.extend(range(end - 1 - len(drafts), end))
    return ends


def logits_kernel(model: CausalLM, device: torch.device):
    """What the last stage computes its logits with in place of its lm_head module (the head's
    `logits_fn`: e.g. the compiled CPU kernels, or a GGUF head's own blocks), or None."""
    return model.lm_head.logits_fn(device) if model.stage.is_last else None


def prepare_step(step: StepInput, block_size: int, device: torch.device
                 ) -> tuple[torch.Tensor, PagedAttentionMetadata, list[PagedAttentionMetadata] | None]:
    """Positions [T] and the attention metadata of a step (and of its group tables, or None). Built on the
    host with numpy (small arrays; torch's threaded CPU ops cost more than they compute here), then moved to
    the device."""
    bs, nd, B, T = block_size, step.num_decodes, step.num_seqs, step.num_tokens
    starts = np.asarray(step.starts, dtype=np.int64)
    qlens = np.asarray(step.query_lens, dtype=np.int64)
    if nd == T:  # decodes only: one token per sequence
        positions, seq_of_token = starts, np.arange(B)
    else:
        seq_of_token = np.repeat(np.arange(B), qlens)  # [T]
        first_row = np.cumsum(qlens) - qlens
        positions = starts[seq_of_token] + np.arange(T) - first_row[seq_of_token]
    seq_lens = starts + qlens
    shared = dict(  # every group's metadata holds the same lengths: sent to the device once
        seq_lens=_to(seq_lens, device), query_lens=_to(qlens, device), block_size=bs, num_decodes=nd,
        max_decode_seq_len=int(seq_lens[:nd].max()) if nd else 0,
        max_prefill_query_len=int(qlens[nd:].max()) if nd < B else 0,
        max_prefill_seq_len=int(seq_lens[nd:].max()) if nd < B else 0,
        min_decode_pos=int(starts[:nd].min()) if nd else 0,
        min_prefill_pos=int(starts[nd:].min()) if nd < B else 0)

    def metadata(block_tables: list[list[int]]) -> PagedAttentionMetadata:
        tables = np.zeros((B, max(len(t) for t in block_tables)), dtype=np.int64)  # [B, W], 0 = null block
        for b, t in enumerate(block_tables):
            tables[b, :len(t)] = t
        slots = tables[seq_of_token, positions // bs] * bs + positions % bs
        return PagedAttentionMetadata(slot_mapping=_to(slots, device), block_tables=_to(tables, device),
                                      first_block=_first_if_consecutive(block_tables[0]) if B == 1 else -1, **shared)

    groups = [metadata(t) for t in step.group_tables] if step.group_tables is not None else None
    return _to(positions, device), metadata(step.block_tables), groups


def _first_if_consecutive(table: list[int]) -> int:
    """The first block id of a table of consecutive ids (then attention reads a view), else -1."""
    return table[0] if table[-1] - table[0] == len(table) - 1 and table == list(range(table[0], table[-1] + 1)) else -1


def _to(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t if device.type == "cpu" else t.to(device, non_blocking=True)
