"""Stage 0's gate for overlapped decodes: steps leave it in the order they came, each with its
input tokens.

The head sends an overlapped decode before it has read the step before it (PipelineEngine): its
tokens are "row r of the ids the last stage samples for step `prev_mb`", which the last stage
sends stage 0 (`Sampled`) on its feedback link. Such a step waits here until those ids have
come, and so does every step behind it, so that stage 0 runs steps in the order the head sent
them (what keeps KV writes before the reads that depend on them). Ids no later step can name
(those of steps before the one just let through) are forgotten.
"""
from __future__ import annotations

import collections

from .messages import Sampled, Step
from .step_codec import fill_tokens, lane_tokens


class FeedGate:
    """One epoch's steps at stage 0 (`reset` at each Configure). Not thread-safe: the worker's
    event-loop thread owns it.

    Ids that came in the ids lane (lane.py: `Sampled.lane_seq`, the ids still on the device) are
    not filled in: the step goes on with its `prev_rows` and the lane slot (`Step.lane_seq`), and
    stage 0 reads them on the device. A lane slot no step will read is handed to `forget`."""

    def __init__(self, forget=lambda seq: None):
        self._fed: dict[int, list[int] | tuple[int, int]] = {}  # sampled ids by step, or (lane slot, ids in it)
        self._forget = forget
        self._parked: collections.deque[Step] = collections.deque()
        self.parked_steps = 0  # overlapped decodes that came before their ids (the head ahead of the ring)

    def reset(self) -> None:
        self._fed.clear()
        self._parked.clear()

    def __len__(self) -> int:
        return len(self._parked)

    def waiting(self) -> Step | None:
        """The first parked step (it waits for its ids; every step before it has left the gate)."""
        return self._parked[0] if self._parked else None

    def step(self, msg: Step) -> list[Step]:
        """A step came: what may run now (it, tokens filled in, or nothing while it must wait)."""
        if self._parked or (msg.prev_rows is not None and msg.prev_mb not in self._fed):
            self.parked_steps += msg.prev_rows is not None and msg.prev_mb not in self._fed
            self._parked.append(msg)
            return []
        return [self._through(msg)]

    def sampled(self, msg: Sampled) -> list[Step]:
        """The last stage's ids of a step came: the parked steps that may run now, in order."""
        self._fed[msg.mb] = (msg.lane_seq, msg.lane_rows) if msg.lane_seq else msg.token_ids
        out = []
        while self._parked:
            head = self._parked[0]
            if head.prev_rows is not None and head.prev_mb not in self._fed:
                break
            out.append(self._through(self._parked.popleft()))
        return out

    def _through(self, msg: Step) -> Step:
        """The step as it runs (ValueError: its rows do not fit the ids)."""
        if msg.prev_rows is not None:
            fed = self._fed.pop(msg.prev_mb)
            try:
                msg = fill_tokens(msg, fed) if isinstance(fed, list) else lane_tokens(msg, *fed)
            except ValueError:
                if isinstance(fed, tuple):
                    self._forget(fed[0])  # refused: no step reads its slot now
                raise
        for mb in [mb for mb in self._fed if mb < msg.mb]:  # named by no step after this one
            fed = self._fed.pop(mb)
            if isinstance(fed, tuple):
                self._forget(fed[0])
        return msg
