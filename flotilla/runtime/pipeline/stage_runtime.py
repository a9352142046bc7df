"""One loaded stage on a worker: its layers, its KV cache, the runner, and the sequence mirror.

`run` takes a `Step` from the previous hop and returns what goes to the next: the same step with
this stage's hidden states (packed in the wire dtype), or, on the last stage, the sampled tokens.
Called only from the worker's compute thread.
"""
from __future__ import annotations

import dataclasses

import torch

from flotilla.models.llama import Stage
from flotilla.runtime.kv_cache import KVCache, KVCacheSpec, free_memory, plan_num_blocks
from flotilla.runtime.loader import LoadedModel
from flotilla.runtime.model_runner import ModelRunner

from .activations import pack, unpack
from .messages import LoadStage, Step, StepResult
from .step_codec import StageSequences, step_result


class StageRuntime:
    def __init__(self, lm: LoadedModel, request: LoadStage, source: str):
        cfg = lm.config
        self.lm = lm
        self.request = request
        self.source = source  # where the weights came from, for the worker's log
        self.stage = Stage(request.start, request.end, request.num_layers)
        self.spec = KVCacheSpec(tuple(self.stage.layers), cfg.num_key_value_heads, cfg.head_dim, lm.dtype,
                                request.block_size)
        self.cache: KVCache | None = None
        self.runner: ModelRunner | None = None
        self.seqs = StageSequences()
        self.wire_dtype = "fp16"

    def serves(self, req: LoadStage) -> bool:
        """Whether this loaded stage is what `req` asks for (then nothing is reloaded)."""
        mine = self.request
        return (mine.fingerprint, mine.start, mine.end, mine.num_layers, mine.dtype, mine.block_size) == \
               (req.fingerprint, req.start, req.end, req.num_layers, req.dtype, req.block_size)

    def capacity(self, req: LoadStage) -> int:
        """KV blocks this stage can hold (null block included) within the request's budget."""
        if req.exact_blocks:
            return plan_num_blocks(self.spec, self.lm.device, req.exact_blocks * self.spec.bytes_per_block)
        memory = req.kv_memory
        if not memory:  # a fraction of what is free, counting the pool this stage already holds as free
            held = self.cache.storage.numel() * self.cache.storage.element_size() if self.cache is not None else 0
            memory = int((free_memory(self.lm.device) + held) * req.kv_fraction)
        return plan_num_blocks(self.spec, self.lm.device, memory, req.kv_fraction, req.max_blocks)

    def configure(self, num_blocks: int, wire_dtype: str) -> None:
        """A new epoch: a pool of `num_blocks` (reallocated only if the size changes) and empty mirrors."""
        if self.cache is None or self.cache.num_blocks != num_blocks:
            self.runner = self.cache = None
            self.cache = KVCache(self.spec, num_blocks, self.lm.device)
            self.runner = ModelRunner(self.lm.model, self.cache)
        self.seqs = StageSequences()
        self.wire_dtype = wire_dtype

    @torch.inference_mode()
    def run(self, msg: Step) -> Step | StepResult:
        step = self.seqs.apply(msg, self.stage.is_last)
        hidden = None
        if not self.stage.is_first:
            if msg.hidden is None or msg.hidden.shape != (step.num_tokens, self.lm.config.hidden_size):
                raise ValueError(f"step {msg.mb}: hidden states of shape "
                                 f"{None if msg.hidden is None else tuple(msg.hidden.shape)} for {step.num_tokens} tokens")
            hidden = unpack(msg.hidden, msg.scales, self.lm.dtype, self.lm.device)
        out = self.runner.execute(step, hidden)
        if self.stage.is_last:
            self.seqs.record(msg, out.token_ids, out.accepted)
            return step_result(msg.epoch, msg.mb, out)
        data, scales = pack(out, self.wire_dtype)
        return dataclasses.replace(msg, hidden=data, scales=scales)
