"""The private MPS daemon for local stages that share a GPU (runtime/pipeline/mps.py), on the CPU: a
stand-in `nvidia-cuda-mps-control` on PATH (a shell script that opens the control pipe in -f mode
and takes `quit` on stdin as the real one does) and a stand-in CUDA client. The real daemon runs in
bench/gpu_pipeline.py on a GPU (`--mps auto,off`)."""
from __future__ import annotations

import os
import signal
import stat
import sys
import tempfile
import pytest
import torch

from flotilla.errors import FlotillaError
from flotilla.runtime.pipeline import mps
from flotilla.runtime.pipeline.local import LocalWorkers

FAKE = """#!/bin/sh
if [ "$1" = "-f" ]; then
  echo "started $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> "$FAKE_MPS_LOG"
  echo $$ > "$CUDA_MPS_PIPE_DIRECTORY/pid"
  echo $$ > "$FAKE_MPS_LOG.pid"
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"
  n=0
  while [ ! -e "$CUDA_MPS_PIPE_DIRECTORY/quit" ] && [ $n -lt 3000 ]; do sleep 0.02; n=$((n+1)); done
  echo "stopped" >> "$FAKE_MPS_LOG"
  exit 0
fi
read cmd
if [ "$cmd" = get_server_list ]; then  # answers only while its daemon lives (a killed one leaves the pipe)
  kill -0 "$(cat "$CUDA_MPS_PIPE_DIRECTORY/pid" 2>/dev/null)" 2>/dev/null && exit 0
  exit 1
fi
echo "command $cmd" >> "$FAKE_MPS_LOG"
[ "$cmd" = quit ] && touch "$CUDA_MPS_PIPE_DIRECTORY/quit"
exit 0
"""
# the client: sees the daemon's pipe directory, and the GPUs it was asked to touch
CLIENT = ("import os, sys\n"
          "open(os.environ['FAKE_MPS_LOG'], 'a').write('client ' + os.environ['CUDA_MPS_PIPE_DIRECTORY'] + ' '"
          " + ','.join(sys.argv[1:]) + '\\n')\n")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    control = bin_dir / mps.CONTROL
    control.write_text(FAKE)
    control.chmod(control.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "mps.log"
    log.write_text("")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_LOG", str(log))
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the daemons' directories, for subprocesses too
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr(mps, "DEFAULT_PIPE_DIR", str(tmp_path / "no-daemon-here"))
    monkeypatch.setattr(mps, "_PROBE", CLIENT)
    yield log
    for pid_file in tmp_path.glob("**/pid"):  # a daemon a failed test left running
        try:
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        except (ValueError, ProcessLookupError):
            pass


def running_daemon(tmp_path):
    """A daemon that runs already, as `nvidia-cuda-mps-control -d` would leave it: (its pipe
    directory, its process)."""
    import subprocess
    import time

    pipe = tmp_path / "theirs"
    pipe.mkdir()
    proc = subprocess.Popen([mps.CONTROL, "-f"], env=dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(pipe)))
    while not (pipe / "control").exists():
        time.sleep(0.02)
    return str(pipe), proc


def test_only_gpus_that_two_local_processes_use_are_shared():
    assert mps.shared_gpus(["cuda:0", "cuda:0", "cpu"]) == ["cuda:0"]
    assert mps.shared_gpus(["cuda", "cuda:0"]) == ["cuda:0"]
    assert mps.shared_gpus(["cuda:0", "cuda:1", "cpu", "cpu"]) == []
    assert mps.shared_gpus(["cuda:0", "cuda:1"], tp=2) == ["cuda:1"]  # stage 0 on 0-1, stage 1 on 1-2


