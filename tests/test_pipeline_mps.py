"""The private MPS daemon for local stages that share a GPU (runtime/pipeline/mps.py), on the CPU: a
stand-in `nvidia-cuda-mps-control` on PATH (a shell script that opens the control pipe in -f mode
and takes `quit` on stdin as the real one does) and a stand-in CUDA client. The real daemon runs in
bench/gpu_pipeline.py on a GPU (`--mps auto,off`)."""
from __future__ import annotations

import os
import stat
import sys
import pytest

from flotilla.errors import FlotillaError
from flotilla.runtime.pipeline import mps
from flotilla.runtime.pipeline.local import LocalWorkers

FAKE = """#!/bin/sh
if [ "$1" = "-f" ]; then
  echo "started $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> "$FAKE_MPS_LOG"
  echo $$ > "$FAKE_MPS_LOG.pid"
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"
  while [ ! -e "$CUDA_MPS_PIPE_DIRECTORY/quit" ]; do sleep 0.02; done
  echo "stopped" >> "$FAKE_MPS_LOG"
  exit 0
fi
read cmd
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
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr(mps, "DEFAULT_PIPE_DIR", str(tmp_path / "no-daemon-here"))
    monkeypatch.setattr(mps, "_PROBE", CLIENT)
    return log


def test_only_gpus_that_two_local_processes_use_are_shared():
    assert mps.shared_gpus(["cuda:0", "cuda:0", "cpu"]) == ["cuda:0"]
    assert mps.shared_gpus(["cuda", "cuda:0"]) == ["cuda:0"]
    assert mps.shared_gpus(["cuda:0", "cuda:1", "cpu", "cpu"]) == []
    assert mps.shared_gpus(["cuda:0", "cuda:1"], tp=2) == ["cuda:1"]  # stage 0 on 0-1, stage 1 on 1-2


def test_a_private_daemon_serves_stages_on_one_gpu_and_goes_with_them(fake):
    lines = []
    daemon, env = mps.mps_for(["cuda:0", "cuda:0"], "auto", lines.append)
    assert daemon is not None and env == daemon.client_env()
    pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
    assert os.path.exists(os.path.join(pipe, "control")) and "private MPS daemon" in lines[0]
    log = fake.read_text().splitlines()
    assert log[0] == f"started {pipe} {env['CUDA_MPS_LOG_DIRECTORY']}"
    assert log[1] == f"client {pipe} cuda:0"  # a CUDA client got through before the workers start
    daemon.stop()
    assert fake.read_text().splitlines()[2:] == ["command quit", "stopped"]
    assert daemon.proc.poll() == 0 and not os.path.exists(daemon.root)


def test_the_daemon_goes_with_a_head_that_dies_without_stopping_it(fake):
    import subprocess
    import time

    head = ("import os, sys; from flotilla.runtime.pipeline import mps; mps._PROBE = sys.argv[1]; "
            "mps.MpsDaemon.start(['cuda:0']); os._exit(0)")  # no stop(): as if killed
    subprocess.run([sys.executable, "-c", head, CLIENT], check=True, timeout=60)
    pid = int(open(f"{fake}.pid").read())
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z":
        assert time.monotonic() < deadline, "the daemon outlived its head"
        time.sleep(0.05)


def test_no_daemon_where_no_gpu_is_shared_or_mps_is_off(fake):
    lines = []
    assert mps.mps_for(["cuda:0", "cuda:1", "cpu"], "on", lines.append) == (None, {})
    assert mps.mps_for(["cuda:0", "cuda:0"], "off", lines.append) == (None, {})
    assert lines == [] and fake.read_text() == ""


def test_a_daemon_that_runs_already_is_used(fake, tmp_path, monkeypatch):
    running = tmp_path / "theirs"
    running.mkdir()
    (running / "control").touch()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(running))
    lines = []
    assert mps.mps_for(["cuda:0", "cuda:0"], "auto", lines.append) == (None, {})
    assert str(running) in lines[0] and fake.read_text() == ""  # the workers inherit the variable


def test_without_the_control_program_auto_goes_on_without_mps_and_on_refuses(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(mps, "DEFAULT_PIPE_DIR", str(tmp_path / "none"))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    lines = []
    assert mps.mps_for(["cuda:0", "cuda:0"], "auto", lines.append) == (None, {})
    assert "without MPS" in lines[0] and "not installed" in lines[0] and "nvidia-cuda-mps-control -d" in lines[0]
    with pytest.raises(FlotillaError, match="--mps on: nvidia-cuda-mps-control is not installed"):
        mps.mps_for(["cuda:0", "cuda:0"], "on", lines.append)
    with pytest.raises(FlotillaError, match="expected one of auto, on, off"):
        mps.mps_for(["cuda:0", "cuda:0"], "yes", lines.append)


def test_a_daemon_no_client_gets_through_is_stopped_and_not_used(fake, monkeypatch):
    monkeypatch.setattr(mps, "_PROBE", "import sys; sys.exit('RuntimeError: CUDA error: all CUDA-capable devices are busy')")
    lines = []
    assert mps.mps_for(["cuda:0", "cuda:0"], "auto", lines.append) == (None, {})
    assert "devices are busy" in lines[0] and "without MPS" in lines[0]
    assert fake.read_text().splitlines()[-2:] == ["command quit", "stopped"]  # nothing left running
    with pytest.raises(FlotillaError, match="--mps on: a CUDA client of the MPS daemon failed"):
        mps.mps_for(["cuda:0", "cuda:0"], "on", lines.append)


def test_local_workers_start_their_daemon_and_stop_it_with_them(fake, monkeypatch, tmp_path):
    import subprocess

    started, real_popen = [], subprocess.Popen

    class Worker:  # a `runtime worker` that is up at once
        def __init__(self, cmd, env, **kw):
            started.append(env)
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
    workers = LocalWorkers(2, tmp_path, b"t" * 32, ["cuda:0", "cuda:0"], log=lambda line: None, spin_us=0)
    assert workers.start(timeout=10) == [("127.0.0.1", 5000)] * 2
    pipe = workers.mps.pipe_dir
    assert [env["CUDA_MPS_PIPE_DIRECTORY"] for env in started] == [pipe, pipe]
    workers.stop()
    assert workers.mps is None and fake.read_text().splitlines()[-1] == "stopped"


def test_the_head_names_stages_that_share_a_gpu_without_mps():
    from flotilla.runtime.pipeline.partition import shared_without_mps

    devices = ["cuda:0", "cuda:0", "cpu", "cuda:1", "cuda:0"]
    ids = ["gpu-a", "gpu-a", "h/cpu", "gpu-b", "gpu-c"]  # the fifth: another host's cuda:0
    assert shared_without_mps(devices, ids, [False] * 5) == [[0, 1]]
    assert shared_without_mps(devices, ids, [True, False, False, False, False]) == [[0, 1]]
    assert shared_without_mps(devices, ids, [True, True, False, False, False]) == []
    assert shared_without_mps(["cpu", "cpu"], ["h/cpu", "h/cpu"], [False, False]) == []  # CPU stages: no contexts


def test_a_worker_says_whether_it_is_an_mps_client(fake, tmp_path, monkeypatch):
    import json

    import torch

    from flotilla.runtime.pipeline.messages import Probe
    from flotilla.runtime.pipeline.probe import worker_info
    from flotilla.runtime.pipeline.wire import decode, encode

    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
              "max_position_embeddings": 128, "rms_norm_eps": 1e-5}
    probe = Probe(json.dumps(config), False, "auto")
    (tmp_path / "pipe").mkdir()
    (tmp_path / "pipe" / "control").touch()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "pipe"))
    info = decode(encode(worker_info(probe, torch.device("cpu"), "v")))
    assert info.mps is False  # a CPU worker is no GPU client whatever its environment says
