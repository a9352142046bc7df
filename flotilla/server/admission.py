"""Admission control: a bound on sequences in flight (running slots + --max-queue), and draining.

Counting happens when a request is admitted, before the engine sees it, so the bound is exact
even when hundreds of requests arrive in the same instant.
"""
from __future__ import annotations

import asyncio
from contextlib import contextmanager
from typing import Iterator

from .errors import ApiError


class Admission:
    def __init__(self, capacity: int, max_queue: int, retry_after: int = 1):
        self.capacity = capacity  # sequences the engine runs at once
        self.max_queue = max_queue
        self.retry_after = retry_after
        self.in_flight = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def limit(self) -> int:
        return self.capacity + self.max_queue

    @property
    def queued(self) -> int:
        return max(0, self.in_flight - self.capacity)

    def check_open(self) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down and takes no new requests; retry on another replica "
                                "or after it restarts", code="shutting_down")

    def check_fits(self, sequences: int) -> None:
        """A 400 where a request of this many sequences could never be admitted, however idle the server."""
        if sequences > self.limit:  # not a retry
            raise ApiError(400, f"the request asks for {sequences} sequences (n x prompts) and this server holds at "
                                f"most {self.limit} at once ({_slots(self.capacity)} + a queue of "
                                f"{self.max_queue}); ask for fewer", code="too_many_sequences")

    @contextmanager
    def admit(self, sequences: int) -> Iterator[None]:
        self.check_open()
        self.check_fits(sequences)
        if self.in_flight + sequences > self.limit:
            raise ApiError(429, f"the server is at capacity ({self.in_flight} sequences in flight, "
                                f"{_slots(self.capacity)} + a queue of {self.max_queue}); retry after "
                                f"{self.retry_after}s", code="queue_full",
                           headers={"Retry-After": str(self.retry_after)})
        self.in_flight += sequences
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= sequences
            if self.in_flight == 0:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True when everything in flight finished within `timeout` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


def _slots(n: int) -> str:
    return f"{n} running slot{'' if n == 1 else 's'}"