def test_a_private_daemon_serves_stages_on_one_gpu_and_goes_with_them(fake):
    lines = []
    choice = mps.mps_for(["cuda:0", "cuda:0", "cuda:1"], "auto", lines.append)
    daemon = choice.daemon
    assert daemon is not None and choice.used and choice.env == daemon.client_env()
    pipe = choice.env["CUDA_MPS_PIPE_DIRECTORY"]
    assert os.path.exists(os.path.join(pipe, "control")) and "private MPS daemon" in lines[0]
    assert choice.env_for("cuda:0") == choice.env and choice.env_for("cuda:1") == {}  # only the shared GPU's workers
    log = fake.read_text().splitlines()
    assert log[0] == f"started {pipe} {choice.env['CUDA_MPS_LOG_DIRECTORY']}"
    assert log[1] == f"client {pipe} cuda:0"  # a CUDA client got through before the workers start
    choice.stop()
    assert fake.read_text().splitlines()[2:] == ["command quit", "stopped"]
    assert daemon.proc.poll() == 0 and not os.path.exists(daemon.root)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_the_daemon_goes_with_a_head_that_dies_without_stopping_it(fake):
    import subprocess
    import time

    head = ("import os, sys; from flotilla.runtime.pipeline import mps; mps._PROBE = sys.argv[1]; "
            "mps.MpsDaemon.start(['cuda:0']); os._exit(0)")  # no stop(): as if killed
    subprocess.run([sys.executable, "-c", head, CLIENT], check=True, timeout=60)
    pid = int(open(f"{fake}.pid").read())
    deadline = time.monotonic() + 10
    while not _gone(pid):
        assert time.monotonic() < deadline, "the daemon outlived its head"
        time.sleep(0.05)


def test_no_daemon_where_no_gpu_is_shared_or_mps_is_off(fake):
    lines = []
    assert mps.mps_for(["cuda:0", "cuda:1", "cpu"], "on", lines.append) == mps.MpsChoice()
    off = mps.mps_for(["cuda:0", "cuda:0"], "off", lines.append)
    assert off.daemon is None and not off.used and off.env == {}
    assert lines == [] and fake.read_text() == ""


def test_a_daemon_that_runs_already_is_used_and_off_keeps_the_workers_from_it(fake, tmp_path, monkeypatch):
    pipe, _ = running_daemon(tmp_path)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", pipe)
    lines = []
    choice = mps.mps_for(["cuda:0", "cuda:0"], "auto", lines.append)
    assert choice.used and choice.daemon is None and choice.env == {}  # the workers inherit the variable
    assert pipe in lines[0] and fake.read_text().splitlines()[-1] == f"client {pipe} cuda:0"
    assert mps.is_mps_client(torch.device("cuda", 0)) and not mps.is_mps_client(torch.device("cpu"))
    off = mps.mps_for(["cuda:0", "cuda:0"], "off", lines.append)
    assert not off.used and off.env["CUDA_MPS_PIPE_DIRECTORY"] != pipe  # a directory no daemon serves
    assert not os.path.exists(off.env["CUDA_MPS_PIPE_DIRECTORY"])


def test_a_daemon_killed_earlier_is_not_taken_for_a_running_one(fake, tmp_path, monkeypatch):
    pipe, proc = running_daemon(tmp_path)
    proc.kill()  # its control pipe stays behind
    proc.wait()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", pipe)
    assert mps.running_pipe_dir() is None and not mps.is_mps_client(torch.device("cuda", 0))
    choice = mps.mps_for(["cuda:0", "cuda:0"], "auto", lambda line: None)
    assert choice.daemon is not None and choice.env["CUDA_MPS_PIPE_DIRECTORY"] != pipe  # a private one
    choice.stop()


