"""The flotilla checkpoint format: names, the manifest, writing and verifying.

A checkpoint is a Hugging Face-style directory:

    config.json                       model config + quantization_config (GPTQ)
    generation_config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja
    model-00001-of-0000N.safetensors  shards cut on layer boundaries
    model.safetensors.index.json      weight_map: tensor -> shard
    flotilla.json                     format version, sha256 and size per shard, layer -> shard

Both the writer (`quantize`) and the loader (`runtime`) go through this module. Quantized
linears use the GPTQ layout of `flotilla.kernels.gptq`.

Writes are atomic: everything is built in a hidden sibling directory, fsynced, then renamed to
OUT. A crash leaves no directory at OUT (only a hidden `.OUT.tmp-PID` that the next write of the
same OUT removes). A failed write (a full disk, a read-only mount, ...) removes the hidden
directory and raises one FlotillaError naming OUT and the problem.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import sys
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from flotilla.errors import FlotillaError
from flotilla.kernels.gptq import GPTQWeight

from .config import ModelConfig
from .fused_names import fuse_tensors
from .safetensors_stream import concat_safetensors

FORMAT_NAME = "flotilla"
FORMAT_VERSION = 1
MANIFEST_FILE = "flotilla.json"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
QUANTIZE_CONFIG_FILE = "quantize_config.json"  # AutoGPTQ reads a local model's quantization from this file
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "generation_config.json")
GPTQ_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")

EMBED_KEY = "embed"  # layer key of the embedding (first stage)
HEAD_KEY = "head"  # layer key of the final norm and lm_head (last stage)


def layer_key(name: str) -> str:
    """The layer a tensor belongs to: 'embed', '0'..'L-1', or 'head'."""
    if name.startswith("model.layers."):
        return name.split(".")[2]
    if name.startswith("model.embed_tokens."):
        return EMBED_KEY
    if name.startswith(("model.norm.", "model.norm_matrix.", "lm_head.")):
        return HEAD_KEY
    raise FlotillaError(f"tensor {name!r} belongs to no known layer")


def shard_file_name(index: int, total: int) -> str:
    return f"model-{index:05d}-of-{total:05d}.safetensors"


def gptq_tensors(prefix: str, w: GPTQWeight, bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one quantized linear, named as GPTQ checkpoints name them:
    `prefix` is the projection (`model.layers.0.self_attn.q_proj`), never a merged linear."""
    tensors = {f"{prefix}.qweight": w.qweight, f"{prefix}.qzeros": w.qzeros,
               f"{prefix}.scales": w.scales.to(torch.float16),
               f"{prefix}.g_idx": w.g_idx.to(torch.int32).clone()}  # own storage: merged projections share one
    if bias is not None:
        tensors[f"{prefix}.bias"] = bias.to(torch.float16)
    return tensors


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class ShardInfo:
    file: str
    size: int
    sha256: str
    layers: tuple[str, ...]


