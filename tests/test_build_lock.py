"""A build killed half-way never leaves the next process waiting (kernels/_build_util.build_lock)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from flotilla.kernels._build_util import TORCH_BATON, build_lock
from flotilla.kernels.cpu import build


def lock_holder(directory, seconds: float) -> subprocess.Popen:
    """A process that holds the build lock on `directory` for `seconds` (it prints 'held' once it does)."""
    code = ("import sys, time; from pathlib import Path; from flotilla.kernels._build_util import build_lock\n"
            "with build_lock(Path(sys.argv[1]), 'test'):\n"
            "    print('held', flush=True); time.sleep(float(sys.argv[2]))\n")
    return subprocess.Popen([sys.executable, "-c", code, str(directory), str(seconds)], stdout=subprocess.PIPE,
                            text=True)


def test_a_stale_torch_baton_is_removed(tmp_path):
    (tmp_path / TORCH_BATON).write_text("")
    with build_lock(tmp_path, "test"):
        assert not (tmp_path / TORCH_BATON).exists()


def test_the_lock_of_a_killed_builder_is_released(tmp_path, capfd, monkeypatch):
    """A holder killed with SIGKILL (the kernel drops its flock); a live holder is waited for, and said to
    be once the wait passes QUIET_WAIT_S (0.2 s here)."""
    from flotilla.kernels import _build_util

    monkeypatch.setattr(_build_util, "QUIET_WAIT_S", 0.2)
    holder = lock_holder(tmp_path, 60)
    try:
        assert holder.stdout.readline().strip() == "held"
        (tmp_path / TORCH_BATON).write_text("")  # what the killed build would leave

        def kill_soon():
            time.sleep(0.5)
            os.kill(holder.pid, signal.SIGKILL)

        threading.Thread(target=kill_soon, daemon=True).start()
        with build_lock(tmp_path, "the test kernels"):
            assert holder.wait(timeout=10) == -signal.SIGKILL
            assert not (tmp_path / TORCH_BATON).exists()
        assert "waiting for another process that is building the test kernels" in capfd.readouterr().err
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.skipif(build.load() is None, reason="the CPU kernels cannot be compiled here")
def test_the_cpu_kernels_load_past_a_stale_baton():
    """The cached build's directory with the `lock` file a killed first run leaves: a new process
    loads the kernels (before the fix it waited on the file forever)."""
    isa = build.best_isa()
    directory = build.extensions_dir() / build.build_name(isa)
    (directory / TORCH_BATON).write_text("")
    code = "from flotilla.kernels.cpu import build; assert build.load() is not None"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    assert not (directory / TORCH_BATON).exists()


def test_a_short_hold_is_waited_for_without_a_word(tmp_path, capfd):
    """A holder that lets go within QUIET_WAIT_S (a process loading the built kernels under the lock, as two
    pipeline workers starting together do) is waited for silently."""
    holder = lock_holder(tmp_path, 0.3)
    try:
        assert holder.stdout.readline().strip() == "held"
        with build_lock(tmp_path, "the test kernels"):
            pass
        assert "waiting for another process" not in capfd.readouterr().err
    finally:
        holder.wait(timeout=10)
