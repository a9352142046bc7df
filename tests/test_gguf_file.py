"""The GGUF header reader on hand-made malformed files: every corrupt length or count is a
GGUFFormatError naming the field and the byte (never a MemoryError or an overflowed size), the
runtime turns it into one FlotillaError line, and the file descriptor is closed exactly once."""
from __future__ import annotations

import gc
import os
import struct

import pytest

from flotilla.errors import FlotillaError
from flotilla.models import gguf_file
from flotilla.models.gguf_file import GGUFFile, GGUFFormatError
from flotilla.models.gguf_source import GGUFSource

U32, STRING, ARRAY = 4, 8, 9
F32 = 0
HUGE = 1 << 62


def header(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def string(text: str, length: int | None = None) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data) if length is None else length) + data


def kv_u32(key: str, value: int) -> bytes:
    return string(key) + struct.pack("<II", U32, value)


def tensor(name: str, dims: tuple[int, ...], ttype: int = F32, offset: int = 0) -> bytes:
    return string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ttype, offset)


def write(tmp_path, data: bytes):
    path = tmp_path / "bad.gguf"
    path.write_bytes(data + bytes(64))  # a little padding, as if tensor data followed
    return path


@pytest.mark.parametrize("data,match", [
    (header(0, 1) + string("general.name", HUGE), r"metadata key 0 at byte 32 needs 4611686018427387904 bytes"),
    (header(0, 1) + string("general.name") + struct.pack("<I", STRING) + string("x", HUGE),
     r"'general.name' at byte \d+ needs 4611686018427387904 bytes"),
    (header(0, 1) + string("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, HUGE),
     r"the 4611686018427387904 items of 'tokenizer.ggml.tokens' at byte \d+ needs"),
    (header(0, 1) + string("tokenizer.ggml.scores") + struct.pack("<IIQ", ARRAY, U32, HUGE),
     r"the 4611686018427387904 values of 'tokenizer.ggml.scores'"),
    (header(0, HUGE), r"4611686018427387904 metadata entries at byte 24"),
    (header(HUGE, 0), r"4611686018427387904 tensor entries at byte 24"),
    (header(1, 0) + string("t") + struct.pack("<I", 1 << 31), r"tensor 't' has 2147483648 dimensions"),
    # 2^40 x 2^40 x 4 bytes overflows int64 (np.prod gave 0 and the tensor looked empty)
    (header(1, 0) + tensor("t", (1 << 40, 1 << 40)), r"tensor 't' ends at byte 4835703278458516698824\d*, past the end"),
    (header(1, 0) + tensor("t", (33,), ttype=2), r"tensor 't': 33 values are not whole blocks of 32"),
    (header(0, 1) + kv_u32("general.alignment", 0), r"general.alignment is 0"),
    (header(0, 1) + string("k") + struct.pack("<I", 99), r"'k': unknown metadata value type 99"),
    (header(0, 1) + string("k") + struct.pack("<IQ", STRING, 2) + b"\xff\xfe", r"'k' at byte \d+ is not UTF-8"),
])
def test_malformed_header_is_a_format_error_naming_the_field(tmp_path, data, match):
    with pytest.raises(GGUFFormatError, match=match):
        GGUFFile(write(tmp_path, data))


def test_the_runtime_says_it_in_one_line(tmp_path):
    path = write(tmp_path, header(0, 1) + string("general.name", HUGE))
    with pytest.raises(FlotillaError, match=r"bad.gguf: not a readable GGUF file \(metadata key 0 at byte 32"):
        GGUFSource(path)


def test_a_failed_open_closes_its_descriptor_exactly_once(tmp_path, monkeypatch):
    path = write(tmp_path, header(0, 1) + string("general.name", HUGE))
    opened, closed = [], []
    real_open, real_close = os.open, os.close
    monkeypatch.setattr(gguf_file.os, "open", lambda *a, **k: opened.append(real_open(*a, **k)) or opened[-1])
    monkeypatch.setattr(gguf_file.os, "close", lambda fd: closed.append(fd) or real_close(fd))
    with pytest.raises(GGUFFormatError):
        GGUFFile(path)
    gc.collect()  # the half-built object's __del__ must not close the number again
    assert len(opened) == 1 and closed == opened


def test_a_good_header_still_reads(tmp_path):
    data = header(1, 2) + kv_u32("general.alignment", 32) + string("general.name") + struct.pack("<I", STRING) \
        + string("tiny") + tensor("t", (2, 32))
    pad = -len(data) % 32
    path = tmp_path / "ok.gguf"
    path.write_bytes(data + bytes(pad) + struct.pack("<64f", *range(64)))
    f = GGUFFile(path)
    info = f.tensors["t"]
    assert (f.field("general.name"), info.shape, info.nbytes, info.offset) == ("tiny", (32, 2), 256, len(data) + pad)
    assert f.read(info).shape == (32, 8)
    f.close()
    f.close()  # a second close is a no-op