@dataclass(frozen=True)
class Manifest:
    format_version: int
    shards: tuple[ShardInfo, ...]

    @property
    def layer_to_shard(self) -> dict[str, str]:
        return {layer: s.file for s in self.shards for layer in s.layers}

    def shard(self, file: str) -> ShardInfo:
        for s in self.shards:
            if s.file == file:
                return s
        raise FlotillaError(f"{MANIFEST_FILE} does not list shard {file!r}")

    def to_json(self) -> dict:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "shards": [{"file": s.file, "size": s.size, "sha256": s.sha256, "layers": list(s.layers)}
                       for s in self.shards],
            "layer_to_shard": self.layer_to_shard,
        }

    @classmethod
    def read(cls, directory: Path) -> "Manifest":
        path = directory / MANIFEST_FILE
        try:
            d = json.loads(path.read_text())
            if d.get("format") != FORMAT_NAME:
                raise FlotillaError(f"{path}: not a flotilla manifest (format={d.get('format')!r})")
            if d.get("format_version") != FORMAT_VERSION:
                raise FlotillaError(f"{path}: format_version {d.get('format_version')!r} is not supported "
                                    f"(this flotilla reads version {FORMAT_VERSION})")
            shards = tuple(ShardInfo(s["file"], int(s["size"]), s["sha256"], tuple(s["layers"]))
                           for s in d["shards"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise FlotillaError(f"{path}: malformed manifest ({e})") from None
        return cls(FORMAT_VERSION, shards)

    def verify(self, directory: Path, file: str) -> None:
        """Check one shard's size and sha256; raise naming the file when it does not match."""
        info = self.shard(file)
        path = directory / file
        if not path.is_file():
            raise FlotillaError(f"{path}: shard is missing")
        size = path.stat().st_size
        if size != info.size:
            raise FlotillaError(f"{path}: shard is {size} bytes, the manifest says {info.size} (truncated or replaced)")
        digest = sha256_file(path)
        if digest != info.sha256:
            raise FlotillaError(f"{path}: sha256 mismatch (file {digest[:12]}…, manifest {info.sha256[:12]}…); "
                                "the shard is corrupt")


def is_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST_FILE).is_file()


class CheckpointWriter:
    """Streams layers into shards of at most `shard_size` bytes (or one layer, if larger), then
    commits atomically. Each layer is written to disk as it arrives and a shard's layers are
    joined when the shard is cut, so the writer holds no more than the layer being added.

        with CheckpointWriter(out, config, shard_size=2 << 30) as w:
            w.add_layer("embed", {...}); w.add_layer("0", {...}); ...
            w.copy_files(src_dir, TOKENIZER_FILES)
            w.commit()

    Leaving the block without commit() (an exception) removes the temporary directory; a killed
    process leaves it hidden (`.OUT.tmp-PID`), and the next writer of OUT removes it. An OS error
    while writing (ENOSPC, EACCES, EROFS, ... or safetensors' error carrying one) removes it at
    once and becomes a FlotillaError naming OUT; `size_hint` (the checkpoint's expected bytes, 0:
    unknown) lets a full disk's message say how much space to free.
    """

    def __init__(self, out: str | Path, config: ModelConfig, shard_size: int = 2 << 30, force: bool = False,
                 size_hint: int = 0):
        remove_stale_writes(Path(out).expanduser().absolute())  # first: it may put back an OUT
        self.out = self.check_target(out, force)
        self.force = force
        self.config = config
        self.shard_size = shard_size
        self.size_hint = size_hint
        self._parts: list[Path] = []  # layers spilled to disk, waiting for their shard to be cut
        self._pending_layers: list[str] = []
        self._pending_bytes = 0
        self._written: list[tuple[str, list[str], list[str]]] = []  # (temp file, layers, tensor names)
        self._committed = False
        self._old: Path | None = None  # the OUT that --force replaces, moved aside during the rename
        self.total_bytes = 0
        self.tmp = self.out.parent / f".{self.out.name}.tmp-{os.getpid()}"
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        with self._write_errors():
            self.out.parent.mkdir(parents=True, exist_ok=True)  # -o runs/today/model makes runs/today, as mkdir -p
            self.tmp.mkdir()  # last: from here on the caller's `with` (or abort) owns it

    @staticmethod
    def check_target(out: str | Path, force: bool = False, source: str | Path | None = None) -> Path:
        """Raise unless a checkpoint can be written at `out`; checks by creating (and removing) an
        empty probe directory next to it, since permission bits do not tell the whole story
        (root, read-only mounts). `force` replaces an existing directory only where it is empty or
        a model checkpoint (`replaceable`), and never one that holds `source`. Returns the absolute
        path."""
        out = Path(out).expanduser().absolute()
        if source is not None:
            src, real = Path(source).expanduser().resolve(), out.resolve()
            if src in real.parents:
                raise FlotillaError(f"{out}: inside the source model {src}; choose a directory outside the "
                                    "source model for -o")
            if out.exists() and (src == real or real in src.parents):
                raise FlotillaError(f"{out}: holds the source {src}; write the checkpoint somewhere else "
                                    "(--force never replaces the model it reads)")
        if out.exists() and not force:
            raise FlotillaError(f"{out}: already exists; pass --force to replace it")
        if out.exists() and not out.is_dir():
            raise FlotillaError(f"{out}: exists and is not a directory")
        if out.exists():
            why = replaceable(out)
            if why:
                raise FlotillaError(f"{out}: {why}; --force replaces only an empty directory or a model "
                                    "checkpoint: pick another -o, or move that directory away yourself")
        parent = existing_ancestor(out)  # missing folders between are made when the writing starts (mkdir -p)
        if not parent.is_dir():
            raise FlotillaError(f"{parent}: not a directory, so {out} cannot be made under it")
        probe = parent / f".{out.name}.probe-{os.getpid()}"
        try:
            probe.mkdir()
            probe.rmdir()
        except OSError as e:
            raise FlotillaError(f"{parent}: not writable, cannot create the output there ({e.strerror})") from None
        return out

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._committed:
            self.abort()

    @contextlib.contextmanager
    def _write_errors(self):
        """Within: an OS error, or a safetensors/tokenizers error that carries one ("... (os error 28)"),
        removes the temporary directory and is raised as one FlotillaError naming OUT."""
        try:
            yield
        except OSError as e:
            raise self._write_error(e.errno, e.strerror or str(e)) from None
        except Exception as e:  # noqa: BLE001 - the Rust writers' errors have no OSError type
            m = _OS_ERROR.search(str(e))
            if m is None and not isinstance(e, SafetensorError):
                raise
            raise self._write_error(int(m.group(1)) if m else None, str(e)) from None

    def _write_error(self, code: int | None, detail: str) -> FlotillaError:
        if not self._committed:
            self.abort()  # first: the free space reported is what the user has without the partial write
        if code is None:
            return FlotillaError(f"cannot write {self.out}: {detail}; nothing was written")
        problem = os.strerror(code)
        problem = problem[:1].lower() + problem[1:]
        if code in (errno.ENOSPC, errno.EDQUOT):
            advice = self._space_advice()
        elif code == errno.EFBIG:
            advice = "a file-size limit (ulimit -f, or the filesystem's): lower --shard-size or choose another -o"
        else:
            advice = "choose another -o"
        return FlotillaError(f"{problem} writing {self.out}: {advice}")

    @staticmethod
    def space_needed(size_hint: int, shard_size: int) -> int:
        """Bytes a write of `size_hint` takes at its peak (0: unknown): the checkpoint, and the last shard
        joined beside its parts."""
        return size_hint + min(shard_size, size_hint) if size_hint else 0

    @staticmethod
    def check_space(out: Path, size_hint: int, shard_size: int) -> None:
        """Refuse, before the work rather than after it, a write that cannot fit where `out` goes (quantize
        calls it before calibrating; the writer itself only advises once a write fails)."""
        need = CheckpointWriter.space_needed(size_hint, shard_size)
        try:
            free = shutil.disk_usage(existing_ancestor(out)).free
        except OSError:
            return
        if need > free:
            raise FlotillaError(f"not enough space for {out}: writing it takes about {_size(need)} and "
                                f"{_size(free)} is free there; free {_size(need - free)} or choose another -o")

    def _space_advice(self) -> str:
        try:
            free = shutil.disk_usage(self.out.parent).free
        except OSError:
            return "free space there or choose another -o"
        if not self.size_hint:
            return f"{_size(free)} is free there; free more or choose another -o"
        need = self.space_needed(self.size_hint, self.shard_size)
        took = f"writing it takes about {_size(need)} and {_size(free)} is free there"
        if need > free:
            return f"{took}; free {_size(need - free)} or choose another -o"
        return f"{took} now; free more or choose another -o"

    def add_layer(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        """Add every tensor of one layer; layers are never split across shards. The layer goes to
        disk at once (a part file), so memory holds one layer whatever the shard size."""
        tensors = fuse_tensors(self.config, tensors)  # Phi-3: q/k/v and gate/up under its fused names
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        with self._write_errors():
            if self._parts and self._pending_bytes + size > self.shard_size:
                self._flush()
            part = self.tmp / f"part-{len(self._written):05d}-{len(self._parts):05d}.safetensors"
            save_file({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}, str(part),
                      metadata={"format": "pt"})
        self._parts.append(part)
        self._pending_layers.append(key)
        self._pending_bytes += size

    def _flush(self) -> None:
        """Cut a shard: join the spilled layers into one file."""
        if not self._parts:
            return
        temp = f"shard-{len(self._written):05d}.safetensors"
        names = concat_safetensors(self._parts, self.tmp / temp)
        os.chmod(self.tmp / temp, _FILE_MODE)
        for part in self._parts:
            part.unlink()
        self._written.append((temp, self._pending_layers, names))
        self._parts, self._pending_layers, self._pending_bytes = [], [], 0

    def copy_files(self, src: Path, names=TOKENIZER_FILES) -> None:
        for name in names:
            if (src / name).is_file():
                with self._write_errors():
                    shutil.copyfile(src / name, self.tmp / name)

    def save_tokenizer(self, tokenizer) -> None:
        """Write a flotilla.models.tokenizer.Tokenizer's files (tokenizer.json, its config and
        chat template) into the checkpoint."""
        with self._write_errors():
            tokenizer.save(self.tmp)

    def write_file(self, name: str, data: bytes | str) -> None:
        with self._write_errors():
            (self.tmp / name).write_bytes(data.encode() if isinstance(data, str) else data)

    def commit(self) -> Path:
        with self._write_errors():
            return self._commit()

    def _commit(self) -> Path:
        self._flush()
        total = len(self._written)
        if total == 0:
            raise FlotillaError("nothing to write: the checkpoint has no tensors")
        shards, weight_map = [], {}
        for i, (temp, layers, names) in enumerate(self._written, start=1):
            final = shard_file_name(i, total)
            os.replace(self.tmp / temp, self.tmp / final)
            path = self.tmp / final
            shards.append(ShardInfo(final, path.stat().st_size, sha256_file(path), tuple(layers)))
            weight_map.update({n: final for n in names})
        self.total_bytes = sum(s.size for s in shards)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        self.write_file(INDEX_FILE, json.dumps(index, indent=2))
        hf = self.config.to_hf_dict()
        self.write_file(CONFIG_FILE, json.dumps(hf, indent=2))
        if "quantization_config" in hf:  # the same settings (GPTQModel and transformers read config.json's)
            self.write_file(QUANTIZE_CONFIG_FILE, json.dumps(hf["quantization_config"], indent=2))
        self.write_file(MANIFEST_FILE, json.dumps(Manifest(FORMAT_VERSION, tuple(shards)).to_json(), indent=2))
        for p in self.tmp.iterdir():
            _fsync_path(p)
        _fsync_path(self.tmp)
        if self.out.exists() or self.out.is_symlink():
            why = ("it was not there when the run began" if not self.force
                   else "it is no longer a directory" if not self.out.is_dir() else replaceable(self.out))
            if why:  # another run or a user made it meanwhile: never replaced without --force's checks
                aside = _free_name(self.out.parent, f"{self.out.name}.new")
                os.replace(self.tmp, aside)
                self._committed = True
                raise FlotillaError(f"{self.out} appeared during the run and was left as it is ({why}); the "
                                    f"checkpoint was written to {aside} instead")
            self._old = self.out.parent / f".{self.out.name}.old-{os.getpid()}"
            os.replace(self.out, self._old)
        os.replace(self.tmp, self.out)
        self._committed = True
        self._finish_commit()
        return self.out

    def _finish_commit(self) -> None:
        """After the rename: fsync OUT's directory and remove the OUT that --force replaced. The
        checkpoint is in place, so an interrupt meanwhile (Ctrl-C, SIGTERM) is dropped and the step
        done again: the write has happened, and the caller reports it as written."""
        def remove_old() -> None:
            if self._old is not None:
                shutil.rmtree(self._old, ignore_errors=True)
                self._old = None

        for step in (lambda: _fsync_path(self.out.parent), remove_old):
            while True:
                try:
                    step()
                    break
                except OSError:  # an fsync that fails after the rename: the checkpoint is there
                    break
                except BaseException:  # noqa: BLE001 - an interrupt: too late to undo, finish the step
                    continue

    def abort(self) -> None:
        """Remove the temporary directory; put back an OUT that commit() had moved aside."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self._old is not None and self._old.exists() and not self.out.exists():
            os.replace(self._old, self.out)


def existing_ancestor(path: Path) -> Path:
    """The nearest folder above `path` that exists (its parent, unless folders between are still to be made)."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent


def _free_name(parent: Path, name: str) -> Path:
    """`parent / name`, or with -2, -3, ... appended: the first that does not exist."""
    path, i = parent / name, 1
    while path.exists() or path.is_symlink():
        i += 1
        path = parent / f"{name}-{i}"
    return path


def remove_stale_writes(out: Path) -> None:
    """What writers of `out` that died left: their temporary directories go; an OUT that a --force
    commit had moved aside (`.OUT.old-PID`) goes back to `out` where `out` is missing (the writer
    died between its two renames), else it goes too. Those that writers of other names beside it left
    are named on stderr (with their size), not removed: that name is theirs to write again."""
    _name_stale_writes(out)
    for p in [*out.parent.glob(f".{out.name}.tmp-*"), *out.parent.glob(f".{out.name}.old-*")]:
        try:
            pid = int(p.name.rsplit("-", 1)[1])
            os.kill(pid, 0)  # still running: leave it alone
        except ProcessLookupError:
            if p.name.startswith(f".{out.name}.old-") and not out.exists():
                os.replace(p, out)
            else:
                shutil.rmtree(p, ignore_errors=True)
        except (ValueError, PermissionError, OverflowError):
            pass


def _name_stale_writes(out: Path) -> None:
    for p in sorted(out.parent.glob(".*.tmp-*")):
        name, _, pid = p.name[1:].rpartition(".tmp-")
        if name == out.name or not pid.isdigit() or not p.is_dir() or not any(p.glob("*.safetensors")):
            continue  # (a writer's holds its shards' parts: another tool's folder is not named)
        try:
            os.kill(int(pid), 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError, ValueError):
            continue
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        print(f"note: {p} ({size / 2**20:.0f} MiB) is what a writer of {p.parent / name} that did not finish left; "
              f"quantizing to {name} again removes it, or remove it yourself", file=sys.stderr)


REPLACEABLE_SUBDIRS = (".cache", ".git", ".huggingface", "original")  # beside a model: a hub's or git's own, Llama's


def replaceable(path: Path) -> str:
    """Why `quantize --force` must not replace the existing directory `path`, or "" where it may: one that
    holds only dotfiles, or a model checkpoint (a flotilla manifest, or a Hugging Face config.json beside
    safetensors or pytorch_model*.bin weights) whose only subdirectories are REPLACEABLE_SUBDIRS; never the
    root, nor a directory that holds the home or the current directory."""
    real = path.resolve()
    for name, held in (("home", Path.home().resolve()), ("current", Path.cwd().resolve())):
        if real == held or real in held.parents:
            return f"holds the {name} directory"
    if real.parent == real:
        return "is the root directory"
    entries = list(path.iterdir())
    if all(p.name.startswith(".") and p.is_file() for p in entries):
        return ""
    names = {p.name for p in entries}
    weights = any(n.endswith(".safetensors") or (n.startswith("pytorch_model") and n.endswith(".bin"))
                  for n in names)
    if MANIFEST_FILE not in names and (CONFIG_FILE not in names or not weights):
        listed = ", ".join(sorted(names)[:4]) + (", ..." if len(names) > 4 else "")
        return f"is not a model checkpoint (it holds {listed})"
    subdirs = sorted(p.name for p in entries if p.is_dir() and p.name not in REPLACEABLE_SUBDIRS)
    if subdirs:
        return f"holds directories ({', '.join(subdirs[:4])}) beside the model"
    return ""


_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust's io::Error names its errno


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


_FILE_MODE = _umask_mode()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
