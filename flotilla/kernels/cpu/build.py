"""Compile the C++ kernels once (just in time) and cache the build on disk.

The sources ship as package data (csrc/). The first process that needs them compiles them with
torch.utils.cpp_extension (g++ and ninja), saying so on stderr; later processes load the cached
shared library. A build is named after the instruction set and a hash of the sources, the flags,
torch and Python, so an edit or an upgrade gets its own build and a stale one is never loaded; the
hash covers where the sources are too, since torch's ninja file names their paths and two installs
sharing one build directory would rebuild it for each other, silently, on every start.

Where builds go (this package imports nothing of flotilla's, so it reads the variables that
flotilla/envs.py documents itself; FLOTILLA_CPU_ISA=avx2 forces the AVX2 build on an AVX-512 CPU):

    TORCH_EXTENSIONS_DIR   if set, builds go there (torch's own convention)
    FLOTILLA_CACHE_DIR     else $FLOTILLA_CACHE_DIR/torch_extensions
    XDG_CACHE_HOME         else $XDG_CACHE_HOME/flotilla/torch_extensions (~/.cache/flotilla/…)

A build runs under an flock of its directory (_build_util.build_lock), so a process killed while
compiling never leaves the next one waiting on torch's lock file forever.

When the CPU lacks AVX2/FMA/F16C, or compiling fails (no compiler, no ninja, a read-only
cache), `load()` prints one warning line and returns None; callers fall back to the dense
kernel.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from .._build_util import build_lock, failure_reason

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("module.cpp", "kernels.cpp", "ops.cpp", "ops_module.cpp")
HEADERS = ("kernels.h", "ops.h", "simd.h")
BASE_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno")
ISA_FLAGS = {
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
}

_loaded: dict[str, object] = {}
_failed: dict[str, str] = {}


ENV_ISA = "FLOTILLA_CPU_ISA"  # avx2 | avx512: build and use that instruction set (flotilla/envs.py)


def cpu_isa() -> str | None:
    """The widest instruction set of ISA_FLAGS this CPU runs, or None (not x86, or no AVX2)."""
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", …
    if capability == "AVX512":
        return "avx512"
    if capability == "AVX2":
        return "avx2"
    return None


def best_isa() -> str | None:
    """The instruction set the kernels use: FLOTILLA_CPU_ISA when set (avx2 on an AVX-512 CPU runs
    and tests the AVX2 build), else the widest this CPU runs. A forced ISA the CPU lacks, or an
    unknown name, is a ValueError naming the valid ones."""
    detected = cpu_isa()
    forced = os.environ.get(ENV_ISA, "").strip().lower()
    if not forced:
        return detected
    if forced not in ISA_FLAGS:
        raise ValueError(f"{ENV_ISA}={forced!r} is not an instruction set; valid: {', '.join(ISA_FLAGS)}")
    order = list(ISA_FLAGS)
    if detected is None or order.index(forced) > order.index(detected):
        raise ValueError(f"{ENV_ISA}={forced}: this CPU runs at most {detected or 'none of ' + ', '.join(order)}")
    return forced


def extensions_dir() -> Path:
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("FLOTILLA_CACHE_DIR")
    if cache:
        return Path(cache).expanduser() / "torch_extensions"
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "flotilla" / "torch_extensions"


def build_name(isa: str) -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode() + b"\0" + (CSRC / name).read_bytes())
    h.update(" ".join(BASE_FLAGS + ISA_FLAGS[isa]).encode())
    h.update(f"{torch.__version__} {sys.version_info[:2]} {CSRC}".encode())
    return f"flotilla_cpu_{isa}_{h.hexdigest()[:12]}"


def load(isa: str | None = None):
    """The compiled extension module for `isa` (default: the best this CPU runs), or None."""
    try:
        isa = isa or best_isa()
    except ValueError as e:
        return _fail("cpu", str(e))
    if isa is None:
        return _fail("cpu", "this CPU lacks AVX2/FMA/F16C")
    if isa in _loaded:
        return _loaded[isa]
    if isa in _failed:
        return None
    missing = _missing_tool()
    if missing:
        return _fail(isa, missing)
    try:
        module = _compile(isa)
    except Exception as e:  # a compile error, an unwritable cache, a broken toolchain
        return _fail(isa, failure_reason(e, 160))
    _loaded[isa] = module
    return module


def _missing_tool() -> str | None:
    from torch.utils.cpp_extension import is_ninja_available

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} not found (set CXX or install g++)"
    if not is_ninja_available():
        return "ninja not found (pip install ninja)"
    return None


def _compile(isa: str):
    from torch.utils.cpp_extension import load as cpp_load

    name = build_name(isa)
    directory = extensions_dir() / name
    directory.mkdir(parents=True, exist_ok=True)
    fresh = not (directory / f"{name}.so").is_file()
    if fresh:
        print(f"compiling flotilla CPU kernels once ({isa}, under a minute; cached in {directory})…",
              file=sys.stderr, flush=True)
    start = time.perf_counter()
    flags = list(BASE_FLAGS + ISA_FLAGS[isa])
    with build_lock(directory, f"the flotilla CPU kernels ({isa})"):
        module = cpp_load(name=name, sources=[str(CSRC / s) for s in SOURCES], extra_cflags=flags,
                          extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
    if fresh:
        print(f"compiled flotilla CPU kernels in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return module


def _fail(isa: str, why: str) -> None:
    if isa not in _failed:
        _failed[isa] = why
        print(f"warning: flotilla CPU kernels unavailable ({why}); using the dense kernel", file=sys.stderr)
    return None
