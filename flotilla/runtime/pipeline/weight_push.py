"""Weights for a worker that lacks the model: the head sends exactly the shards of its stage.

The model's identity is its fingerprint: for a flotilla checkpoint, the sha256 of its shard list
(names and hashes from flotilla.json); for anything else, the sha256 of its weight files and
config. A worker whose `--model` has the same fingerprint loads from there. Otherwise it keeps a
cache directory per fingerprint,

    CACHE/<fingerprint>/config.json, model.safetensors.index.json, flotilla.json, <shards…>

asks the head for the shards holding its stage's tensors that it lacks (`NeedFiles`), and
receives each in chunks, hashing as it writes; a shard whose sha256 is not the one flotilla.json
lists is deleted and the load fails, naming it. Completed shards are renamed into place, so a
restarted worker finds them and nothing is sent again. Only flotilla checkpoints are pushed
(their manifest is what the hashes are checked against).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch

from flotilla.errors import FlotillaError
from flotilla.models.checkpoint import CONFIG_FILE, INDEX_FILE, MANIFEST_FILE, Manifest, is_checkpoint, sha256_file
from flotilla.models.config import ModelConfig
from flotilla.models.llama import CausalLM, Stage
from flotilla.models.weights import load_plan

from .messages import FileChunk, FileEnd, LoadStage

CHUNK_BYTES = 4 << 20
METADATA_FILES = (CONFIG_FILE, INDEX_FILE, MANIFEST_FILE)
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")
# in a worker's failure when its --model is not the head's model (the head adds its own model's path after it)
MODEL_MISMATCH = "is another model than the head's"


def fingerprint(path: Path) -> str:
    """The identity of a model path (a checkpoint: from its manifest, cheap; else: its files' sha256)."""
    h = hashlib.sha256()
    if is_checkpoint(path):
        for s in sorted(Manifest.read(path).shards, key=lambda s: s.file):
            h.update(f"{s.file}\0{s.size}\0{s.sha256}\n".encode())
        h.update((path / CONFIG_FILE).read_bytes())
        return h.hexdigest()
    files = [path] if path.is_file() else sorted([*path.glob("*.safetensors"), path / CONFIG_FILE])
    for f in files:
        h.update(f"{f.name}\0{sha256_file(f)}\n".encode())
    return h.hexdigest()


def stage_tensor_names(config: ModelConfig, stage: Stage) -> list[str]:
    with torch.device("meta"):
        model = CausalLM(config, stage)
    return [item.source_name for item in load_plan(model)]


def stage_shards(config: ModelConfig, stage: Stage, weight_map: dict[str, str]) -> list[str]:
    """The shard files holding the tensors of `stage` (in the checkpoint's order)."""
    needed = {weight_map[n] for n in stage_tensor_names(config, stage) if n in weight_map}
    return sorted(needed)


# ------------------------------------------------------------------------------------ the head

def load_request(path: Path, fp: str, stage: Stage, **kv) -> LoadStage:
    """What the head tells a worker to load; with a checkpoint, enough to receive it by push."""
    files, shards = {}, {}
    if is_checkpoint(path):
        files = {name: (path / name).read_text() for name in METADATA_FILES if (path / name).is_file()}
        shards = {s.file: s.sha256 for s in Manifest.read(path).shards}
    return LoadStage(fp, files, shards, stage.start, stage.end, stage.num_layers, **kv)


async def push_files(conn, directory: Path, names: list[str], allowed: dict[str, str]) -> int:
    """Send shard files in chunks (the connection's drain applies back-pressure); returns bytes sent."""
    sent = 0
    for name in names:
        if name not in allowed:
            raise FlotillaError(f"a worker asked for {name!r}, which is not a shard of {directory}")
        with open(directory / name, "rb") as f:
            offset = 0
            while chunk := f.read(CHUNK_BYTES):
                await conn.send(FileChunk(name, offset, chunk))
                offset += len(chunk)
        await conn.send(FileEnd(name, offset))
        sent += offset
    return sent


# ---------------------------------------------------------------------------------- the worker

class WeightCache:
    """A worker's directory of pushed checkpoints."""

    def __init__(self, root: Path):
        self.root = Path(root).expanduser()

    def directory(self, fp: str) -> Path:
        if not _FINGERPRINT.fullmatch(fp):
            raise FlotillaError(f"the head sent a malformed model fingerprint {fp[:80]!r}")
        return self.root / fp

    def prepare(self, req: LoadStage, own_model: Path | None = None) -> tuple[Path, list[str]]:
        """The cache directory for the model (metadata written) and the stage's shards it lacks. `own_model`:
        the worker's --model, which is not the head's model."""
        if not req.shards:  # nothing the head could push
            if own_model is None:
                mine, fix = "this worker has no copy of the model and", "pass --model to the worker"
            else:
                mine, fix = (f"this worker's --model {own_model} {MODEL_MISMATCH}, and",
                             "give the worker the head's model as --model (the same file)")
            raise FlotillaError(f"{mine} the head's model is not a flotilla checkpoint, so its weights cannot be "
                                f"pushed; {fix}, or serve a checkpoint written by `quantize`")
        d = self.directory(req.fingerprint)
        d.mkdir(parents=True, exist_ok=True)
        for name, text in req.files.items():
            if name not in METADATA_FILES:
                raise FlotillaError(f"the head sent an unexpected file {name[:80]!r}")
            target = d / name
            if not target.is_file() or target.read_text() != text:
                _atomic_write(target, text.encode())
        config = ModelConfig.from_hf_dir(d)
        try:
            weight_map = json.loads((d / INDEX_FILE).read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise FlotillaError(f"{d / INDEX_FILE}: unreadable index from the head ({e})") from None
        stage = Stage(req.start, req.end, req.num_layers)
        manifest = Manifest.read(d)
        missing = []
        for name in stage_shards(config, stage, weight_map):
            if name not in req.shards:
                raise FlotillaError(f"shard {name!r} is not in the head's manifest")
            path = d / name
            if not path.is_file() or path.stat().st_size != manifest.shard(name).size:
                missing.append(name)
        return d, missing

    def discard(self, directory: Path, names: list[str]) -> None:
        for name in names:
            (directory / name).unlink(missing_ok=True)


class ShardReceiver:
    """Writes pushed shards into a cache directory, checking order, size and sha256."""

    def __init__(self, directory: Path, expected: dict[str, str], names: list[str]):
        self.directory = directory
        self.expected = expected  # name -> sha256
        self.pending = list(names)
        self.received_bytes = 0
        self._file = None
        self._name: str | None = None
        self._hash = None
        self._offset = 0

    @property
    def done(self) -> bool:
        return not self.pending and self._file is None

    def chunk(self, msg: FileChunk) -> None:
        if self._file is None:
            if not self.pending or msg.file != self.pending[0] or not _SAFE_NAME.fullmatch(msg.file):
                raise FlotillaError(f"unexpected shard {msg.file[:80]!r} from the head")
            self._name, self._hash, self._offset = msg.file, hashlib.sha256(), 0
            self._file = open(self._part(msg.file), "wb")
        if msg.file != self._name or msg.offset != self._offset:
            self.abort()
            raise FlotillaError(f"shard {msg.file[:80]!r}: chunk at offset {msg.offset}, expected {self._offset}")
        self._file.write(msg.data)
        self._hash.update(msg.data)
        self._offset += len(msg.data)
        self.received_bytes += len(msg.data)

    def end(self, msg: FileEnd) -> None:
        if self._file is None and self.pending and msg.file == self.pending[0] and msg.size == 0:
            self.chunk(FileChunk(msg.file, 0, b""))  # an empty file
        if self._file is None or msg.file != self._name or msg.size != self._offset:
            self.abort()
            raise FlotillaError(f"shard {msg.file[:80]!r} ended at {msg.size} bytes, received {self._offset}")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        digest, want = self._hash.hexdigest(), self.expected[msg.file]
        part = self._part(msg.file)
        if digest != want:
            part.unlink(missing_ok=True)
            raise FlotillaError(f"shard {msg.file} arrived with sha256 {digest[:12]}…, flotilla.json says "
                                f"{want[:12]}…; it was discarded")
        os.replace(part, self.directory / msg.file)
        self.pending.pop(0)

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._part(self._name).unlink(missing_ok=True)
            self._file = None

    def _part(self, name: str) -> Path:
        return self.directory / f".{name}.part"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
