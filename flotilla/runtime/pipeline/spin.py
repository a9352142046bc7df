"""Polling before sleeping: a worker's event loop that stays awake between the steps of a ring.

Each hop of a decode step wakes a process that sleeps in epoll: the hop's own work is tens of µs,
but the wake-up of a sleeping thread on an idle core (deep C-states; an idle vCPU halted by its
hypervisor) can cost as much again or more. `SpinSelector` polls (epoll with a zero timeout) for
up to `spin` seconds after its last event before it sleeps, so while steps keep coming the next
one finds the loop awake; an idle worker sleeps as before. Polling takes a core while the ring is
busy: it is for machines with cores to spare (`spare_cores`), and never while `allowed()` is
false (the worker's compute thread is busy with a prefill chunk and needs the GIL).
"""
from __future__ import annotations

import math
import selectors
import time
from typing import Callable

DEFAULT_SPIN_US = 20_000  # longer than a decode step's trip round the ring, so that a busy ring never sleeps


class SpinSelector(selectors.DefaultSelector):
    def __init__(self, spin: float, allowed: Callable[[], bool] = lambda: True):
        super().__init__()
        self.spin = spin
        self.allowed = allowed
        self._hot_until = 0.0  # polling until then: the last event + spin

    def select(self, timeout: float | None = None):
        if self.spin > 0 and (timeout is None or timeout > 0):
            now = time.monotonic()
            limit = now + timeout if timeout is not None else math.inf
            end = min(self._hot_until, limit)
            if now < end and self.allowed():
                while now < end:
                    ready = super().select(0)
                    if ready:
                        self._hot_until = time.monotonic() + self.spin
                        return ready
                    now = time.monotonic()
                timeout = None if limit == math.inf else max(0.0, limit - now)
        ready = super().select(timeout)
        if ready and self.spin > 0:
            self._hot_until = time.monotonic() + self.spin
        return ready


def spare_cores(cores: int, threads: list[int | None]) -> bool:
    """Whether a machine of `cores` cores runs a head (one busy thread) and local workers of these
    CPU threads (None: a GPU worker, one thread) with room for polling: each polls on a thread it
    computes with, so the ring must simply not need more cores than there are."""
    return cores >= 1 + sum(t or 1 for t in threads)
