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

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32


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


class GGUFFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, OverflowError) as e:
            os.close(self._fd)
            raise GGUFFormatError(f"truncated or malformed header ({e})") from None
        except GGUFFormatError:
            os.close(self._fd)
            raise

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        self.close()

    # ------------------------------------------------------------------------------ header
    def _parse(self) -> None:
        with open(self.path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise GGUFFormatError("no GGUF magic")
            version, n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
            if version not in (2, 3):
                raise GGUFFormatError(f"GGUF version {version} is not supported (2, 3)")
            self._fields: dict[str, object] = {}
            for _ in range(n_kv):
                key = self._string(f)
                self._fields[key] = self._value(f, struct.unpack("<I", f.read(4))[0])
            infos = []
            for _ in range(n_tensors):
                name = self._string(f)
                n_dims = struct.unpack("<I", f.read(4))[0]
                dims = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
                ttype, offset = struct.unpack("<IQ", f.read(12))
                infos.append((name, tuple(reversed(dims)), ttype, offset))
            align = int(self._fields.get("general.alignment", DEFAULT_ALIGNMENT))
            start = -(-f.tell() // align) * align
        size = self.path.stat().st_size
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ttype, offset in infos:
            info = TensorInfo(name, shape, ttype, start + offset, _nbytes(shape, ttype))
            if info.offset + info.nbytes > size:
                raise GGUFFormatError(f"tensor {name!r} ends at byte {info.offset + info.nbytes}, past the end of "
                                      f"the {size}-byte file (truncated?)")
            self.tensors[name] = info

    @staticmethod
    def _string(f) -> str:
        n = struct.unpack("<Q", f.read(8))[0]
        return f.read(n).decode("utf-8")

    def _value(self, f, vtype: int):
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
        if vtype == _STRING:
            return self._string(f)
        if vtype == _ARRAY:
            item, count = struct.unpack("<IQ", f.read(12))
            arr = _Array(item, count, f.tell())
            if item in _SCALARS:
                f.seek(count * struct.calcsize(_SCALARS[item]), os.SEEK_CUR)
            else:
                for _ in range(count):
                    self._value(f, item)
            return arr
        raise GGUFFormatError(f"unknown metadata value type {vtype}")

    # ------------------------------------------------------------------------------ access
    def field(self, key: str, default=None):
        """A metadata value (arrays are read now, as lists)."""
        value = self._fields.get(key, default)
        if isinstance(value, _Array):
            with open(self.path, "rb") as f:
                f.seek(value.offset)
                return [self._value(f, value.item_type) for _ in range(value.count)]
        return value

    def array_length(self, key: str) -> int | None:
        value = self._fields.get(key)
        return value.count if isinstance(value, _Array) else None

    def read(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes, uint8 [rows, bytes a row] (one positional read; nothing stays mapped)."""
        data = os.pread(self._fd, info.nbytes, info.offset)
        if len(data) != info.nbytes:
            raise GGUFFormatError(f"tensor {info.name!r}: read {len(data)} of {info.nbytes} bytes")
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return np.frombuffer(data, dtype=np.uint8).reshape(rows, -1)


def _nbytes(shape: tuple[int, ...], ttype: int) -> int:
    import gguf

    try:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
    except (ValueError, KeyError):
        raise GGUFFormatError(f"unknown tensor type {ttype}") from None
    n = int(np.prod(shape)) if shape else 1
    if n % block:
        raise GGUFFormatError(f"{n} values are not whole blocks of {block} of type {ttype}")
    return n // block * size
