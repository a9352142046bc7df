"""`quantize` when the checkpoint cannot be written (a full disk, a quota, a read-only mount, a file-size
limit) or the process is told to stop (SIGTERM, Ctrl-C): one line, its exit status, and no temporary
directory left behind."""
from __future__ import annotations

import errno
import json
import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors import SafetensorError
from safetensors.torch import save_file

from flotilla.models import checkpoint
from flotilla.models.sources import open_source
from flotilla.quantize.cli import main as quantize_main
from flotilla.quantize.options import QuantizeOptions
from flotilla.quantize.pipeline import checkpoint_bytes

from quantize_helpers import cli_env, tiny_model_dir
from test_quantize_cli import assert_one_line_error, listing

RTN8 = ["--quiet", "--method", "rtn", "--bits", "8", "--shard-size", "1"]  # no calibration; a shard a layer


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("src") / "tiny", seed=3)


def failing_on(call: int, real, error: BaseException):
    """`real`, except that its `call`-th call raises `error` (the ones before it write for real)."""
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise error
        return real(*args, **kwargs)
    return wrapper


# ------------------------------------------------------------------------------ a failing write

WRITE_FAILURES = {
    # case: (module attribute that fails, on which call, the error, fragments of the message)
    "enospc-writing-a-layer": (checkpoint, "save_file", 2, OSError(errno.ENOSPC, "No space left on device"),
                               ["no space left on device writing", "is free there", "choose another -o"]),
    "enospc-from-safetensors": (checkpoint, "save_file", 3, SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"),
        ["no space left on device writing", "choose another -o"]),
    "quota-cutting-a-shard": (checkpoint, "concat_safetensors", 2, OSError(errno.EDQUOT, "Disk quota exceeded"),
                              ["disk quota exceeded writing", "choose another -o"]),
    "permission-copying-the-tokenizer": (shutil, "copyfile", 1, PermissionError(errno.EACCES, "Permission denied"),
                                         ["permission denied writing", "choose another -o"]),
    "read-only-at-commit": (checkpoint, "_fsync_path", 1, OSError(errno.EROFS, "Read-only file system"),
                            ["read-only file system writing", "choose another -o"]),
}


@pytest.mark.parametrize("case", sorted(WRITE_FAILURES))
def test_a_failed_write_is_one_line_exit_2_and_leaves_nothing(case, src, tmp_path, monkeypatch, capsys):
    module, name, call, error, fragments = WRITE_FAILURES[case]
    monkeypatch.setattr(module, name, failing_on(call, getattr(module, name), error))
    out = tmp_path / "out"
    assert quantize_main([str(src), "-o", str(out), *RTN8]) == 2
    err = capsys.readouterr().err
    assert_one_line_error(err, str(out), *fragments)
    assert "Traceback" not in err and "os error" not in err
    assert listing(tmp_path) == set()  # no OUT, no .out.tmp-PID, no probe


