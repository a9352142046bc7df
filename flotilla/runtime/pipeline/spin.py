"""Polling before sleeping: a worker's event loop that stays awake between the steps of a ring.

Each hop of a decode step wakes a process that sleeps in epoll: the hop's own work is tens of µs,
but the wake-up of a sleeping thread on an idle core (deep C-states; an idle vCPU halted by its
hypervisor) can cost as much again or more. `SpinSelector` polls (epoll with a zero timeout) for
up to `spin` seconds after the worker last saw a step (`arm`) before it sleeps, so while steps
keep coming the next one finds the loop awake; a worker without steps (idle, or loading its
stage) sleeps as before. Polling takes a core while the ring is busy: it is for machines with
cores to spare (`spare_cores`), and never while `allowed()` is false: the polling thread holds
the GIL between its polls, and the worker's compute thread, busy with a prefill chunk, needs it.
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
        self._hot_until = 0.0  # polling until then: the last step + spin

    def arm(self) -> None:
        """A step came: poll for the next one for up to `spin` seconds."""
        self._hot_until = time.monotonic() + self.spin

    def select(self, timeout: float | None = None):
        if self.spin > 0 and (timeout is None or timeout > 0):
            now = time.monotonic()
            limit = now + timeout if timeout is not None else math.inf
            end = min(self._hot_until, limit)
            if now < end and self.allowed():
                while now < end:
                    ready = super().select(0)
                    if ready:
                        return ready
                    now = time.monotonic()
                timeout = None if limit == math.inf else max(0.0, limit - now)
        return super().select(timeout)


def spare_cores(cores: int, threads: list[int | None]) -> bool:
    """Whether a machine of `cores` cores runs a head (one busy thread) and local workers of these
    CPU threads (None: a GPU worker, one thread) with room for polling: each polls on a thread it
    computes with, so the ring must simply not need more cores than there are."""
    return cores >= 1 + sum(t or 1 for t in threads)
