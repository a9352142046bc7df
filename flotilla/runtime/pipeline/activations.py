"""Hidden states on the wire between stages: fp16, bf16, or int8 with a per-token absmax scale.

    fp16 / bf16   [T, H] in that dtype: 2 bytes a value
    int8          q = round(h / s) with s = max|h_t| / 127 per token t: 1 byte a value and a
                  4-byte scale a token, half of fp16's bytes for slow links

The stage computes in its own dtype (fp32 on a CPU, fp16 on a GPU); `pack` turns its output into
the wire form and `unpack` turns a received one back into the receiver's dtype and device.

On a GPU stage the wire form crosses host memory through `HostStaging`: pinned buffers, copies
that do not block the host, and one wait per step for the bytes that leave (by then the step's
compute is done anyway). On a CPU stage it does nothing.
"""
from __future__ import annotations

import torch

from flotilla.errors import FlotillaError

WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}


def check_wire_dtype(name: str) -> str:
    if name not in WIRE_DTYPES:
        raise FlotillaError(f"--wire-dtype {name!r}: choose one of {', '.join(WIRE_DTYPES)}")
    return name


OWN_DTYPE = "own"  # pack's form for a same-host hop: the stage's own dtype, as a device lane carries it


def pack(hidden: torch.Tensor, wire_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[T, H] in any float dtype -> (wire tensor [T, H], per-token scales [T] for int8, else None);
    OWN_DTYPE keeps `hidden` as it is."""
    if wire_dtype == OWN_DTYPE:
        return hidden, None
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
    """A stage's tensors between its device and the socket, through pinned host memory kept for
    the stage's life (no pinned allocation a step).

    `to_host`: device -> the pinned buffer, one copy a tensor that does not block the host, then
    one wait for them (the step's only host sync on a middle stage); the caller gets pageable
    copies (a frame may be encoded after the next step reuses the buffer). `to_pinned`: a
    received tensor (decoded from a frame) copied into the pinned buffer: the device copies it in
    from there without blocking the host (a graph replay straight into its static input);
    `release` after that copy is queued, and the next `to_pinned` waits for it first (long done
    by then). On a CPU device all three do nothing.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"
        self._out = _PinnedBuffer()
        self._in = _PinnedBuffer()
        self._in_read = torch.cuda.Event() if self.pinned else None  # the device's copy out of `_in`
        self._in_pending = False

    def to_host(self, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if not self.pinned:
            return tensors
        views = self._out.copy(tensors, non_blocking=True)  # device -> pinned, none waited for yet
        torch.cuda.current_stream(self.device).synchronize()  # the bytes that must cross
        return tuple(None if v is None else v.clone() for v in views)

    def to_pinned(self, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """Host tensors' pinned twins (valid until the next call; `release` once their copies
        to the device are queued)."""
        if not self.pinned:
            return tensors
        if self._in_pending:
            self._in_read.synchronize()
            self._in_pending = False
        return self._in.copy(tensors, non_blocking=False)

    def release(self) -> None:
        """The device's copy out of `to_pinned`'s buffer is queued on the current stream."""
        if self.pinned:
            self._in_read.record(torch.cuda.current_stream(self.device))
            self._in_pending = True

    def to_device(self, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """Host tensors on the device, through the pinned buffer (`release` after)."""
        if not self.pinned:
            return tensors
        return tuple(None if t is None else t.to(self.device, non_blocking=True) for t in self.to_pinned(*tensors))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 256) * 256


class _PinnedBuffer:
    """One growing pinned byte buffer, viewed as tensors."""

    def __init__(self):
        self._buf = torch.empty(0, dtype=torch.uint8)

    def copy(self, tensors, non_blocking: bool) -> tuple[torch.Tensor | None, ...]:
        """Each tensor copied into the buffer (None stays None), at 256-byte aligned offsets."""
        views, offset = [], 0
        for t in tensors:
            if t is None:
                views.append(None)
                continue
            view = self.view(offset, t)
            view.copy_(t, non_blocking=non_blocking)
            views.append(view)
            offset += _aligned(t.numel() * t.element_size())
        return tuple(views)

    def view(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        """A tensor of `like`'s shape and dtype at byte `offset` (the buffer grows to hold it; the
        views handed out before keep the old buffer, and its pending copies, alive: nothing is
        copied over, the next call writes from offset 0)."""
        nbytes = like.numel() * like.element_size()
        if offset + nbytes > self._buf.numel():
            size = max(offset + nbytes, 2 * self._buf.numel(), 1 << 16)
            self._buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return self._buf[offset:offset + nbytes].view(like.dtype).view(like.shape)
