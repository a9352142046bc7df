"""Token sampling for a batch of rows, each with its own parameters.

Self-contained: the `Sampler` is fed a `SamplingBatch` of plain lists (built on the head from the
scheduled sequences, small enough to ship to the last pipeline stage) and logits; it returns
token ids (the one host sync) and, where asked, logprobs.

Order of operations per row: penalties (repetition on prompt+output tokens, as transformers
does; presence and frequency on output tokens, as OpenAI defines them) -> logit bias -> the end
tokens masked while the row is short of its min_tokens -> temperature -> top-k -> top-p -> min-p
-> sample. Greedy rows (temperature 0) take the argmax of the processed logits.

Sampling draws one exponential variate per vocabulary entry, E ~ Exp(1), and picks
argmax(p / E), which is an exact draw from p. The variates of a row come from a generator seeded
by (request seed, index of the token being generated), so a seeded request produces the same
tokens whatever else is in the batch, and again after a preemption.

Reported logprobs are those of the model's distribution (log-softmax of the raw logits), before
penalties, temperature and truncation.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import torch

from .sampling import SamplingParams

_MASK64 = (1 << 64) - 1
_LARGE_VOCAB = 16384  # from here up, first_max on a GPU works in chunks (below, torch's one pass)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters (row i samples for the i-th sampling sequence of a step)."""

    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    min_p: list[float]
    repetition_penalty: list[float]
    presence_penalty: list[float]
    frequency_penalty: list[float]
    seeds: list[int]
    steps: list[int]  # index of the token being generated (its output position)
    top_logprobs: list[int]  # -1: no logprobs; k >= 0: the sampled token's logprob and the top k
    prompt_ids: list[list[int]]  # filled only for rows with a repetition penalty
    output_ids: list[list[int]]  # filled only for rows with any penalty
    logit_bias: list[tuple[tuple[int, float], ...]]  # (token id, bias) pairs, per row (its params' own tuple)
    min_tokens: list[int]  # below this step, the row's end tokens (`ends`) cannot be sampled
    ends: list[list[int]]  # the ids that would end the row (eos, stop tokens); filled only with min_tokens

    @classmethod
    def build(cls, rows: list[tuple[SamplingParams, int, list[int], list[int]]],
              steps: list[int] | None = None, eos_token_ids: tuple[int, ...] = ()) -> "SamplingBatch":
        """rows: (params, seed, prompt ids, output ids) per sampling sequence. The ids are read
        only for rows with a penalty, and for each row's step (len(output ids)) unless `steps`
        gives them: a caller that knows both may pass empty lists for the other rows.
        `eos_token_ids`: the model's, masked (with each row's stop tokens) below its min_tokens."""
        ps = [r[0] for r in rows]
        rep = [p.repetition_penalty != 1.0 for p in ps]
        pen = [p.has_penalty for p in ps]
        return cls(
            temperature=[p.temperature for p in ps],
            top_k=[p.top_k for p in ps],
            top_p=[p.top_p for p in ps],
            min_p=[p.min_p for p in ps],
            repetition_penalty=[p.repetition_penalty for p in ps],
            presence_penalty=[p.presence_penalty for p in ps],
            frequency_penalty=[p.frequency_penalty for p in ps],
            seeds=[r[1] for r in rows],
            steps=steps if steps is not None else [len(r[3]) for r in rows],
            top_logprobs=[p.top_logprobs if p.logprobs else -1 for p in ps],
            prompt_ids=[list(r[2]) if use else [] for r, use in zip(rows, rep)],
            output_ids=[list(r[3]) if use else [] for r, use in zip(rows, pen)],
            logit_bias=[p.logit_bias for p in ps],
            min_tokens=[p.min_tokens for p in ps],
            ends=[sorted(p.end_token_ids(eos_token_ids)) if p.min_tokens else [] for p in ps],
        )

    def __len__(self) -> int:
        return len(self.temperature)

    def select(self, rows: list[int]) -> "SamplingBatch":
        """The batch of the given rows, in that order."""
        return SamplingBatch(**{f.name: [getattr(self, f.name)[r] for r in rows] for f in fields(self)})

    @property
    def all_greedy(self) -> bool:
        return all(t == 0 or k == 1 for t, k in zip(self.temperature, self.top_k))

    @property
    def any_penalty(self) -> bool:
        return (any(r != 1.0 for r in self.repetition_penalty) or any(self.presence_penalty)
                or any(self.frequency_penalty))

    @property
    def any_processing(self) -> bool:
        """Whether any row's logits change before sampling: penalties, a logit bias, or end tokens
        masked below min_tokens."""
        return (self.any_penalty or any(self.logit_bias)
                or any(k > s for k, s in zip(self.min_tokens, self.steps)))

    @property
    def any_logprobs(self) -> bool:
        return any(k >= 0 for k in self.top_logprobs)


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None] | None = None  # the sampled token's logprob, per row
    top_logprobs: list[list[tuple[int, float]]] | None = None  # (token id, logprob), best first
    # speculative steps: the draft tokens accepted before token_ids[i], per row (see runtime/spec)
    accepted: list[list[int]] | None = None
    # per sequence of the step (not per row): its prompt tokens' (logprob, rank, top) (ModelRunner.prompt_logprobs)
    prompt_logprobs: list[list] | None = None


