"""Hidden states on the wire between stages: fp16, bf16, or int8 with a per-token absmax scale.

    fp16 / bf16   [T, H] in that dtype: 2 bytes a value
    int8          q = round(h / s) with s = max|h_t| / 127 per token t: 1 byte a value and a
                  4-byte scale a token, half of fp16's bytes for slow links

The stage computes in its own dtype (fp32 on a CPU, fp16 on a GPU); `pack` turns its output into
the wire form and `unpack` turns a received one back into the receiver's dtype and device.

On a GPU stage the wire form crosses host memory through `HostStaging`: the stage's own pinned
buffers, copies that do not block the host, and one wait per step for the bytes that leave (by
then the step's compute is done anyway). On a CPU stage it does nothing.
"""
from __future__ import annotations

import math

import torch

from flotilla.errors import FlotillaError

WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}


def check_wire_dtype(name: str) -> str:
    if name not in WIRE_DTYPES:
        raise FlotillaError(f"--wire-dtype {name!r}: choose one of {', '.join(WIRE_DTYPES)}")
    return name


def pack(hidden: torch.Tensor, wire_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[T, H] in any float dtype -> (wire tensor [T, H], per-token scales [T] for int8, else None)."""
    if wire_dtype != "int8":
        return hidden.to(WIRE_DTYPES[wire_dtype]), None
    h = hidden.float()
    scales = h.abs().amax(dim=-1).clamp(min=1e-12) / 127.0  # [T]
    q = torch.round(h / scales[:, None]).clamp_(-127, 127).to(torch.int8)  # [T, H]
    return q, scales


def unpack(data: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The inverse of `pack`, in the receiver's dtype on its device."""
    if data.dtype == torch.int8:
        if scales is None or scales.shape != data.shape[:1]:
            raise ValueError("int8 hidden states need one scale per token")
        return (data.to(device=device, dtype=torch.float32) * scales.to(device)[:, None]).to(dtype)
    return data.to(device=device, dtype=dtype)


class HostStaging:
    """A stage's tensors between its device and the socket, through pinned host memory.

    `to_host`: device -> pinned host copies, all started before one wait for them (the step's
    only host sync on a middle stage), then copied into pageable tensors for the frame (a step
    run on the compute thread may be sent after the next one has reused the pinned buffers).
    `to_device`: a received tensor (decoded from a frame, pageable) is copied into pinned memory
    and sent on without waiting. The pinned buffers are the stage's own, one per tensor of a
    step, kept from step to step (allocating pinned memory each step costs more than the copy):
    before a buffer is written again, the copy that last read it is waited for (long done: every
    step ends with a wait on the device). On a CPU device both return their inputs.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"
        self._in = [_Pinned(), _Pinned()]  # hidden states, scales
        self._out = [_Pinned(), _Pinned()]
        self._sent = [torch.cuda.Event(), torch.cuda.Event()] if self.pinned else []

    def to_host(self, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if not self.pinned:
            return tensors
        staged = []
        self._out += [_Pinned() for _ in range(len(tensors) - len(self._out))]
        for buf, t in zip(self._out, tensors):
            if t is not None:
                host = buf.view(t.shape, t.dtype)
                host.copy_(t, non_blocking=True)
                t = host
            staged.append(t)
        torch.cuda.current_stream(self.device).synchronize()  # the bytes that must cross
        return tuple(None if t is None else torch.empty(t.shape, dtype=t.dtype).copy_(t) for t in staged)

    def to_device(self, t: torch.Tensor | None, slot: int = 0) -> torch.Tensor | None:
        """`slot`: which of the step's tensors (0: hidden states, 1: scales), each its own buffer."""
        if t is None or not self.pinned:
            return t
        sent = self._sent[slot]
        sent.synchronize()  # the last step's copy out of this buffer is done
        host = self._in[slot].view(t.shape, t.dtype)
        host.copy_(t)
        out = host.to(self.device, non_blocking=True)
        sent.record()
        return out


class _Pinned:
    """A pinned host buffer that grows to the largest tensor asked of it; `view` is a tensor of
    that shape and dtype over its first bytes."""

    def __init__(self):
        self._buf: torch.Tensor | None = None

    def view(self, shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._buf[:nbytes].view(dtype).view(shape)
