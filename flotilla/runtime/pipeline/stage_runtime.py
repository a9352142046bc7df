"""One loaded stage on a worker: its layers, its KV cache, the runner, and the sequence mirror.

`run` takes a `Step` from the previous hop and returns what goes to the next: the same step with
this stage's hidden states (packed in the wire dtype), or, on the last stage, the sampled tokens.
Called under the worker's lock, from its event-loop thread (decode steps) or its compute thread
(longer steps).

On a GPU the stage runs like a local GPU engine: Triton kernels, paged attention, and decode
steps replayed from CUDA graphs captured when the head configures the pool (`Configure` says
for how many tokens); hidden states cross host memory through pinned buffers (HostStaging), and
a replay copies the received ones straight into its graph's input. `prepare` does a step's
host work before its input tokens are known (stage 0, while an overlapped decode waits for the
last stage's ids): `run` then only writes the ids and replays.
Under tensor parallelism (`runtime worker --tp M`) this process is rank 0 of the stage's group:
the runner's steps go through the TPExecutor, which hands every step (and the incoming hidden
states) to the other ranks; TP ranks step eagerly.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import torch

from flotilla.models.llama import Stage
from flotilla.runtime.cuda_graphs import capture_sizes
from flotilla.runtime.kv_cache import KVCache, KVCacheSpec, plan_kv_cache, plan_num_blocks
from flotilla.runtime.loader import LoadedModel
from flotilla.runtime.model_runner import ModelRunner, StepInput

from .activations import OWN_DTYPE, HostStaging, pack, unpack
from .lane import LaneIn, LaneOut
from .messages import Configure, LoadStage, Sampled, Step, StepResult
from .step_codec import StageSequences, step_result
from .wire import DEFAULT_MAX_FRAME


def on_device(device: torch.device, fn, *args):
    """fn(*args) with `device` as the calling thread's current CUDA device (kernels that launch
    on the current device, such as Triton's, then find their tensors)."""
    if device.type != "cuda":
        return fn(*args)
    with torch.cuda.device(device):
        return fn(*args)


@dataclass
class Lanes:
    """A stage's device lanes of the current epoch (lane.py; StepPath holds them)."""

    hidden_in: LaneIn | None = None  # from the previous stage
    hidden_out: LaneOut | None = None  # to the next stage
    ids_in: LaneIn | None = None  # stage 0: the last stage's sampled ids
    ids_out: LaneOut | None = None  # the last stage: its sampled ids, to stage 0

    @property
    def outgoing(self) -> list[LaneOut]:
        return [lane for lane in (self.hidden_out, self.ids_out) if lane is not None]


@dataclass(frozen=True)
class RunnerShape:
    """What the runner is built for; a Configure that changes it rebuilds the pool and the graphs."""

    num_blocks: int
    graph_tokens: int = 0
    graph_query_len: int = 1
    max_model_len: int = 0

    @classmethod
    def of(cls, msg: Configure) -> "RunnerShape":
        return cls(msg.num_blocks, msg.graph_tokens, msg.graph_query_len, msg.max_model_len)


@dataclass
class StageTimes:
    """Seconds the stage's steps spent in each part of `StageRuntime.run` (WorkerStats): the
    ring's critical path (a step's `prepare`, done while it waited for its ids, is not counted)."""

    prepare: float = 0.0
    execute: float = 0.0
    output: float = 0.0


@dataclass(frozen=True)
class _Prepared:
    """A step `prepare` made ready: its StepInput (token ids still unknown), and whether its
    graph's static inputs hold it (`staged`)."""

    mb: int
    step: StepInput
    staged: bool


