"""Device lanes: a stage's output handed to the next stage process on the same host through
memory both processes map, so that only bookkeeping crosses the socket.

Two lanes, each one-way on a stage-to-stage link of one epoch:

    hidden   a stage's hidden states [T, H] for the next stage (Step.lane_seq)
    ids      the last stage's sampled ids of a `feed` step for stage 0 (Sampled.lane_seq), sent
             as soon as the sampling is queued on the device, before the ids reach any host

The sender owns a ring of `slots` buffers [rows, width] and a small shared file (its header:
whether the receiver opened the lane, and the last sequence number whose read the receiver has
queued). `put` copies a tensor into the next slot and returns its sequence number s >= 1, or 0
when the lane cannot take it (not accepted yet, too many rows, or the slot's previous content
not yet taken): the caller then sends the bytes in the frame as before, so a lane never stalls a
step. The receiver's `take(s)` gives the slot's view and `done(s)` says it is read.

On a GPU the slots are device memory shared with CUDA IPC, and two interprocess events per slot
order the two processes' streams: the sender records `written` after its copy in, the receiver's
stream waits on it before the read and records `read` after; the sender's next copy into that
slot waits on `read`. A wait only covers records made before it is called, so the sender reuses a
slot only once the header says the receiver has queued its read (`done` writes the header after
recording). Nothing waits on the host. On a CPU the slots live in the shared file itself and
every step is synchronous.

A lane opens only where the receiver can map the sender's memory: the same host (the shared
file, named by 128 random bits, must be there) and the same device (CUDA: the same GPU, by UUID;
a lane between two GPUs is not built), never the sender's own process on CUDA (IPC refuses it).
Anything else keeps the socket path. `FLOTILLA_LANES=0` turns lanes off.
"""
from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import struct
import tempfile
import threading

import torch

from flotilla import envs

from .messages import DeviceLane
from .wire import TENSOR_DTYPES

log = logging.getLogger("flotilla.pipeline.lane")

SLOTS = 4
HEADER = 4096  # the shared file's header; on a CPU the slots follow it
_ACCEPTED, _CONSUMED = 0, 8  # header offsets: int64 each
MAX_LANE_BYTES = 1 << 30
_NAME = re.compile(r"flotilla-lane-[0-9a-f]{32}")
_DTYPE_NAMES = {v: k for k, v in TENSOR_DTYPES.items()}


_process = (0, 0)  # (pid, this process's random id)


def process_id() -> int:
    """A random 63-bit id of this process, new after a fork: unlike a pid, the same in no two
    processes of one host, whatever PID namespaces they run in."""
    global _process
    if _process[0] != os.getpid():
        _process = (os.getpid(), secrets.randbits(63))
    return _process[1]


def lane_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _sizes(slots: int, rows: int, width: int, dtype: torch.dtype, device_type: str) -> tuple[int, int]:
    """(bytes of the slots, bytes of the shared file: the header, and on a CPU the slots after it)."""
    nbytes = slots * rows * width * dtype.itemsize
    return nbytes, HEADER + (0 if device_type == "cuda" else nbytes)


def _uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""


class _Header:
    """The shared file's header: two int64 words read and written in place."""

    def __init__(self, fd: int, size: int):
        self.map = mmap.mmap(fd, size)

    def get(self, offset: int) -> int:
        return struct.unpack_from("<q", self.map, offset)[0]

    def set(self, offset: int, value: int) -> None:
        struct.pack_into("<q", self.map, offset, value)

    def close(self) -> None:
        self.map.close()


