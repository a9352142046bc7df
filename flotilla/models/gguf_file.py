"""A small GGUF reader: the header's metadata and tensor directory, and one tensor's bytes on demand.

gguf.GGUFReader maps the file and builds a numpy view per metadata element (one per token and
merge of a 49k-token vocabulary: ~160 MB of Python objects for a 100 MB model). This one parses
scalars, keeps arrays as their position and length (read only when asked for), and reads a
tensor's bytes with one positional read, so a load holds no more than the tensor in hand.

    f = GGUFFile(path)
    f.field("llama.block_count")          # a scalar, a string, or a list (arrays, read now)
    f.array_length("tokenizer.ggml.tokens")
    f.tensors["blk.0.attn_q.weight"]      # TensorInfo(name, shape [out, in], type, offset, nbytes)
    f.read(info)                          # uint8 [rows, row bytes]
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # outermost first: [out, in] for a matrix (GGUF stores innermost first)
    type: int  # a gguf.GGMLQuantizationType value
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        import gguf

        return gguf.GGMLQuantizationType(self.type).name


@dataclass(frozen=True)
class _Array:
    item_type: int
    count: int
    offset: int  # of the first element


class _Header:
    """Reads the header, checking every length against the bytes left in the file before it reads
    (a corrupt length must be an error naming it, not a multi-GB allocation)."""

    def __init__(self, f, size: int):
        self.f, self.size = f, size

    def room(self, n: int, what: str) -> None:
        pos = self.f.tell()
        if n > self.size - pos:
            raise GGUFFormatError(f"{what} at byte {pos} needs {n} bytes; the {self.size}-byte file has "
                                  f"{self.size - pos} left (truncated or corrupt)")

    def take(self, n: int, what: str) -> bytes:
        self.room(n, what)
        return self.f.read(n)

    def unpack(self, fmt: str, what: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))

    def string(self, what: str) -> str:
        n = self.unpack("<Q", f"the length of {what}")[0]
        pos = self.f.tell()
        try:
            return self.take(n, what).decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFFormatError(f"{what} at byte {pos} is not UTF-8") from None

    def value(self, vtype: int, what: str):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype], what)[0]
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            item, count = self.unpack("<IQ", f"the item type and count of {what}")
            arr = _Array(item, count, self.f.tell())
            if item in _SCALARS:  # skipped now, read when asked for
                n = count * struct.calcsize(_SCALARS[item])
                self.room(n, f"the {count} values of {what}")
                self.f.seek(n, os.SEEK_CUR)
            else:  # strings (a length each, at least) or arrays (an item type and a count)
                self.room(count * (8 if item == _STRING else 12), f"the {count} items of {what}")
                for i in range(count):
                    self.value(item, f"{what}[{i}]")
            return arr
        raise GGUFFormatError(f"{what}: unknown metadata value type {vtype}")


class GGUFFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd = -1
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            self._parse()
        except struct.error as e:  # _Header checks lengths first; this is a last guard
            self.close()
            raise GGUFFormatError(f"truncated or malformed header ({e})") from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        self.close()

    # ------------------------------------------------------------------------------ header
    def _parse(self) -> None:
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            h = _Header(f, size)
            if f.read(4) != b"GGUF":
                raise GGUFFormatError("no GGUF magic")
            version, n_tensors, n_kv = h.unpack("<IQQ", "the version and counts")
            if version not in (2, 3):
                raise GGUFFormatError(f"GGUF version {version} is not supported (2, 3)")
            h.room(n_kv * 12, f"{n_kv} metadata entries")  # each at least a key length and a type
            self._fields: dict[str, object] = {}
            for i in range(n_kv):
                key = h.string(f"metadata key {i}")
                self._fields[key] = h.value(h.unpack("<I", f"the type of {key!r}")[0], repr(key))
            h.room(n_tensors * 24, f"{n_tensors} tensor entries")  # each at least a name length, type, offset
            infos = []
            for i in range(n_tensors):
                name = h.string(f"tensor name {i}")
                n_dims = h.unpack("<I", f"the dimension count of tensor {name!r}")[0]
                if n_dims > MAX_DIMS:
                    raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions; GGUF allows at most {MAX_DIMS}")
                dims = h.unpack(f"<{n_dims}Q", f"the dimensions of tensor {name!r}")
                ttype, offset = h.unpack("<IQ", f"the type and offset of tensor {name!r}")
                infos.append((name, tuple(reversed(dims)), ttype, offset))
            align = self._fields.get("general.alignment", DEFAULT_ALIGNMENT)
            if not isinstance(align, int) or isinstance(align, bool) or align <= 0:
                raise GGUFFormatError(f"general.alignment is {align!r}; expected a positive integer")
            start = -(-f.tell() // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ttype, offset in infos:
            info = TensorInfo(name, shape, ttype, start + offset, _nbytes(name, shape, ttype))
            if info.offset + info.nbytes > size:
                raise GGUFFormatError(f"tensor {name!r} ends at byte {info.offset + info.nbytes}, past the end of "
                                      f"the {size}-byte file (truncated?)")
            self.tensors[name] = info

    # ------------------------------------------------------------------------------ access
    def field(self, key: str, default=None):
        """A metadata value (arrays are read now, as lists)."""
        value = self._fields.get(key, default)
        if isinstance(value, _Array):  # checked when the header was parsed
            with open(self.path, "rb") as f:
                h = _Header(f, self.path.stat().st_size)
                f.seek(value.offset)
                return [h.value(value.item_type, f"{key!r}[{i}]") for i in range(value.count)]
        return value

    def array_length(self, key: str) -> int | None:
        value = self._fields.get(key)
        return value.count if isinstance(value, _Array) else None

    def read(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes, uint8 [rows, bytes a row] (one positional read; nothing stays mapped)."""
        data = os.pread(self._fd, info.nbytes, info.offset)
        if len(data) != info.nbytes:
            raise GGUFFormatError(f"tensor {info.name!r}: read {len(data)} of {info.nbytes} bytes")
        rows = math.prod(info.shape[:-1])
        return np.frombuffer(data, dtype=np.uint8).reshape(rows, -1)


def _nbytes(name: str, shape: tuple[int, ...], ttype: int) -> int:
    import gguf

    try:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
    except (ValueError, KeyError):
        raise GGUFFormatError(f"tensor {name!r}: unknown tensor type {ttype}") from None
    n = math.prod(shape)  # Python ints: no overflow, however corrupt the dimensions
    if n % block:
        raise GGUFFormatError(f"tensor {name!r}: {n} values are not whole blocks of {block} of type {ttype}")
    return n // block * size