class Sampler:
    def __init__(self, vocab_size: int | None = None):
        self.vocab_size = vocab_size
        self._noise: torch.Tensor | None = None  # reused [rows, vocab] buffer
        self._gen: dict[torch.device, torch.Generator] = {}
        self._bias: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # a request's bias as tensors, built once

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits [B, V] (any float dtype) -> one token per row."""
        raw = logits.float()
        ids = self.sample_ids(raw, batch)
        token_ids = ids.tolist()  # the step's one host sync
        if not batch.any_logprobs:
            return SamplerOutput(token_ids)
        return self.logprobs(raw, ids, token_ids, batch)

    @torch.inference_mode()
    def sample_ids(self, logits: torch.Tensor, batch: SamplingBatch, out: torch.Tensor | None = None) -> torch.Tensor:
        """The sampled token ids [B] (int64), left on the logits' device: nothing here waits for
        the device (per-row parameters go over in non-blocking copies). `out`: an int64 [B]
        tensor on that device to write them into (returned); a greedy batch's kernel writes there."""
        logits = logits.float()
        if batch.any_processing:
            logits = self.process_logits(logits, batch)
        if batch.all_greedy:
            return first_max(logits, out)
        ids = self._sample(logits, first_max(logits), batch)
        return ids if out is None else out.copy_(ids)

    # ------------------------------------------------------------------ penalties
    def process_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [B, V] fp32 with each row's repetition, presence and frequency penalties, its
        logit bias, and its end tokens at -inf while it is short of its min_tokens (a new tensor)."""
        B, V = logits.shape
        dev = logits.device
        logits = logits.clone()
        if batch.any_penalty:
            out_counts = _counts(batch.output_ids, B, V, dev)  # [B, V]
            if any(r != 1.0 for r in batch.repetition_penalty):  # decided on the host: no device sync
                rep = _on(batch.repetition_penalty, torch.float32, dev)
                seen = (_counts(batch.prompt_ids, B, V, dev) + out_counts) > 0
                penalised = torch.where(logits > 0, logits / rep[:, None], logits * rep[:, None])
                logits = torch.where(seen, penalised, logits)
            presence = _on(batch.presence_penalty, torch.float32, dev)[:, None]
            frequency = _on(batch.frequency_penalty, torch.float32, dev)[:, None]
            logits = logits - presence * (out_counts > 0) - frequency * out_counts
        biased = [(r, *self._bias_tensors(pairs, V, dev)) for r, pairs in enumerate(batch.logit_bias) if pairs]
        if biased:  # one add for the batch; a Python step per biased row, none per token
            rows = torch.cat([torch.full_like(ids, r) for r, ids, _ in biased])
            logits.index_put_((rows, torch.cat([ids for _, ids, _ in biased])),
                              torch.cat([values for _, _, values in biased]), accumulate=True)
        ends = [(r, t) for r, (k, s, ts) in enumerate(zip(batch.min_tokens, batch.steps, batch.ends)) if s < k
                for t in ts if 0 <= t < V]
        if ends:
            rows, ids = zip(*ends)
            logits[_on(list(rows), torch.int64, dev), _on(list(ids), torch.int64, dev)] = float("-inf")
        return logits

    # ------------------------------------------------------------------ sampling
    def _sample(self, logits: torch.Tensor, greedy_ids: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy = _on([t == 0 or k == 1 for t, k in zip(batch.temperature, batch.top_k)], torch.bool, logits.device)
        sampled = (self.processed_probs(logits, batch) / self.exponentials(logits, batch)).argmax(dim=-1)
        return torch.where(greedy, greedy_ids, sampled)

    def processed_probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """What each row samples from, given logits [B, V] with penalties applied: temperature
        (greedy rows at 1), top-k, top-p, then min-p's cut. Not renormalized after min-p (the
        exponential race needs no normalization); divide by the row sum for a distribution."""
        B, V = logits.shape
        dev = logits.device
        temp = _on([t if t > 0 else 1.0 for t in batch.temperature], torch.float32, dev)
        logits = logits / temp[:, None]
        if any(0 < k < V for k in batch.top_k) or any(p < 1.0 for p in batch.top_p):
            logits = _top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = torch.softmax(logits, dim=-1)
        if any(m > 0 for m in batch.min_p):
            min_p = _on(batch.min_p, torch.float32, dev)[:, None]
            probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        return probs

    def _bias_tensors(self, pairs: tuple, vocab: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A logit bias's ids and values on `dev` (ids outside the vocabulary dropped), kept for the
        steps after (keyed by the request's own tuple; the oldest go past 256 biases)."""
        key = (pairs, vocab, dev)
        got = self._bias.get(key)
        if got is None:
            kept = [(t, b) for t, b in pairs if 0 <= t < vocab] or [(0, 0.0)]
            got = self._bias[key] = (_on([t for t, _ in kept], torch.int64, dev),
                                     _on([b for _, b in kept], torch.float32, dev))
            while len(self._bias) > 256:
                del self._bias[next(iter(self._bias))]
        return got

    def exponentials(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Exp(1) variates [B, V] for the rows of `logits`, each row from its (seed, step)
        generator; ones for greedy rows. A reused buffer: valid until the next call."""
        (B, V), dev = logits.shape, logits.device
        if self._noise is None or self._noise.shape[0] < B or self._noise.shape[1] != V or self._noise.device != dev:
            self._noise = torch.empty(max(B, 8), V, device=dev)
        noise = self._noise[:B]
        gen = self._gen.get(dev)
        if gen is None:
            gen = self._gen[dev] = torch.Generator(device=dev)
        for i, (seed, step) in enumerate(zip(batch.seeds, batch.steps)):
            if batch.temperature[i] == 0 or batch.top_k[i] == 1:
                noise[i].fill_(1.0)
                continue
            gen.manual_seed(row_seed(seed, step))
            noise[i].exponential_(generator=gen)
        return noise

    # ------------------------------------------------------------------ logprobs
    def logprobs(self, raw: torch.Tensor, ids: torch.Tensor, token_ids: list[int], batch: SamplingBatch) -> SamplerOutput:
        """The output for tokens `ids` (also as `token_ids`) drawn from logits `raw` [B, V], with
        the logprobs and top logprobs that each row asks for."""
        logprobs = torch.log_softmax(raw, dim=-1)
        chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
        k = max(batch.top_logprobs)
        if k > 0:
            top_vals, top_ids = logprobs.topk(k, dim=-1)
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        else:
            top_vals = top_ids = [[] for _ in token_ids]
        lps, tops = [], []
        for i, want in enumerate(batch.top_logprobs):
            lps.append(chosen[i] if want >= 0 else None)
            tops.append(list(zip(top_ids[i][:want], top_vals[i][:want])) if want > 0 else [])
        return SamplerOutput(token_ids, lps, tops)


def first_max(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The index of each row's first maximum, [B, V] -> [B] int64 (argmax's answer), written into
    `out` if given. On a GPU over a large vocabulary: into `out`, one launch (kernels/triton_sample:
    a program per chunk, an atomic max per row); else two passes, the first maximum of each of ~128
    chunks, then the first chunk holding the largest (torch's one-pass reduction runs one block a
    row: 27.7 µs for 128 256 fp32 logits on the H200, bench/NOTES-gpu-decode.md run 13).
    Elsewhere torch's max (faster on CPU than argmax)."""
    V = logits.shape[1]
    if (out is not None and logits.is_cuda and _LARGE_VOCAB <= V < (1 << 24) and logits.stride(-1) == 1
            and out.stride(0) == 1 and _triton_first_max() is not None):  # masked chunks: any V
        return _triton_first_max()(logits, out)
    chunk = _chunk(V) if logits.is_cuda else 0
    chunked = chunk and logits.is_contiguous()
    ids = chunked_first_max(logits, chunk) if chunked else logits.max(dim=-1).indices
    return ids if out is None else out.copy_(ids)


@functools.lru_cache(maxsize=1)
def _triton_first_max():
    """kernels/triton_sample's first_max_into, or None without Triton."""
    try:
        from flotilla.kernels.triton_sample import first_max_into
    except ImportError:
        return None
    return first_max_into


def chunked_first_max(logits: torch.Tensor, chunk: int) -> torch.Tensor:
    """first_max's two passes over chunks of `chunk` logits (a divisor of V; logits contiguous)."""
    B, V = logits.shape
    part = logits.view(B, V // chunk, chunk).max(dim=-1)  # per chunk: [B, V / chunk]
    j = part.values.max(dim=-1, keepdim=True).indices  # [B, 1]: the first chunk with the row's maximum
    return (j * chunk + part.indices.gather(1, j)).squeeze(1)


@functools.lru_cache(maxsize=8)
def _chunk(V: int) -> int:
    """A chunk length for first_max: the largest divisor of V in [256, 1024] (0: none, or V small)."""
    if V < _LARGE_VOCAB:
        return 0
    return next((c for c in range(1024, 255, -1) if V % c == 0), 0)


def row_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed from (request seed, token index): splitmix64 of their combination."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _on(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small per-row tensor on `device` without waiting for it: through pinned memory and a
    non-blocking copy on CUDA (a plain `torch.tensor(..., device=cuda)` synchronizes the stream)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _counts(token_lists: list[list[int]], B: int, V: int, dev: torch.device) -> torch.Tensor:
    """[B, V] occurrence counts of each row's tokens (one scatter, no per-token Python work)."""
    counts = torch.zeros(B, V, device=dev)
    lengths = [len(t) for t in token_lists]
    if sum(lengths):  # (the output size given: no device sync)
        rows = torch.repeat_interleave(torch.arange(B, device=dev), _on(lengths, torch.int64, dev),
                                       output_size=sum(lengths))
        ids = _on([t for ts in token_lists for t in ts], torch.int64, dev)
        counts.index_put_((rows, ids), torch.ones_like(ids, dtype=counts.dtype), accumulate=True)
    return counts


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) what falls outside each row's top-k and top-p nucleus."""
    B, V = logits.shape
    dev = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=dev)[None, :]
    k = _on([k if 0 < k < V else V for k in top_k], torch.int64, dev)[:, None]
    drop = rank >= k
    if any(x < 1.0 for x in top_p):
        p = _on(top_p, torch.float32, dev)[:, None]
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        drop |= (probs.cumsum(dim=-1) - probs) > p  # keep the smallest prefix whose mass reaches p
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, masked)
