"""The wire format between the head and pipeline workers: length-prefixed msgpack frames.

    frame   = u32 big-endian length | body            (length <= max_frame, else the peer is dropped)
    body    = msgpack [type name, [field values…]]    (no ext types, bounded lengths)
    tensor  = [dtype name, [dims…], raw bytes]        (a whitelist of dtypes; size checked)

Messages are frozen dataclasses registered with `@message("name")`; one generic codec encodes
them and, on decode, checks every field against its annotation, so a malformed or hostile frame
becomes a ProtocolError and never an arbitrary object. Nothing is ever unpickled. A registered
message may be the type of another's field (or a list of them): it travels as its field values.
"""
from __future__ import annotations

import asyncio
import dataclasses
import struct
import types
import typing
from typing import Any, Callable

import msgpack
import torch

PROTOCOL_VERSION = 12  # 2: speculative steps (drafts, draft distributions, table trims, accepted drafts);
#                      3: decode graphs per stage (Configure), shared memory and TP in WorkerInfo;
#                      4: LoadStage sizes the KV pool as a single-process run does (context, sequences);
#                      5: StepResults on a result connection of their own (ResultsLink);
#                      6: overlapped decodes (Step.prev_mb/prev_rows/feed, Sampled, Configure.feedback)
#                      7: device lanes between stages on one host (DeviceLane, Step/Sampled.lane_seq)
#                      8: DeviceLane.process (a random id, not the pid), Sampled.lane_rows
#                      9: WorkerInfo.mps (stages sharing a GPU without MPS are named)
#                     10: SeqSampling's logit bias, min_tokens and end tokens
#                     11: prompt logprobs (Step/StepResult.prompt_logprobs)
#                     12: Step.nulls (blocks behind a sliding window given back, not a resent table)
DEFAULT_MAX_FRAME = 64 << 20  # 64 MiB: a prefill chunk of 2048 tokens x 8192 hidden in fp16 is 32 MiB
MAX_TENSOR_DIMS = 8
FRAME_HEADER = struct.Struct(">I")

TENSOR_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64,
}
_DTYPE_NAMES = {v: k for k, v in TENSOR_DTYPES.items()}


class ProtocolError(Exception):
    """A frame or message that breaks the protocol; the connection that sent it is closed."""


# ------------------------------------------------------------------------------------ messages

_MESSAGES: dict[str, type] = {}
_VALIDATORS: dict[type, list[tuple[str, Callable[[Any, str], Any]]]] = {}
_ENCODERS: dict[type, list[tuple[str, Callable[[Any], Any] | None]]] = {}  # None: msgpack takes the value as is
_PATHS: dict[type, list[str]] = {}  # "message.field" per field, for errors


def message(name: str):
    """Register a frozen dataclass as a wire message under `name`."""

    def wrap(cls):
        if name in _MESSAGES:
            raise ValueError(f"message name {name!r} registered twice")
        cls = dataclasses.dataclass(frozen=True)(cls) if not dataclasses.is_dataclass(cls) else cls
        cls.WIRE_NAME = name
        hints = typing.get_type_hints(cls)
        _VALIDATORS[cls] = [(f.name, _validator(hints[f.name])) for f in dataclasses.fields(cls)]
        _ENCODERS[cls] = [(f.name, _encoder(hints[f.name])) for f in dataclasses.fields(cls)]
        _PATHS[cls] = [f"{name}.{f.name}" for f in dataclasses.fields(cls)]
        _MESSAGES[name] = cls
        return cls

    return wrap


def message_names() -> list[str]:
    return sorted(_MESSAGES)


def _validator(tp) -> Callable[[Any, str], Any]:
    """Build a function that checks (and converts) one decoded value against annotation `tp`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [_validator(a) for a in typing.get_args(tp)]
        allows_none = type(None) in typing.get_args(tp)

        def check_union(v, where):
            if v is None and allows_none:
                return None
            errors = []
            for opt in options:
                try:
                    return opt(v, where)
                except ProtocolError as e:
                    errors.append(str(e))
            raise ProtocolError(errors[0] if errors else f"{where}: bad value")

        return check_union
    if tp is type(None):
        def check_none(v, where):
            if v is not None:
                raise ProtocolError(f"{where}: expected nothing")
            return None
        return check_none
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if item_tp in (int, bool):  # the hot lists of a step (handles, positions, flags): checked in C
            return lambda v, where: _plain_list(v, item_tp, where)
        item = _validator(item_tp)
        return lambda v, where: [item(x, where) for x in _expect(v, list, where)]
    if origin is tuple:
        item = _validator(typing.get_args(tp)[0])
        return lambda v, where: tuple(item(x, where) for x in _expect(v, list, where))
    if origin is dict:
        k_tp, v_tp = typing.get_args(tp)
        kv, vv = _validator(k_tp), _validator(v_tp)
        return lambda v, where: {kv(k, where): vv(x, where) for k, x in _expect(v, dict, where).items()}
    if tp in _VALIDATORS:  # a nested message: its field values
        return lambda v, where: _build(tp, _expect(v, list, where), where)
    if tp is torch.Tensor:
        return decode_tensor
    if tp is float:
        return lambda v, where: float(_expect(v, (int, float), where))
    if tp is int:
        def check_int(v, where):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ProtocolError(f"{where}: expected int, got {type(v).__name__}")
            return v
        return check_int
    if tp in (str, bytes, bool):
        return lambda v, where: _expect(v, tp, where)
    if tp is Any:
        return lambda v, where: v
    raise TypeError(f"unsupported wire field type {tp!r}")


def _plain_list(v, item_tp: type, where: str) -> list:
    """A list whose items are all exactly `item_tp` (a bool is not an int here)."""
    if type(v) is not list or not {item_tp}.issuperset(map(type, v)):
        _expect(v, list, where)
        bad = next(x for x in v if type(x) is not item_tp)
        raise ProtocolError(f"{where}: expected {item_tp.__name__}, got {type(bad).__name__}")
    return v


def _encoder(tp) -> Callable[[Any], Any] | None:
    """How a field of annotation `tp` goes to msgpack: None when as it is (numbers, strings, bytes
    and lists of them), else a function (tensors and nested messages, or containers of them)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if tp is torch.Tensor or tp in _VALIDATORS:
        return _to_wire
    if typing.get_origin(tp) is dict and any(_encoder(a) is not None for a in args):
        return _to_wire
    if typing.get_origin(tp) is tuple:
        return list
    if any(_encoder(a) is not None for a in args):
        return lambda v: None if v is None else _to_wire(v)
    return None


