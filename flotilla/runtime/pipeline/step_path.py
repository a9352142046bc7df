"""A worker's data path: its steps from arrival to the next hop (the Worker, worker.py, serves the
connections and the head's control messages around it).

A decode step (every sequence brings at most the configured query length, as in a replayed
decode graph) runs right where it arrives, on the event loop's thread, and its output is written
to the next hop's socket before the loop reads on: a hop costs no thread hand-off. Longer steps
(prefill chunks) go to one compute thread, and so does every step behind them until it has
caught up, so steps always run in arrival order and heartbeats are answered while a long chunk
computes. Each step carries the epoch it was sent in; steps of any other epoch are dropped.

Overlapped decodes (the head sends a decode before it has read the step before it): stage 0
holds such a step (and every step behind it, to keep the order) in its FeedGate until the last
stage's `Sampled` ids of the step before have come; then it fills in the input tokens and runs
it as any other. While it waits, stage 0 has nothing else to do, so it prepares the step then:
the sequence mirror, the step's inputs and, on a GPU, the decode graph's static inputs
(`StageRuntime.prepare`); when the ids come, only they go to the device before the replay. The
last stage sends `Sampled` on its feedback link before the StepResult goes to the head, so the
ring stage 0 -> ... -> last -> stage 0 turns without the head.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from flotilla import envs

from .connection import Connection
from .feed import FeedGate
from .lane import LaneIn, LaneOut
from .messages import DeviceLane, Fault, Sampled, Step, StepResult
from .outbox import Outbox
from .stage_runtime import Lanes, StageRuntime
from .wire import ProtocolError

log = logging.getLogger("flotilla.pipeline.worker")


@dataclass
class Counters:
    steps: int = 0
    tokens: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_bytes: int = 0
    bytes_sent: int = 0
    compute_seconds: float = 0.0
    send_seconds: float = 0.0


@dataclass
class Link:
    """An outgoing connection made for one epoch (to the next stage, stage 0, or the head's results)."""

    conn: Connection
    outbox: Outbox
    epoch: int
    watch: asyncio.Task | None = field(default=None)


class StepPath:
    """One worker's steps. Everything but the compute thread runs on the event loop's thread;
    `lock` is held while a step runs or the stage changes (`swap`)."""

    def __init__(self, device, fault: Callable[[int, str], None]):
        self.device = device
        self.fault = fault  # (epoch, message): tell the head its ring broke
        self.runtime: StageRuntime | None = None
        self.epoch = 0
        self.stage_index = -1
        self.downstream: Link | None = None
        self.results: Link | None = None  # the head's result connection of this epoch (last stage)
        self.feedback: Link | None = None  # the last stage's link to stage 0 (Sampled), in a ring of several
        self.gate = FeedGate(self._forget_ids)  # stage 0: overlapped decodes wait there for their input ids
        self.lanes = Lanes()  # this epoch's device lanes (lane.py): in from the offers, out with the links
        self._pending_lanes: list[DeviceLane] = []  # offers of an epoch this stage is not in yet
        self.counters = Counters()
        self.inline_query_len = 1  # a step whose sequences bring at most this many tokens runs on the loop
        self.lock = threading.Lock()
        self.on_step: Callable[[], None] = lambda: None  # each step's arrival (spin.SpinSelector.arm)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._steps: queue.SimpleQueue = queue.SimpleQueue()  # steps for the compute thread
        self._behind = 0  # steps handed to the compute thread and not yet emitted
        self._compute: threading.Thread | None = None
        self._loop_thread = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._compute = threading.Thread(target=self._compute_loop, name="flotilla-stage", daemon=True)
        self._compute.start()

    def stop(self) -> None:
        self._steps.put(None)

    def locked(self, fn, *args):
        with self.lock:
            return fn(*args)

    def swap(self, runtime: StageRuntime | None) -> None:
        with self.lock:
            old, self.runtime = self.runtime, runtime
        if old is not None and old is not runtime:
            old.close()

    def idle(self) -> bool:
        """Whether the compute thread has nothing to do (spin.py polls only then)."""
        return self._behind == 0

    # ------------------------------------------------------------------ arrivals
    def step_arrived(self, msg: Step) -> None:
        """A step of this epoch goes through stage 0's gate (an overlapped decode waits there for
        its input ids, and every step behind it too) and is dispatched."""
        self.on_step()
        if msg.epoch == self.epoch:
            self._through(self.gate.step, msg)
            self._prepare_parked()

    def sampled_arrived(self, msg: Sampled) -> None:
        """Stage 0: the last stage's ids of a step; the steps that waited for them run."""
        if msg.epoch == self.epoch:
            self._through(self.gate.sampled, msg)
            self._prepare_parked()

    def _through(self, gate, msg) -> None:
        try:
            steps = gate(msg)
        except ValueError as e:
            self.fault(msg.epoch, f"stage {self.stage_index}: {e}")
            return
        for step in steps:
            self._dispatch(step)

    def _prepare_parked(self) -> None:
        """The first step waiting for its ids, when nothing runs before it: its inputs are made
        ready now, off the ring's critical path (the steps before it have all run here)."""
        head = self.gate.waiting()
        runtime = self.runtime
        if (head is None or self._behind or runtime is None or head.epoch != self.epoch
                or not self._inline(head) or runtime.prepared_mb == head.mb):
            return
        try:
            with self.lock:
                runtime.prepare(head)
        except Exception as e:  # noqa: BLE001 - the head hears of it and rebuilds the ring
            log.exception("preparing step %d failed", head.mb)
            self.fault(head.epoch, f"stage {self.stage_index} failed a step: {type(e).__name__}: {e}")

    def _inline(self, msg: Step) -> bool:
        return sum(msg.query_lens) <= len(msg.query_lens) * self.inline_query_len

    def _dispatch(self, msg: Step) -> None:
        """Run a decode step here and now, unless steps wait for the compute thread (then it
        queues behind them); hand anything longer to the compute thread."""
        if self._behind == 0 and self._inline(msg):
            out, feed = self._run_step(msg)
            start = time.perf_counter()
            self._emit(out, feed)
            self.counters.send_seconds += time.perf_counter() - start
            return
        self._behind += 1
        self._steps.put(msg)

    def _compute_loop(self) -> None:
        if self.device.type == "cuda":
            import torch
            torch.cuda.set_device(self.device)  # this thread's launches go to the stage's GPU
        while True:
            msg = self._steps.get()
            if msg is None:
                return
            self._loop.call_soon_threadsafe(self._caught_up, *self._run_step(msg))

    def _caught_up(self, out: Step | StepResult | Fault | None, feed: bool) -> None:
        self._behind -= 1
        self._emit(out, feed)

    def _run_step(self, msg: Step) -> tuple[Step | StepResult | Fault | None, bool]:
        """Run one step (on either thread): what goes to the next hop (a Fault for the head if the
        step failed, or None for a step of a broken ring), and whether its ids are still to be fed
        to stage 0 (not when the last stage sent them down the ids lane already)."""
        if msg.epoch != self.epoch:
            return None, False
        early: list[Sampled] = []

        def send_early(sampled: Sampled) -> None:  # the ids lane's Sampled, before this host waits for the ids
            early.append(sampled)
            if threading.get_ident() == self._loop_thread:
                self._feed(sampled)
            else:
                self._loop.call_soon_threadsafe(self._feed, sampled)

        with self.lock:
            if self.runtime is None or msg.epoch != self.epoch:
                return None, False
            try:
                start = time.perf_counter()
                out = self.runtime.run(msg, self.lanes, send_early if self.feedback is not None else None)
                self.counters.compute_seconds += time.perf_counter() - start
            except Exception as e:  # noqa: BLE001 - the head hears of it and rebuilds the ring
                log.exception("step %d failed", msg.mb)
                return Fault(msg.epoch, f"stage {self.stage_index} failed a step: {type(e).__name__}: {e}"), False
        return out, msg.feed and not early

    def _feed(self, sampled: Sampled) -> None:
        """The last stage: a step's ids (or their lane slot) to stage 0, on the feedback link."""
        if self.feedback is not None and self.feedback.epoch == sampled.epoch:
            self.feedback.outbox.put(sampled)

    def _emit(self, out: Step | StepResult | Fault | None, feed: bool = False) -> None:
        """Send a step's output on: hidden states to the next stage; sampled ids to the head, and
        first to stage 0 when the step asked (`feed`: an overlapped decode waits for them)."""
        if out is None:
            return
        if isinstance(out, Fault):
            self.fault(out.epoch, out.message)
        elif out.epoch != self.epoch:
            return
        elif isinstance(out, StepResult):
            if feed:
                self._feed(Sampled(out.epoch, out.mb, out.token_ids))
            if self.results is not None and self.results.epoch == out.epoch:
                self.results.outbox.put(out)
            if feed and self.stage_index == 0:  # a ring of one stage feeds itself
                self.sampled_arrived(Sampled(out.epoch, out.mb, out.token_ids))
        elif self.downstream is not None and self.downstream.epoch == out.epoch:
            self.downstream.outbox.put(out)

    def count(self, msg, nbytes: int) -> None:
        """An Outbox's callback: a data frame of `nbytes` went out."""
        if not isinstance(msg, (Step, StepResult, Sampled)):
            return
        c = self.counters
        c.bytes_sent += nbytes
        if isinstance(msg, Step):
            tokens = sum(msg.query_lens)
            c.steps += 1
            c.tokens += tokens
            if msg.num_decodes == len(msg.handles):
                c.decode_steps += 1
                c.decode_tokens += tokens
                c.decode_bytes += nbytes

    def drop_results(self) -> None:
        link, self.results = self.results, None
        if link is not None:
            link.outbox.close()

    # ------------------------------------------------------------------ device lanes
    def lane_offered(self, msg: DeviceLane) -> None:
        """An upstream stage offers a lane: map it where this process can (else its steps keep
        coming through the socket). Not into a tensor-parallel stage (its ranks take the inputs
        from rank 0's host)."""
        if msg.kind not in ("hidden", "ids"):
            raise ProtocolError(f"a device lane of kind {msg.kind!r}")
        runtime = self.runtime
        if runtime is None or runtime.lm.parallel is not None or msg.epoch < self.epoch:
            return
        if msg.epoch > self.epoch:  # before this stage's own Configure: installed by it
            self._pending_lanes.append(msg)
            return
        lane = LaneIn.open(msg, self.device)
        if lane is None:
            return
        if msg.kind == "hidden":
            self.lanes.hidden_in = lane
        else:
            self.lanes.ids_in = lane
        log.info("epoch %d: the %s lane from the previous hop is mapped (%s)", msg.epoch, msg.kind, msg.device)

    def open_lane(self, kind: str, epoch: int) -> DeviceLane | None:
        """This stage's outgoing lane of `kind` for a new link, and its offer (None: no lane)."""
        runtime = self.runtime
        if not envs.lanes() or runtime is None or runtime.runner is None or self.device.type not in ("cpu", "cuda"):
            return None
        if kind == "ids" and (runtime.executor is not runtime.runner or runtime.runner.max_launch_rows == 0):
            return None
        lane = None
        try:
            if kind == "hidden":
                rows = min(max(runtime.shape.graph_tokens, 64), 1024)
                lane = LaneOut(kind, self.device, runtime.lm.dtype, rows, runtime.lm.config.hidden_size)
            else:
                lane = LaneOut(kind, self.device, torch.int64, runtime.runner.max_launch_rows, 1)
            offer = lane.offer(epoch)
        except (OSError, RuntimeError, ValueError) as e:  # lanes are optional: the frames carry it all
            log.info("no %s lane this epoch: %s: %s", kind, type(e).__name__, e)
            if lane is not None:
                lane.close()
            return None
        if kind == "hidden":
            self.lanes.hidden_out = lane
        else:
            self.lanes.ids_out = lane
        return offer

    def drop_lanes_before(self, epoch: int) -> None:
        """A new epoch (`self.epoch` set to it): the incoming lanes of older ones go, and those
        offered for it before its Configure came are mapped now."""
        for kind in ("hidden_in", "ids_in"):
            lane = getattr(self.lanes, kind)
            if lane is not None and lane.epoch < epoch:
                setattr(self.lanes, kind, None)
        pending, self._pending_lanes = self._pending_lanes, []
        for msg in pending:
            self.lane_offered(msg)

    def lane_counts(self) -> tuple[int, int]:
        """(outputs sent through this epoch's outgoing lanes, outputs they refused)."""
        lanes = self.lanes.outgoing
        return sum(lane.sent for lane in lanes), sum(lane.refused for lane in lanes)

    def reset_lane_counts(self) -> None:
        for lane in self.lanes.outgoing:
            lane.sent = lane.refused = 0

    def _forget_ids(self, seq: int) -> None:
        """Stage 0's gate: an ids-lane slot no step will read."""
        if self.lanes.ids_in is not None:
            self.lanes.ids_in.done(seq)

    def drop_downstream(self) -> None:
        """Close this epoch's outgoing links (to the next stage, and the feedback link) and their lanes."""
        lanes, self.lanes.hidden_out, self.lanes.ids_out = self.lanes.outgoing, None, None
        for lane in lanes:
            lane.close()
        links, self.downstream, self.feedback = (self.downstream, self.feedback), None, None
        for link in links:
            if link is not None:
                if link.watch is not None:
                    link.watch.cancel()
                link.outbox.close()
