"""Every environment variable flotilla reads, in one place.

    FLOTILLA_CACHE_DIR   where the embedded default model, converted tokenizers and the compiled
                         CPU kernels (torch_extensions/) are cached
                         (default: $XDG_CACHE_HOME/flotilla, i.e. ~/.cache/flotilla); also read
                         by flotilla.kernels.cpu.build, which imports nothing of flotilla's
    TORCH_EXTENSIONS_DIR torch's own variable: when set, the compiled CPU kernels go there instead
    CXX                  the C++ compiler for the CPU kernels (default: c++; none: dense fallback)
    FLOTILLA_CPU_ISA     avx2 or avx512: the instruction set of the compiled CPU kernels (default: the
                         widest this CPU runs; avx2 on an AVX-512 CPU runs the AVX2 build, as CI
                         does to test both); read by flotilla.kernels.cpu.build
    FLOTILLA_KERNEL      force one dequant-matmul kernel by name (read by flotilla.kernels.registry,
                         which imports nothing of flotilla's)
    FLOTILLA_PDL         0: no programmatic dependent launch on sm_90+ GPUs (read by flotilla.kernels.pdl,
                         which imports nothing of flotilla's; default on)
    FLOTILLA_NORM_FUSION 0: RMSNorm kernels between the CUDA GEMVs at 1-2 rows, where by default the
                         GEMVs add the residuals and apply the norms (read by flotilla.models.llama when a
                         model is frozen; default on)
    FLOTILLA_TILE        0: no Hopper tile GEMM for 128-1024 batch rows (the Triton tiles and dequantize +
                         cuBLAS serve them); nosplit: the tile GEMM without split-K (read by
                         flotilla.kernels.cuda.tile when a kernel object is built; default on)
    FLOTILLA_GEMV_WIDE   0: the CUDA GEMV's wide plan (9-16 rows) is never picked (read by
                         flotilla.kernels.cuda.gemv; default on where it measured faster)
    FLOTILLA_GEMV_OFFSETS 1 (on, true, yes): the GGUF float-offset forms on the CUDA GEMV's tensor cores at 1-8
                         rows (read by flotilla.kernels.cuda.gemv; default off: slower than Triton in an H100
                         decode); 0 (off, false, no): off; anything else is an error (switch())
    FLOTILLA_GEMV_GROUP32 0 (off, false, no): the group-32 / 16 layouts (the GGUF forms) at 1 row keep the tensor-core
                         ring or Triton, as before round 23; default (cores, 1, on, …): the CUDA GEMV's CUDA-core
                         plans at 1 row, each strip's scales and offsets loaded a strip ahead (read by
                         flotilla.kernels.cuda.gemv; measured faster on an H100)
    FLOTILLA_TOKEN       the shared secret of pipeline workers (`runtime worker`, `runtime serve --pp`)
    FLOTILLA_API_KEY     the server's API key, as an alternative to --api-key-file
    FLOTILLA_LANES       0: pipeline stages on one host (one GPU, or CPU processes) hand their
                         outputs over through the socket only, never through shared memory
                         (runtime/pipeline/lane.py; default 1)
    GLOO_SOCKET_IFNAME   torch's own variable: the interface gloo uses between tensor-parallel
                         CPU ranks; flotilla.runtime.tp sets it to the loopback (lo) on Linux
                         when unset, since all ranks share one host
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    env = os.environ.get("FLOTILLA_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "flotilla"


def token() -> str | None:
    return os.environ.get("FLOTILLA_TOKEN") or None


def api_key() -> str | None:
    return os.environ.get("FLOTILLA_API_KEY") or None


ON_WORDS, OFF_WORDS = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def switch(name: str, default: bool, also_on: tuple[str, ...] = ()) -> bool:
    """An on / off variable: 1, on, true, yes (or `also_on`) / 0, off, false, no; unset or empty: `default`.
    Anything else is a ValueError naming the variable and its words."""
    flag = os.environ.get(name, "").strip().lower()
    if not flag:
        return default
    if flag in ON_WORDS + also_on:
        return True
    if flag in OFF_WORDS:
        return False
    raise ValueError(f"{name}={flag!r}: expected one of {', '.join(ON_WORDS + also_on)} (on) or "
                     f"{', '.join(OFF_WORDS)} (off), or unset")


def lanes() -> bool:
    return os.environ.get("FLOTILLA_LANES", "1").strip().lower() not in ("0", "false", "no", "off")
