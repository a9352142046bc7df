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
    only host sync on a middle stage). `to_device`: a received tensor (decoded from a frame,
    pageable) is copied into pinned memory and sent on without waiting; the caching host
    allocator keeps that pinned block until its copy is done. On a CPU device both return
    their inputs.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"

    def to_host(self, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if not self.pinned:
            return tensors
        out = []
        for t in tensors:
            if t is not None:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                t = host
            out.append(t)
        torch.cuda.current_stream(self.device).synchronize()  # the bytes that must cross
        return tuple(out)

    def to_device(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or not self.pinned:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t)
        return host.to(self.device, non_blocking=True)
