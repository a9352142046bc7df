"""Host memory that costs nothing until it is used, how much of it is resident, and glibc's malloc
settings for a CPU process that loads a model and then runs steps.

A page of an anonymous private mapping reads as zero and takes no RAM until it is written: a KV
pool mapped so holds its reservation in address space only, and RSS grows with the blocks the
scheduler hands out, not with the pool's size.
"""
from __future__ import annotations

import contextlib
import math
import mmap
import sys
from collections.abc import Iterator

import torch


def zero_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros on fresh anonymous pages, none of them touched: each page becomes
    resident when first written (reads of an untouched page see the shared zero page)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # where THP is "always", one write would make 2 MiB resident
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    # the tensor holds a reference to the mapping: it lives as long as the tensor does
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def resident_bytes(t: torch.Tensor) -> int | None:
    """Bytes of the mapping that holds `t` which are resident now (Linux: the kernel's count for
    that mapping in /proc/self/smaps), or None where it cannot tell."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return None
    addr, rss_next = t.data_ptr(), False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                if rss_next and line.startswith("Rss:"):
                    return int(line.split()[1]) * 1024
                head = line.split(" ", 1)[0]
                if "-" in head and not line[0].isupper():  # a mapping's first line: start-end perms ...
                    start, end = (int(x, 16) for x in head.split("-"))
                    rss_next = start <= addr < end
    except OSError:
        return None
    return None


def _libc():
    """glibc (for mallopt and malloc_trim), or None elsewhere."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not sys.platform.startswith("linux") or not name:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


@contextlib.contextmanager
def lean_cpu_load(device: torch.device | str | None) -> Iterator[None]:
    """Around loading a model on the CPU: keep the load's transient buffers out of the process's
    footprint, then settle glibc where a run of steps wants it. Process-wide settings, so only
    the entry points (the `runtime` subcommands, worker processes, benches) use this; a library
    caller of `load_model` keeps its own malloc settings.

    During the load every block from 1 MiB up is mapped and unmapped when freed (loading packs
    one tensor at a time through buffers of up to tens of MB; with glibc's dynamic thresholds
    they would stay in the heap for good: ~60 MB for a 135M-parameter model), and afterwards
    malloc_trim returns the small blocks the load freed (~20 MB). Then the thresholds go where
    glibc's dynamic ones settle (32 MiB mmap, 64 MiB trim): a step's activations (tens of MB in
    a prefill) reuse the heap instead of faulting in fresh pages on every call (a fixed 1 MiB
    threshold cost 35% of prefill speed)."""
    libc = _libc() if torch.device(device or "cpu").type == "cpu" else None
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    try:
        yield
    finally:
        if libc is not None:
            libc.malloc_trim(0)
            libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
            libc.mallopt(M_TRIM_THRESHOLD, 64 << 20)
