"""The engine's view of a pipeline: submit steps as diffs, collect the sampled tokens.

Unlike a local ModelRunner, a pipeline keeps several steps (micro-batches) in flight, so the
interface is split: `submit` returns a micro-batch id at once, `results` returns whichever have
come back. `execute` (the plain Executor protocol) is submit-and-wait, for callers that run one
step at a time.

A step is accepted only for the pipeline generation the engine has seen (`generation` changes
at every fault): a step submitted across a fault is dropped, and results of an older epoch are
ignored, so nothing computed by a broken ring reaches the engine.
"""
from __future__ import annotations

import itertools

from flotilla.errors import FlotillaError
from flotilla.runtime.model_runner import StepInput
from flotilla.runtime.sampler import SamplerOutput

from .pipeline import Pipeline
from .step_codec import StepEncoder, sampler_output


class PipelineExecutor:
    max_launch_rows = 1 << 30  # overlapped decodes (PipelineEngine): the last stage samples any batch
    computes_prompt_logprobs = True  # the last stage computes them (Step/StepResult.prompt_logprobs)

    def __init__(self, pipeline: Pipeline):
        self.pipeline = pipeline
        self.encoder = StepEncoder()
        self._epoch = -1
        self._ids = itertools.count(1)
        self._submitted: dict[int, int] = {}  # micro-batch id -> epoch it was sent in

    @property
    def depth(self) -> int:
        """Micro-batches worth keeping in flight (Pipeline.depth)."""
        return self.pipeline.depth

    @property
    def max_prob_bytes(self) -> int:
        """Most bytes of draft distributions one step frame may carry: a quarter of the frame
        limit, the rest is for hidden states and the step itself."""
        return self.pipeline.settings.link.max_frame // 4

    @property
    def generation(self) -> int:
        return self.pipeline.generation

    @property
    def ready(self) -> bool:
        return self.pipeline.ready.is_set()

    @property
    def down_since(self) -> float | None:
        return self.pipeline.down_since

    def wait_ready(self, timeout: float) -> bool:
        return self.pipeline.ready.wait(timeout)

    @property
    def prefers_overlap(self) -> bool:
        """Overlapped decodes pay where one micro-batch is in flight (stages taking turns on one
        GPU): the head's work for a step then hides behind the ring's work for the next."""
        return self.depth == 1

    def same_rows(self, num_rows: int, fewer: int) -> bool:
        """Never promised across the ring (stages of other kinds, batch sizes in other graph
        buckets): a step sent ahead with a sequence that ended is dropped and recomputed."""
        return False

    def submit(self, step: StepInput, generation: int, prev_mb: int = 0, feed: bool = False) -> int:
        """Send a step; `prev_mb`, `feed`: see StepEncoder.encode (overlapped decodes)."""
        mb = next(self._ids)
        p = self.pipeline
        epoch = p.epoch
        if generation != p.generation or not p.ready.is_set():
            return mb  # lost with the ring; the engine rewinds at its next step
        if epoch != self._epoch:
            self.encoder.reset()
            self._epoch = epoch
        self._submitted[mb] = epoch
        p.send_step(self.encoder.encode(step, epoch, mb, prev_mb, feed))
        return mb

    def discard(self, mb: int) -> None:
        """The engine dropped this step: its result, when it comes, is ignored."""
        self._submitted.pop(mb, None)

    def results(self, timeout: float) -> list[tuple[int, SamplerOutput]]:
        out = []
        for r in self.pipeline.get_results(timeout):
            if self._submitted.pop(r.mb, None) == r.epoch:
                out.append((r.mb, sampler_output(r)))
        return out

    def execute(self, step: StepInput) -> SamplerOutput:
        generation = self.generation
        mb = self.submit(step, generation)
        while self.generation == generation:
            for got, result in self.results(0.1):
                if got == mb:
                    return result
        raise FlotillaError(f"the pipeline failed during a step: {self.pipeline.describe_down()}")

    def release(self, request_id: str) -> None:
        self.encoder.release(request_id)

    def reset(self) -> None:
        """Forget everything in flight (the engine re-prefills after a fault)."""
        self._submitted.clear()
        self.encoder.reset()

    def problems(self) -> list[str]:
        return self.pipeline.problems()

    def fatal(self) -> list[str]:
        return self.pipeline.fatal()

    def stage_status(self) -> list[tuple[int, str, str, bool]]:
        return self.pipeline.stage_status()

    def describe_down(self) -> str:
        return self.pipeline.describe_down()

    def close(self) -> None:
        self.pipeline.close()