class StageRuntime:
    def __init__(self, lm: LoadedModel, request: LoadStage, source: str):
        cfg = lm.config
        self.lm = lm
        self.request = request
        self.source = source  # where the weights came from, for the worker's log
        self.stage = Stage(request.start, request.end, request.num_layers)
        # this rank's KV heads (a share of them under tensor parallelism)
        self.spec = KVCacheSpec(tuple(self.stage.layers), lm.model.num_kv_heads, cfg.head_dim, lm.dtype,
                                request.block_size)
        self.cache: KVCache | None = None
        self.runner: ModelRunner | None = None
        self.executor = None  # the runner, or the TPExecutor over it
        self.shape: RunnerShape | None = None
        self.seqs = StageSequences()
        self.wire_dtype = "fp16"
        self.staging = HostStaging(lm.device)
        self.times = StageTimes()
        self._prepared: _Prepared | None = None

    @property
    def memory_shares(self) -> int:
        """Ranks of this stage that share one device's memory (TP ranks on a CPU)."""
        return self.lm.parallel.memory_shares if self.lm.parallel is not None else 1

    def serves(self, req: LoadStage) -> bool:
        """Whether this loaded stage is what `req` asks for (then nothing is reloaded)."""
        mine = self.request
        return (mine.fingerprint, mine.start, mine.end, mine.num_layers, mine.dtype, mine.block_size) == \
               (req.fingerprint, req.start, req.end, req.num_layers, req.dtype, req.block_size)

    def capacity(self, req: LoadStage) -> int:
        """KV blocks this stage can hold (null block included): exactly the pool's size for a stage
        rejoining, else as a single-process run sizes its pool (plan_kv_cache) for this stage's
        layers, the memory shared with the other stages and TP ranks on it. Call it without a
        pool held (`drop_pool`), so that free memory counts all there is."""
        if req.exact_blocks:
            return plan_num_blocks(self.spec, self.lm.device, req.exact_blocks * self.spec.bytes_per_block)
        plan = plan_kv_cache(self.spec, self.lm.device, req.max_model_len, req.max_num_seqs, req.kv_memory or None,
                             req.kv_fraction or None, req.memory_shares * self.memory_shares)
        return plan.num_blocks

    def drop_pool(self) -> None:
        """Free the KV pool and its graphs (the next Configure builds them again)."""
        self.executor = self.runner = self.cache = self.shape = None
        self._prepared = None

    def configure(self, msg: Configure) -> None:
        """A new epoch: a pool of `num_blocks` with its decode graphs (rebuilt only if they change)
        and empty mirrors."""
        shape = RunnerShape.of(msg)
        if shape != self.shape:
            self.drop_pool()  # the old pool and graphs go first
            self.cache = KVCache(self.spec, shape.num_blocks, self.lm.device)
            eager = shape.graph_tokens < 1 or self.lm.parallel is not None  # TP ranks step eagerly
            sizes = () if eager else capture_sizes(shape.graph_tokens)
            self.runner = ModelRunner(self.lm.model, self.cache, graph_sizes=sizes,
                                      max_model_len=shape.max_model_len or None, graph_query_len=shape.graph_query_len)
            self.executor = self.lm.parallel.executor(self.runner) if self.lm.parallel is not None else self.runner
            self.shape = shape
        self.seqs = StageSequences()
        self.wire_dtype = msg.wire_dtype
        self._prepared = None

    @property
    def prepared_mb(self) -> int | None:
        """The step `prepare` made ready, if any."""
        return self._prepared.mb if self._prepared is not None else None

    @torch.inference_mode()
    def prepare(self, msg: Step) -> None:
        """Stage 0: the host work of the next step to run, before its input tokens are known (an
        overlapped decode waiting for them): the mirror, its StepInput and, where a decode graph
        serves it, the graph's static inputs. The steps before it must all have run; the next
        `run` must be this step's."""
        if not self.stage.is_first or self._prepared is not None:
            raise ValueError(f"step {msg.mb} cannot be prepared on stage {self.stage.start}-{self.stage.end - 1}"
                             f" (prepared: {self.prepared_mb})")
        step = self.seqs.apply(msg, self.stage.is_last)
        self._prepared = _Prepared(msg.mb, step, False)  # the mirror has it: `run` must not apply it again
        if self.executor is self.runner and self.runner.stage(step):
            self._prepared = _Prepared(msg.mb, step, True)

    @torch.inference_mode()
    def run(self, msg: Step, lanes: "Lanes | None" = None,
            early: Callable[[Sampled], None] | None = None) -> Step | StepResult:
        """The step's output for the next hop. `lanes`: this stage's device lanes (lane.py), for
        the step's input (`msg.lane_seq`) and its output. `early`: on the last stage, for a `feed`
        step whose ids can go down the ids lane, sends stage 0 its `Sampled` as soon as the
        sampling is queued (before this host waits for the ids)."""
        lanes = lanes or Lanes()
        t0 = time.perf_counter()
        prepared, self._prepared = self._prepared, None
        staged = False
        if prepared is not None:  # its tokens are known now (the gate filled them in)
            if prepared.mb != msg.mb:
                raise ValueError(f"step {msg.mb} came to run while step {prepared.mb} was prepared")
            step, staged = dataclasses.replace(prepared.step, token_ids=msg.token_ids or []), prepared.staged
        else:
            step = self.seqs.apply(msg, self.stage.is_last)
        hidden, lane_in = None, None
        if msg.lane_seq:
            lane_in = self._lane(lanes.ids_in if self.stage.is_first else lanes.hidden_in, msg)
        try:
            if self.stage.is_first and lane_in is not None:  # step prev_mb's ids, still on the device
                n = max(msg.prev_rows or [-1]) + 1
                self.runner.sampled[:n].copy_(lane_in.take(msg.lane_seq, n)[:, 0], non_blocking=True)
                step = dataclasses.replace(step, prev_rows=msg.prev_rows)
            elif lane_in is not None:
                hidden = lane_in.take(msg.lane_seq, step.num_tokens)
                if hidden.shape[1] != self.lm.config.hidden_size:
                    raise ValueError(f"step {msg.mb}: a hidden lane {hidden.shape[1]} wide for a hidden size of "
                                     f"{self.lm.config.hidden_size}")
                hidden = hidden.to(self.lm.dtype)  # (a copy only if the stages' dtypes differ)
            elif not self.stage.is_first:
                hidden = self._hidden(msg, step.num_tokens)
            t1 = time.perf_counter()
            launched = None
            ids_out = lanes.ids_out
            if self.stage.is_last and msg.feed and early is not None and ids_out is not None \
                    and self.executor is self.runner and self.runner.can_launch(step):
                lane_seq = 0

                def to_lane(ids: torch.Tensor) -> None:  # the ids into the lane before their copy to this host
                    nonlocal lane_seq
                    lane_seq = ids_out.put(ids.view(-1, 1))

                launched = self.runner.launch(step, hidden, to_lane)
                if lane_seq:
                    early(Sampled(msg.epoch, msg.mb, [], lane_seq, step.num_seqs))
            else:
                out = self.executor.execute(step, hidden, True) if staged else self.executor.execute(step, hidden)
        finally:
            if lane_in is not None:
                lane_in.done(msg.lane_seq)  # its reads are queued (or, after an error, never will be)
            self.staging.release()  # the received hidden states are on their way in (or in)
        if launched is not None:
            out = launched.result()
        t2 = time.perf_counter()
        times = self.times
        times.prepare += t1 - t0
        times.execute += t2 - t1
        if self.stage.is_last:
            self.seqs.record(msg, out.token_ids, out.accepted)
            return step_result(msg.epoch, msg.mb, out)
        hidden_out = lanes.hidden_out  # (a link dropped meanwhile sets it to None)
        wire = self.wire_dtype
        if hidden_out is not None:
            seq = hidden_out.put(out)
            if seq:
                times.output += time.perf_counter() - t2
                return dataclasses.replace(msg, hidden=None, scales=None, lane_seq=seq, prev_mb=0, prev_rows=None)
            # a same-host link whose lane cannot take this step (not accepted yet, a prefill too large for its
            # slots): over the socket in the stage's own dtype, as the lane would have carried it, so that
            # --wire-dtype (for the network) never changes a same-host pipeline's tokens; but within half a frame
            # (an fp32 CPU stage's prefill chunk of 2048 x 8192 would be all of one)
            if out.numel() * out.element_size() <= DEFAULT_MAX_FRAME // 2:
                wire = OWN_DTYPE
        data, scales = self.staging.to_host(*pack(out, wire))
        times.output += time.perf_counter() - t2
        # (stage 0's input ids from the lane are this stage's own: the next one sees a plain step)
        return dataclasses.replace(msg, hidden=data, scales=scales, lane_seq=0, prev_mb=0, prev_rows=None)

    def _lane(self, lane, msg: Step):
        """The lane a step's input is in (ValueError: none of this epoch)."""
        if lane is None or lane.epoch != msg.epoch:
            raise ValueError(f"step {msg.mb} names slot {msg.lane_seq} of a device lane this stage does not hold")
        return lane

    def _hidden(self, msg: Step, num_tokens: int) -> torch.Tensor:
        """The received hidden states as the runner takes them: in pinned host memory when they
        are already in the stage's dtype (a graph replay copies them straight into its input),
        else unpacked on the device."""
        if msg.hidden is None or msg.hidden.shape != (num_tokens, self.lm.config.hidden_size):
            raise ValueError(f"step {msg.mb}: hidden states of shape "
                             f"{None if msg.hidden is None else tuple(msg.hidden.shape)} for {num_tokens} tokens")
        if msg.hidden.dtype == self.lm.dtype and self.executor is self.runner:
            return self.staging.to_pinned(msg.hidden)[0]
        return unpack(*self.staging.to_device(msg.hidden, msg.scales), self.lm.dtype, self.lm.device)

    def close(self) -> None:
        """Stop the stage's other TP ranks, if any."""
        if self.lm.parallel is not None:
            self.lm.parallel.close()