def test_without_the_control_program_auto_goes_on_without_mps_and_on_refuses(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(mps, "DEFAULT_PIPE_DIR", str(tmp_path / "none"))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    lines = []
    choice = mps.mps_for(["cuda:0", "cuda:0"], "auto", lines.append)
    assert choice.daemon is None and not choice.used and choice.env == {}
    assert "without MPS" in lines[0] and "not installed" in lines[0] and "nvidia-cuda-mps-control -d" in lines[0]
    with pytest.raises(FlotillaError, match="--mps on: nvidia-cuda-mps-control is not installed"):
        mps.mps_for(["cuda:0", "cuda:0"], "on", lines.append)
    with pytest.raises(FlotillaError, match="expected one of auto, on, off"):
        mps.mps_for(["cuda:0", "cuda:0"], "yes", lines.append)


def test_a_daemon_no_client_gets_through_is_stopped_and_not_used(fake, monkeypatch, tmp_path):
    monkeypatch.setattr(mps, "_PROBE", "import sys; sys.exit('RuntimeError: CUDA error: all CUDA-capable devices are busy')")
    lines = []
    choice = mps.mps_for(["cuda:0", "cuda:0"], "auto", lines.append)
    assert choice.daemon is None and not choice.used
    assert "devices are busy" in lines[0] and "without MPS" in lines[0]
    assert fake.read_text().splitlines()[-2:] == ["command quit", "stopped"]  # nothing left running
    assert not list(tmp_path.glob("flotilla-mps-*"))
    with pytest.raises(FlotillaError, match="--mps on: a CUDA client of the MPS daemon failed"):
        mps.mps_for(["cuda:0", "cuda:0"], "on", lines.append)


def _workers(monkeypatch, fail_at: int | None = None):
    import subprocess

    started, real_popen = [], subprocess.Popen

    class Worker:  # a `runtime worker` that is up at once
        def __init__(self, cmd, env, **kw):
            if len(started) == fail_at:
                raise OSError("no such file")
            started.append((cmd[cmd.index("--device") + 1], env))
            self.stdout = iter(["flotilla worker: listening on 127.0.0.1:5000\n"])

        def poll(self):
            return None

        def terminate(self):
            pass

        def wait(self, timeout=None):
            return 0

    def popen(cmd, *args, **kw):  # the workers stand-ins; the daemon and its client for real
        return Worker(cmd, **kw) if "worker" in cmd else real_popen(cmd, *args, **kw)

    monkeypatch.setattr(subprocess, "Popen", popen)
    return started


def test_local_workers_start_their_daemon_and_stop_it_with_them(fake, monkeypatch, tmp_path):
    started = _workers(monkeypatch)
    workers = LocalWorkers(3, tmp_path, b"t" * 32, ["cuda:0", "cuda:0", "cpu"], log=lambda line: None, spin_us=0)
    assert workers.start(timeout=10) == [("127.0.0.1", 5000)] * 3
    pipe = workers.mps.daemon.pipe_dir
    assert [(d, env.get("CUDA_MPS_PIPE_DIRECTORY")) for d, env in started] == \
        [("cuda:0", pipe), ("cuda:0", pipe), ("cpu", None)]
    workers.stop()
    assert workers.mps.daemon is None and fake.read_text().splitlines()[-1] == "stopped"


def test_local_workers_that_fail_to_start_leave_no_daemon(fake, monkeypatch, tmp_path):
    _workers(monkeypatch, fail_at=1)
    workers = LocalWorkers(2, tmp_path, b"t" * 32, ["cuda:0", "cuda:0"], log=lambda line: None, spin_us=0)
    with pytest.raises(OSError):
        workers.start(timeout=10)
    assert fake.read_text().splitlines()[-1] == "stopped" and not list(tmp_path.glob("flotilla-mps-*"))


def test_the_head_names_stages_that_share_a_gpu_without_mps():
    from flotilla.runtime.pipeline.partition import shared_without_mps

    devices = ["cuda:0", "cuda:0", "cpu", "cuda:1", "cuda:0"]
    ids = ["gpu-a", "gpu-a", "h/cpu", "gpu-b", "gpu-c"]  # the fifth: another host's cuda:0
    assert shared_without_mps(devices, ids, [False] * 5) == [[0, 1]]
    assert shared_without_mps(devices, ids, [True, False, False, False, False]) == [[0, 1]]
    assert shared_without_mps(devices, ids, [True, True, False, False, False]) == []
    assert shared_without_mps(["cpu", "cpu"], ["h/cpu", "h/cpu"], [False, False]) == []  # CPU stages: no contexts