class LaneOut:
    """The sender's side: slots [SLOTS, rows, width] of `dtype` on `device`."""

    def __init__(self, kind: str, device: torch.device, dtype: torch.dtype, rows: int, width: int,
                 slots: int = SLOTS):
        self.kind, self.device, self.dtype = kind, device, dtype
        self.rows, self.width, self.slots = rows, width, slots
        self.name = f"flotilla-lane-{secrets.token_hex(16)}"
        self.path = os.path.join(lane_dir(), self.name)
        nbytes, size = _sizes(slots, rows, width, dtype, device.type)
        if nbytes > MAX_LANE_BYTES:
            raise ValueError(f"a {kind} lane of {nbytes} bytes is over {MAX_LANE_BYTES}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)  # a full tmpfs fails here, not with SIGBUS at a write
            else:
                os.ftruncate(fd, size)
            self.header = _Header(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        if device.type == "cuda":
            self.buf = torch.zeros(slots, rows, width, dtype=dtype, device=device)
            self.written = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
            self.read = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
        else:
            self.buf = torch.from_file(self.path, shared=True, size=size, dtype=torch.uint8)[HEADER:] \
                .view(dtype).view(slots, rows, width)
            self.written = self.read = []
        self.seq = 0  # the last sequence number put
        self.accepted = False
        self.sent = 0  # puts that went through the lane
        self.refused = 0  # puts that fell back to the socket

    def offer(self, epoch: int) -> DeviceLane:
        """The message that lets the receiver map this lane."""
        share = ("", b"", 0, 0, b"", 0, b"", False)
        if self.device.type == "cuda":
            _, handle, size, offset, ref_handle, ref_offset, ev, ev_sync = self.buf.untyped_storage()._share_cuda_()
            share = (_uuid(self.device), handle, size, offset, ref_handle or b"", ref_offset, ev or b"",
                     bool(ev_sync))
        return DeviceLane(epoch, self.kind, self.name, self.device.type, _DTYPE_NAMES[self.dtype], self.slots,
                          self.rows, self.width, process_id(), *share,
                          [e.ipc_handle() for e in self.written], [e.ipc_handle() for e in self.read])

    def put(self, t: torch.Tensor) -> int:
        """Copy `t` [n, width] (n <= rows) into the next slot, queued on the current stream (no host
        wait): its sequence number, or 0 when the lane cannot take it now."""
        if not self.accepted:
            self.accepted = self.header.get(_ACCEPTED) == 1
        s = self.seq + 1
        if (not self.accepted or t.dim() != 2 or t.shape[0] > self.rows or t.shape[1] != self.width
                or self.header.get(_CONSUMED) < s - self.slots):
            self.refused += self.accepted
            return 0
        i = s % self.slots
        if self.written:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(self.read[i])  # its reader's last read of this slot
            self.buf[i, :t.shape[0]].copy_(t, non_blocking=True)
            self.written[i].record(stream)
        else:
            self.buf[i, :t.shape[0]].copy_(t)
        self.seq = s
        self.sent += 1
        return s

    def close(self) -> None:
        """The link is gone: the shared file goes (if the receiver has not taken it away); the
        mappings go with the last reference (a step running now may still put into it)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class LaneIn:
    """The receiver's side of a lane that `open` mapped."""

    def __init__(self, msg: DeviceLane, device: torch.device):
        self.kind, self.epoch, self.device = msg.kind, msg.epoch, device
        self.slots, self.rows, self.width = msg.slots, msg.rows, msg.width
        dtype = TENSOR_DTYPES[msg.dtype]
        path = os.path.join(lane_dir(), msg.name)
        nbytes, size = _sizes(msg.slots, msg.rows, msg.width, dtype, msg.device)
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        try:
            if os.fstat(fd).st_size != size:
                raise ValueError(f"the lane's file holds {os.fstat(fd).st_size} bytes, not {size}")
            self.header = _Header(fd, size)
        finally:
            os.close(fd)
        try:
            if msg.device == "cuda":
                index = device.index if device.index is not None else torch.cuda.current_device()
                storage = torch.UntypedStorage._new_shared_cuda(  # this process's index of the same GPU (UUID)
                    index, msg.handle, msg.size_bytes, msg.offset_bytes, msg.ref_handle, msg.ref_offset,
                    msg.alloc_event, msg.alloc_event_sync)
                if storage.nbytes() < nbytes:
                    raise ValueError(f"the lane's memory holds {storage.nbytes()} bytes, not {nbytes}")
                self.buf = torch.empty(0, dtype=dtype, device=device).set_(
                    storage, 0, (msg.slots, msg.rows, msg.width))
                self.written = [torch.cuda.Event.from_ipc_handle(device, h) for h in msg.written_events]
                self.read = [torch.cuda.Event.from_ipc_handle(device, h) for h in msg.read_events]
            else:
                self.buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)[HEADER:] \
                    .view(dtype).view(msg.slots, msg.rows, msg.width)
                self.written = self.read = []
        except BaseException:
            self.header.close()
            raise
        self.consumed = self.header.get(_CONSUMED)  # every slot up to it is read (or never will be)
        self._done: set[int] = set()  # slots past `consumed` done out of order
        self._lock = threading.Lock()  # done() comes from the loop's thread and the compute thread
        os.unlink(path)  # both sides hold it mapped: nothing is left behind if either dies
        self.header.set(_ACCEPTED, 1)  # last: the sender uses the lane only once this side holds it

    @classmethod
    def open(cls, msg: DeviceLane, device: torch.device) -> "LaneIn | None":
        """Map a lane offered to this process, or None (logged) where it cannot be."""
        why = _refusal(msg, device)
        if why:
            log.info("%s lane of epoch %d not used: %s", msg.kind, msg.epoch, why)
            return None
        try:
            return cls(msg, device)
        except (OSError, RuntimeError, ValueError) as e:
            log.info("%s lane of epoch %d not used: %s: %s", msg.kind, msg.epoch, type(e).__name__, e)
            return None

    def take(self, seq: int, n: int) -> torch.Tensor:
        """Slot `seq`'s first n rows [n, width]: on a GPU the current stream waits for the
        sender's copy first. `done(seq)` once the reads are queued."""
        if seq <= self.consumed or seq in self._done or n > self.rows:
            raise ValueError(f"{self.kind} lane: slot {seq} ({n} rows) after slot {self.consumed} was read")
        i = seq % self.slots
        if self.written:
            torch.cuda.current_stream(self.device).wait_event(self.written[i])
        return self.buf[i, :n]

    def done(self, seq: int) -> None:
        """Slot `seq`'s reads are queued (or it will never be read). The sender may fill a slot
        again once every slot before it is done too (the header's count is contiguous)."""
        with self._lock:
            if seq <= self.consumed or seq in self._done:
                return
            if self.read:
                self.read[seq % self.slots].record(torch.cuda.current_stream(self.device))
            self._done.add(seq)
            while self.consumed + 1 in self._done:
                self._done.remove(self.consumed + 1)
                self.consumed += 1
            self.header.set(_CONSUMED, self.consumed)


def _refusal(msg: DeviceLane, device: torch.device) -> str:
    if not envs.lanes():
        return "FLOTILLA_LANES=0"
    if not _NAME.fullmatch(msg.name):
        return f"bad lane name {msg.name!r}"
    if msg.dtype not in TENSOR_DTYPES or not (0 < msg.slots <= 64 and 0 < msg.rows and 0 < msg.width):
        return f"bad lane shape {msg.slots}x{msg.rows}x{msg.width} {msg.dtype}"
    nbytes, _ = _sizes(msg.slots, msg.rows, msg.width, TENSOR_DTYPES[msg.dtype], msg.device)
    if nbytes > MAX_LANE_BYTES:
        return f"a lane of {nbytes} bytes"
    if msg.device != device.type:
        return f"the sender's slots are on {msg.device}, this stage on {device.type}"
    if not os.path.exists(os.path.join(lane_dir(), msg.name)):
        return "another host"
    if device.type == "cuda":
        if msg.process == process_id():
            return "the sender is this process (CUDA IPC maps another process's memory)"
        if msg.uuid != _uuid(device):
            return "another GPU (lanes between GPUs are not built)"
        if len(msg.written_events) != msg.slots or len(msg.read_events) != msg.slots:
            return "events missing"
    return ""
