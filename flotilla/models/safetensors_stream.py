"""Join safetensors files into one without loading their tensors.

The checkpoint writer spills each layer to its own small file as soon as it is quantized and joins
a shard's layers when the shard is cut, so memory never holds more than one layer whatever the
shard size. The format (https://github.com/huggingface/safetensors): an 8-byte little-endian
header length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": …}
padded with spaces, then the tensors' bytes; offsets are relative to the end of the header.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

_ITEM_SIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
              "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_COPY_CHUNK = 16 << 20


def read_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the offset where its data begins."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return header, 8 + n


def concat_safetensors(parts: list[Path], dest: Path, metadata: dict[str, str] | None = None) -> list[str]:
    """Write the tensors of every file in `parts` into one safetensors file `dest`; return their
    names. Tensors are laid out by decreasing element size, so every tensor stays aligned."""
    entries = []  # (name, info, part, absolute begin, nbytes)
    for part in parts:
        header, data_start = read_header(part)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            entries.append((name, info, part, data_start + begin, end - begin))
    entries.sort(key=lambda e: (-_ITEM_SIZE[e[1]["dtype"]], e[0]))
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, info, _, _, nbytes in entries:
        if name in header:
            raise ValueError(f"tensor {name!r} appears in two parts")
        header[name] = {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    handles: dict[Path, object] = {}
    try:
        with open(dest, "wb") as out:
            out.write(struct.pack("<Q", len(blob)))
            out.write(blob)
            for _, _, part, begin, nbytes in entries:
                src = handles.get(part) or handles.setdefault(part, open(part, "rb"))
                src.seek(begin)
                while nbytes:
                    chunk = src.read(min(nbytes, _COPY_CHUNK))
                    if not chunk:
                        raise ValueError(f"{part}: shorter than its header says")
                    out.write(chunk)
                    nbytes -= len(chunk)
    finally:
        for h in handles.values():
            h.close()
    return [e[0] for e in entries]