def test_a_full_disk_says_how_much_to_free(src, tmp_path, monkeypatch, capsys):
    """The space asked for is the checkpoint's size (the estimate within 10% of what a run writes) plus
    the last shard, joined beside its parts; here every layer is a shard, so about the size itself."""
    done = tmp_path / "done"
    assert quantize_main([str(src), "-o", str(done), *RTN8]) == 0
    written = json.loads((done / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    estimate = checkpoint_bytes(open_source(src).config, QuantizeOptions(bits=8, method="rtn"))
    assert abs(estimate - written) < 0.1 * written, (estimate, written)

    # too little space from the start: refused before any layer is quantized, not after the work
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=10 << 30, used=10 << 30, free=500))
    out = tmp_path / "out"
    saves = []
    monkeypatch.setattr(checkpoint, "save_file", lambda *a, **k: saves.append(a))
    assert quantize_main([str(src), "-o", str(out), *RTN8]) == 2
    line = capsys.readouterr().err.strip()
    m = re.fullmatch(rf"error: not enough space for {re.escape(str(out))}: writing it takes about "
                     r"([\d.]+) KB and 500 bytes is free there; free ([\d.]+) KB or choose another -o", line)
    assert m, line
    assert abs(float(m.group(1)) * 1e3 - estimate) <= 100 and abs(float(m.group(2)) * 1e3 - (estimate - 500)) <= 100
    assert not saves and listing(tmp_path) == {"done"}

    # the space went while writing (another writer took it): the same advice, and nothing left behind
    frees = iter([10 << 30])  # the check at the start; what the error then finds is 500 bytes
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda path: SimpleNamespace(total=10 << 30, used=10 << 30, free=next(frees, 500)))
    monkeypatch.setattr(checkpoint, "save_file",
                        failing_on(2, save_file, OSError(errno.ENOSPC, "No space left on device")))
    assert quantize_main([str(src), "-o", str(out), *RTN8]) == 2
    line = capsys.readouterr().err.strip()
    m = re.fullmatch(rf"error: no space left on device writing {re.escape(str(out))}: writing it takes about "
                     r"([\d.]+) KB and 500 bytes is free there; free ([\d.]+) KB or choose another -o", line)
    assert m, line
    assert listing(tmp_path) == {"done"}


def test_a_real_write_error_from_the_shell_is_one_line(src, tmp_path):
    """A file-size limit (ulimit -f) makes safetensors' own writer fail with EFBIG mid-run: the real
    SafetensorError, read for its errno, through the real CLI."""
    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000))  # below the 80 KB embedding

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "flotilla.quantize.cli", str(src), "-o", str(out), *RTN8],
                          capture_output=True, text=True, env=cli_env(), timeout=300, preexec_fn=limit_file_size)
    assert proc.returncode == 2, proc.stderr
    assert_one_line_error(proc.stderr, f"file too large writing {out}", "ulimit -f", "--shard-size")
    assert listing(tmp_path) == set()


# ------------------------------------------------------------------------------ told to stop

# `quantize` that stops after its first layer is on disk, prints the temporary directory and waits there
# to be signalled: the signal lands mid-write every time, with no timing to guess.
_STOPS_MID_WRITE = """
import signal, sys, time
from flotilla.models.checkpoint import CheckpointWriter
from flotilla.quantize.cli import main

add_layer = CheckpointWriter.add_layer

def add_layer_and_wait(self, key, tensors):
    add_layer(self, key, tensors)
    print(self.tmp, flush=True)
    time.sleep(300)

CheckpointWriter.add_layer = add_layer_and_wait
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if started in the background
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig, status, message", [
    (signal.SIGTERM, 143, "terminated (SIGTERM); nothing was written"),  # timeout, systemd, docker stop
    (signal.SIGINT, 130, "interrupted; nothing was written"),  # Ctrl-C
], ids=["sigterm", "sigint"])
def test_a_signal_mid_write_removes_the_temporary_directory(sig, status, message, src, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", _STOPS_MID_WRITE, str(src), "-o", str(out), *RTN8],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
    try:
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"quantize ended before its first layer was written: {proc.communicate()[1]}")
        tmp = Path(line.strip())
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.tmp-")
        assert list(tmp.glob("part-*.safetensors"))  # a layer is on disk: there is something to clean up
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == status, err
    assert err.strip() == message
    assert listing(tmp_path) == set()


def test_a_source_without_a_tokenizer_is_said_before_the_work(tmp_path, capsys):
    """Weights only: quantizing works (no calibration text needed), and a warning says at the start that
    `runtime` will need the tokenizer files copied in."""
    bare = tiny_model_dir(tmp_path / "bare", tokenizer=False)
    assert quantize_main([str(bare), "-o", str(tmp_path / "out"), *RTN8]) == 0
    err = capsys.readouterr().err
    assert "warning: no tokenizer with bare" in err and "copy the model's tokenizer.json" in err
    assert not (tmp_path / "out" / "tokenizer.json").exists()
