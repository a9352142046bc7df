"""Compile the CUDA kernels once (just in time) and cache the shared libraries on disk.

Three libraries, each built only when first needed: WQA16 (csrc/api.cu: the Marlin-style kernels of
kernel.py), GEMV (csrc/gemv_api.cu: the small-batch GEMV over the Triton layout, gemv.py) and TILE
(csrc/tile_api.cu: the Hopper tile GEMM over the same layout for larger batches, tile.py; sm_90 only). The
sources ship as package data (csrc/). The first process that needs one on a GPU compiles it with
nvcc for that GPU's architecture, saying so on stderr; later processes load the cached library. The library has a plain C interface (csrc/api.cu) and links the CUDA runtime
statically, so it does not depend on torch's C++ ABI: flotilla loads it with ctypes and passes
device pointers and the stream. A build is named after the architecture and a hash of the
sources and flags, so an edit gets its own build and a stale one is never loaded. Builds go
where the CPU kernels' builds go (flotilla/kernels/cpu/build.py: TORCH_EXTENSIONS_DIR, else
FLOTILLA_CACHE_DIR/torch_extensions, else ~/.cache/flotilla/torch_extensions).

nvcc is found as $CUDA_HOME/bin/nvcc (or $CUDA_PATH), else on PATH, else /usr/local/cuda. When
it is missing or compiling fails, `load()` prints one warning line (per library) and returns None;
the callers then use the Triton kernels (or, without Triton, the dense one).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .._build_util import failure_reason
from ..cpu.build import extensions_dir

CSRC = Path(__file__).resolve().parent / "csrc"
FLAGS = ("-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden", "-lineinfo")
MIN_CAPABILITY = (8, 0)  # cp.async, ldmatrix, bf16 mma.sync


@dataclass(frozen=True)
class Library:
    """One shared library: its sources (compiled in parallel, then linked) and the headers they include."""
    name: str  # the build's file name starts with it
    sources: tuple[str, ...]
    headers: tuple[str, ...]
    fallback: str  # what serves instead when it cannot be built, for the warning line


WQA16 = Library("flotilla_cuda", ("api.cu", "instance_f16_w4.cu", "instance_f16_w8.cu", "instance_bf16_w4.cu",
                                  "instance_bf16_w8.cu"), ("wqa16.cuh", "instances.cuh"),
                "using the Triton kernels (the dense one where Triton is not installed)")
GEMV = Library("flotilla_gemv", ("gemv_api.cu", "gemv_f16_w4.cu", "gemv_f16_w8.cu", "gemv_bf16_w4.cu",
                                 "gemv_bf16_w8.cu"), ("gemv.cuh", "gemv_mma.cuh", "gemv_wide.cuh", "gemv_instances.cuh"),
               "small batches use the Triton kernel")
TILE = Library("flotilla_tile", ("tile_api.cu", "tile_w4.cu", "tile_w8.cu"), ("tile.cuh", "gemv.cuh"),
               "medium and large batches use the Triton tiles and dequantize + cuBLAS")

_loaded: dict[tuple[str, str], ctypes.CDLL] = {}
_failed: dict[tuple[str, str], str] = {}


def arch_flags(capability: tuple[int, int]) -> tuple[str, ...]:
    """nvcc target for one compute capability (9.0 gets sm_90a, Hopper's full instruction set)."""
    major, minor = capability
    suffix = "a" if (major, minor) == (9, 0) else ""
    return (f"-gencode=arch=compute_{major}{minor}{suffix},code=sm_{major}{minor}{suffix}",)


def build_name(capability: tuple[int, int], lib: Library = WQA16) -> str:
    h = hashlib.sha256()
    for name in lib.sources + lib.headers:
        h.update(name.encode() + b"\0" + (CSRC / name).read_bytes())
    h.update(" ".join(FLAGS + arch_flags(capability)).encode())
    return f"{lib.name}_sm{capability[0]}{capability[1]}_{h.hexdigest()[:12]}"


def find_nvcc() -> str | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def library_path(capability: tuple[int, int], lib: Library = WQA16) -> Path:
    name = build_name(capability, lib)
    return extensions_dir() / name / f"{name}.so"


def load(capability: tuple[int, int], lib: Library = WQA16) -> ctypes.CDLL | None:
    """The compiled library for a GPU of this compute capability, or None (after one warning)."""
    key = (lib.name, f"{capability[0]}.{capability[1]}")
    if key in _loaded:
        return _loaded[key]
    if key in _failed:
        return None
    if tuple(capability) < MIN_CAPABILITY:
        return _fail(key, lib, f"compute capability {key[1]} is below {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}")
    path = library_path(capability, lib)
    try:
        if not path.is_file():
            nvcc = find_nvcc()
            if nvcc is None:
                return _fail(key, lib, "nvcc not found (set CUDA_HOME or put nvcc on PATH)")
            compile_library(nvcc, capability, path, lib)
        cdll = ctypes.CDLL(str(path))
    except Exception as e:  # a compile error, an unwritable cache, a broken toolchain
        return _fail(key, lib, failure_reason(e, 200))
    _loaded[key] = cdll
    return cdll


def compile_library(nvcc: str, capability: tuple[int, int], path: Path, lib: Library = WQA16) -> None:
    """Compile every source in parallel, link one shared library, move it into place atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"compiling {lib.name} once (sm_{capability[0]}{capability[1]}, into {path.parent})…",
          file=sys.stderr, flush=True)
    flags = list(FLAGS + arch_flags(capability))
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        objects = [str(Path(tmp) / (Path(s).stem + ".o")) for s in lib.sources]

        def compile_one(pair):
            src, obj = pair
            _run([nvcc, *flags, "-c", str(CSRC / src), "-o", obj])

        workers = max(1, min(len(lib.sources), os.cpu_count() or 1))
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(compile_one, zip(lib.sources, objects)))
        out = Path(tmp) / path.name
        _run([nvcc, "-shared", "-cudart", "static", *flags, *objects, "-o", str(out)])
        os.replace(out, path)


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip().splitlines()
        first = next((ln for ln in err if "error" in ln), err[0] if err else "nvcc failed")
        raise RuntimeError(f"nvcc failed: {first}")


def _fail(key: tuple[str, str], lib: Library, why: str) -> None:
    if key not in _failed:
        _failed[key] = why
        print(f"warning: {lib.name} unavailable ({why}); {lib.fallback}", file=sys.stderr)
    return None