def _expect(v, tp, where):
    if not isinstance(v, tp):
        name = tp.__name__ if isinstance(tp, type) else "/".join(t.__name__ for t in tp)
        raise ProtocolError(f"{where}: expected {name}, got {type(v).__name__}")
    return v


# ------------------------------------------------------------------------------------- tensors

def encode_tensor(t: torch.Tensor) -> list:
    if t.dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype {t.dtype} cannot go on the wire")
    if t.device.type != "cpu" or t.requires_grad or not t.is_contiguous():
        t = t.detach().contiguous().cpu()
    raw = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""  # msgpack copies it once
    return [_DTYPE_NAMES[t.dtype], list(t.shape), raw]


def decode_tensor(v, where: str = "tensor") -> torch.Tensor:
    if not isinstance(v, list) or len(v) != 3:
        raise ProtocolError(f"{where}: expected [dtype, shape, data]")
    dtype_name, shape, data = v
    dtype = TENSOR_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise ProtocolError(f"{where}: dtype {dtype_name!r} is not allowed")
    if (not isinstance(shape, list) or len(shape) > MAX_TENSOR_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**31 for d in shape)):
        raise ProtocolError(f"{where}: bad shape {shape!r}")
    if not isinstance(data, bytes):
        raise ProtocolError(f"{where}: tensor data must be bytes")
    numel = 1
    for d in shape:
        numel *= d
    if numel * dtype.itemsize != len(data):
        raise ProtocolError(f"{where}: {len(data)} bytes for shape {shape} of {dtype_name}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)


# --------------------------------------------------------------------------------------- codec

def _to_wire(v):
    if isinstance(v, torch.Tensor):
        return encode_tensor(v)
    if type(v) in _VALIDATORS:
        return [_to_wire(getattr(v, name)) for name, _ in _VALIDATORS[type(v)]]
    if isinstance(v, (list, tuple)):
        return [_to_wire(x) for x in v]
    if isinstance(v, dict):
        return {k: _to_wire(x) for k, x in v.items()}
    return v


def encode(msg) -> bytes:
    cls = type(msg)
    if cls not in _VALIDATORS:
        raise TypeError(f"{cls.__name__} is not a registered wire message")
    values = [getattr(msg, name) if enc is None else enc(getattr(msg, name)) for name, enc in _ENCODERS[cls]]
    return msgpack.packb([cls.WIRE_NAME, values], use_bin_type=True)


def decode(body: bytes, max_frame: int = DEFAULT_MAX_FRAME):
    try:
        obj = msgpack.unpackb(
            body, raw=False, strict_map_key=True, use_list=True,
            max_str_len=1 << 20, max_bin_len=max_frame, max_array_len=1 << 22, max_map_len=1 << 16,
            max_ext_len=0, ext_hook=_reject_ext,
        )
    except ProtocolError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as e:  # ExtraData, FormatError, StackError, …
        raise ProtocolError(f"malformed msgpack: {type(e).__name__}: {e}") from None
    if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], str) and isinstance(obj[1], list)):
        raise ProtocolError("a frame must be [type, fields]")
    name, values = obj
    cls = _MESSAGES.get(name)
    if cls is None:
        raise ProtocolError(f"unknown message type {name[:40]!r}")
    return _build(cls, values, name)


def _build(cls, values: list, where: str):
    fields = _VALIDATORS[cls]
    if len(values) != len(fields):
        raise ProtocolError(f"{where}: {len(values)} fields, expected {len(fields)}")
    # each field's place for the error messages: made once per class (a step's frame has ~20 fields)
    paths = _PATHS[cls] if where == cls.WIRE_NAME else [f"{where}.{fname}" for fname, _ in fields]
    return cls(**{fname: check(v, path) for (fname, check), v, path in zip(fields, values, paths)})


def _reject_ext(code, data):
    raise ProtocolError("msgpack ext types are not allowed")


# ------------------------------------------------------------------------------------- framing

async def read_frame(reader: asyncio.StreamReader, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    header = await reader.readexactly(FRAME_HEADER.size)
    (n,) = FRAME_HEADER.unpack(header)
    if n > max_frame:
        if header[0] == 0x16 and header[1] == 0x03:  # a TLS record (a ClientHello) where a frame should start
            raise ProtocolError("a TLS handshake arrived on a plain connection: the other side uses TLS and this "
                                "one does not; give both the same --tls-cert/--tls-key/--tls-ca, or neither")
        raise ProtocolError(f"frame of {n} bytes exceeds the limit of {max_frame}")
    return await reader.readexactly(n)


def frame(body: bytes) -> bytes:
    return FRAME_HEADER.pack(len(body)) + body
