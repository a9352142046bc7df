"""What a pipeline says about itself, on a tiny random Llama over loopback: a fault names the stage that
went down (its neighbour's report as detail), /metrics has a gauge per stage, a shutdown does not wait out
the grace period for requests that a down stage holds, local workers stop quietly, and `runtime chat` runs
over local stages."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from flotilla.runtime.engine_args import EngineArgs
from flotilla.runtime.pipeline.head import build_pipeline_engine
from flotilla.runtime.pipeline.messages import Fault
from flotilla.runtime.pipeline.peer import LinkSettings
from flotilla.runtime.pipeline.pipeline import PipelineSettings
from flotilla.runtime.sampling import SamplingParams
from flotilla.server.config import ServerConfig
from flotilla.server.engine_client import EngineClient

from conftest import SIMPLE_CHAT_TEMPLATE, make_hf_model, save_byte_tokenizer, save_hf_model, tiny_config
from pipeline_helpers import REPO, TOKEN, ThreadWorker, checkpoint_per_layer, wait_until
from server_harness import LiveServer
from test_server_limits import parse_exposition

ARGS = EngineArgs(kv_cache_memory="4MiB", max_num_seqs=4)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    hf = save_hf_model(make_hf_model(tiny_config("llama", vocab_size=256, max_position_embeddings=512,
                                                 num_hidden_layers=4)), d / "hf")
    save_byte_tokenizer(hf, SIMPLE_CHAT_TEMPLATE)
    return checkpoint_per_layer(hf, d / "ckpt")


def pipeline(ckpt, workers, report, **kw):
    settings = PipelineSettings(tuple(w.address for w in workers), LinkSettings(TOKEN), (2, 2), dtype="float16",
                                **kw)
    return build_pipeline_engine(ckpt, ARGS, settings, report)


def _down_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("pipeline down:")]


def test_a_fault_names_the_stage_that_went_down_not_the_one_that_noticed(ckpt, tmp_path):
    workers = [ThreadWorker(tmp_path / f"c{i}", ckpt) for i in range(2)]
    lines: list[str] = []
    engine = pipeline(ckpt, workers, lines.append, stage_timeout=1.0)
    pipe = engine.executor.pipeline
    dead, noticer = workers[0].address, workers[1].address
    try:
        assert [up for *_, up in pipe.stage_status()] == [True, True]

        def fault_then_death():
            # stage 1's word arrives first (as it does when stage 0's process dies), then stage 0's own end
            pipe._on_data(pipe.peers[1], Fault(pipe.epoch, "the connection from stage 0 was lost"))
            workers[0].stop()  # on the head's loop: its pings go out only after stage 0 is gone
        pipe._loop.call_soon_threadsafe(fault_then_death)
        assert wait_until(lambda: _down_lines(lines), 10), lines
        (line,) = _down_lines(lines)
        assert line.startswith(f"pipeline down: stage 0 ({dead[0]}:{dead[1]}): "), line
        assert f"stage 1 ({noticer[0]}:{noticer[1]}) noticed first: the connection from stage 0 was lost" in line
        assert pipe.stage_status() == [(0, f"{dead[0]}:{dead[1]}", "cpu", False),
                                       (1, f"{noticer[0]}:{noticer[1]}", "cpu", True)]
        engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
        start, ended = time.monotonic(), []
        while engine.has_unfinished() and time.monotonic() - start < 10:
            ended += [o for o in engine.step() if o.finished]
        assert ended[0].error.startswith(f"pipeline stage 0 ({dead[0]}:{dead[1]}) is unreachable"), ended[0].error
    finally:
        engine.close()
        for w in workers:
            if w.thread.is_alive():  # not stopped by the test
                w.stop()


def test_a_broken_link_between_live_workers_is_said_as_reported_and_repaired(ckpt, tmp_path):
    workers = [ThreadWorker(tmp_path / f"c{i}", ckpt) for i in range(2)]
    lines: list[str] = []
    engine = pipeline(ckpt, workers, lines.append)
    pipe = engine.executor.pipeline
    try:
        epoch = pipe.epoch
        start = time.monotonic()
        pipe._loop.call_soon_threadsafe(pipe._on_data, pipe.peers[1], Fault(epoch, "stage 1 lost its connection "
                                                                                   "to stage 0"))
        assert wait_until(lambda: _down_lines(lines), 10), lines
        assert time.monotonic() - start < 1.5  # every worker answered its ping: no waiting for a heartbeat
        (line,) = _down_lines(lines)
        address = "%s:%d" % workers[1].address
        assert line.startswith(f"pipeline down: stage 1 ({address}) reports: stage 1 lost its connection "
                               "to stage 0; repairing"), line
        assert wait_until(lambda: engine.executor.ready, 30) and pipe.epoch == epoch + 1
    finally:
        engine.close()
        for w in workers:
            if w.thread.is_alive():  # not stopped by the test
                w.stop()


def _metrics(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return parse_exposition(r.read().decode())


def test_metrics_gauge_each_stage_and_shutdown_does_not_wait_for_a_down_stage(ckpt, tmp_path):
    workers = [ThreadWorker(tmp_path / f"c{i}", ckpt) for i in range(2)]
    engine = pipeline(ckpt, workers, lambda line: None, stage_timeout=120.0)
    addresses = ["%s:%d" % w.address for w in workers]
    live = LiveServer(EngineClient(engine, "tiny"), ServerConfig(port=0, grace_period=60.0)).__enter__()
    try:
        def up() -> dict:
            return {dict(labels)["stage"]: (dict(labels)["host"], dict(labels)["device"], v)
                    for (n, labels), v in _metrics(live.url).items() if n == "flotilla_pipeline_stage_up"}
        assert up() == {"0": (addresses[0], "cpu", 1), "1": (addresses[1], "cpu", 1)}
        workers[1].stop()
        assert wait_until(lambda: up()["1"][2] == 0, 30)
        assert up()["0"][2] == 1
        # a request that arrives now waits for stage 1 (--stage-timeout 120): the drain must not wait 60 s for it
        got: list = []

        def ask():
            body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 4}'
            req = urllib.request.Request(live.url + "/v1/completions", body, {"Content-Type": "application/json"})
            try:
                urllib.request.urlopen(req, timeout=120)
            except urllib.error.HTTPError as e:
                got.append(e.code)
        t = threading.Thread(target=ask, daemon=True)
        t.start()
        assert wait_until(lambda: live.state.admission.in_flight == 1, 30)
        start = time.monotonic()
        live.stop()
        assert time.monotonic() - start < 10
        t.join(30)
        assert got and got[0] >= 500
    finally:
        if live.server is not None:
            live.stop()
        for w in workers:
            if w.thread.is_alive():  # not stopped by the test
                w.stop()


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("FLOTILLA_TOKEN", None)
    env.pop("FLOTILLA_KERNEL", None)
    return env


def test_local_workers_stop_quietly(ckpt):
    proc = subprocess.Popen([sys.executable, "-m", "flotilla.server.cli", "serve", str(ckpt), "--devices", "cpu,cpu",
                             "--port", "0", "--kv-cache-memory", "4MiB", "--max-num-seqs", "2", "--threads", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "chat page:" in line:  # the last line of the start
                break
        url = re.search(r"OpenAI API at (http://\S+)/v1", "".join(lines)).group(1)
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            assert r.status == 200
        proc.send_signal(signal.SIGINT)
        rest = proc.stdout.read()
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rest.strip().splitlines() == ["flotilla: shutting down"], rest


def test_chat_runs_over_local_stages(ckpt):
    cmd = [sys.executable, "-m", "flotilla.runtime.cli", "chat", str(ckpt), "--max-tokens", "6", "--temperature", "0",
           "--kv-cache-memory", "4MiB", "--threads", "1"]
    one = subprocess.run(cmd, input="hello\nagain\n", capture_output=True, text=True, env=_env(), timeout=300)
    two = subprocess.run(cmd[:-2] + ["--threads", "2", "--devices", "cpu,cpu"], input="hello\nagain\n",
                         capture_output=True, text=True, env=_env(), timeout=300)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert "starting 2 local workers (cpu, cpu)" in two.stderr
    assert len(one.stdout.splitlines()) == 2 and two.stdout == one.stdout  # greedy: the same replies
    assert "WARNING" not in two.stderr
