"""What the head says when its pipeline cannot be repaired, on a tiny random Llama over loopback: a local worker
left down ends the server (status 1), a repair that fails after the worker connects says why (a WARNING once
per reason, the current reason in /health and in the requests' errors), a worker whose --model is another
model than the head's is named as such, the stage timeout is logged, and each log line is one write."""
from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time

import pytest

from flotilla.errors import FlotillaError
from flotilla.progress import say_line
from flotilla.runtime.engine_args import EngineArgs
from flotilla.runtime.pipeline import local
from flotilla.runtime.pipeline.head import build_pipeline_engine
from flotilla.runtime.pipeline.local import LocalWorkers
from flotilla.runtime.pipeline.peer import LinkSettings
from flotilla.runtime.pipeline.pipeline import PipelineSettings
from flotilla.runtime.sampling import SamplingParams
from flotilla.server.config import ServerConfig
from flotilla.server.engine_client import EngineClient
from flotilla.server.serve import EngineDied, serve
from flotilla.server.state import ServerState

from conftest import SIMPLE_CHAT_TEMPLATE, make_hf_model, save_byte_tokenizer, save_hf_model, tiny_config
from pipeline_helpers import TOKEN, ThreadWorker, wait_until
from test_pipeline_engine import pipeline_engine

ARGS = EngineArgs(kv_cache_memory="4MiB", max_num_seqs=4)
CONFIG = dict(vocab_size=256, max_position_embeddings=512, num_hidden_layers=4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny Llamas as Hugging Face directories (not flotilla checkpoints: nothing can be pushed)."""
    d = tmp_path_factory.mktemp("tiny-hf")
    head = save_hf_model(make_hf_model(tiny_config("llama", **CONFIG), seed=1), d / "head")
    save_byte_tokenizer(head, SIMPLE_CHAT_TEMPLATE)
    other = save_hf_model(make_hf_model(tiny_config("llama", **CONFIG), seed=2), d / "other")
    return head, other


def pipeline(model, workers, **kw):
    settings = PipelineSettings(tuple(w.address for w in workers), LinkSettings(TOKEN), (2, 2), dtype="float16",
                                **kw)
    return build_pipeline_engine(model, ARGS, settings, lambda line: None)


def _stop_all(workers) -> None:
    for w in workers:
        if w.thread.is_alive():
            w.stop()


# ------------------------------------------------------------------------- bug: a local worker left down

def test_a_local_worker_left_down_ends_the_server(models, tmp_path, monkeypatch):
    """LocalWorkers tell the head's pipeline (the one whose last_heard they watch) of a worker left down; the
    pipeline can never serve again, so /health says so and serve() ends with EngineDied (`runtime serve`: status
    1), as for a dead tensor-parallel rank."""
    head, _ = models
    workers = [ThreadWorker(tmp_path / f"c{i}", head) for i in range(2)]
    engine = pipeline(head, workers)
    pipe = engine.executor.pipeline
    monkeypatch.setattr(local, "POLL_S", 0.05)
    monkeypatch.setattr(local, "RESTART_DELAY_S", 0.01)
    monkeypatch.setattr(local, "RESTART_LIMIT", 1)
    monkeypatch.setattr(LocalWorkers, "_launch", lambda self, i: subprocess.Popen(
        [sys.executable, "-c", "print('flotilla worker: listening on 127.0.0.1:7999', flush=True); exit(3)"],
        stdout=subprocess.PIPE, text=True))
    lines: list[str] = []
    dying = LocalWorkers(1, tmp_path, b"t" * 32, ["cpu"], log=lines.append, spin_us=0)
    dying.watch(pipe.last_heard, 60.0, pipe.stage_left_down)  # as pipeline_engine_from_args does
    client = EngineClient(engine, "tiny")
    try:
        dying.start(timeout=30)
        assert wait_until(lambda: pipe.fatal(), 10), lines
        address = pipe.peers[0].address
        assert pipe.fatal() == [f"pipeline stage 0 ({address}): its local worker exited (status 3) after 1 restarts "
                                f"within 300 s and was left down"]
        assert client.problems() == [f"{pipe.fatal()[0]}; restart the server"]
        with pytest.raises(EngineDied, match=r"pipeline stage 0 .*: its local worker exited \(status 3\)"):
            asyncio.run(asyncio.wait_for(serve(ServerState(ServerConfig(port=0), client), announce=lambda t: None),
                                         30))
    finally:
        dying.stop()
        engine.close()
        _stop_all(workers)


# ------------------------------------------------------------------------- bug: a repair that fails, silently

@pytest.mark.parametrize("comeback", ["another-model", "another-token"])
def test_a_repair_that_fails_after_connecting_says_why_once_and_health_has_the_current_reason(
        models, tmp_path, caplog, comeback):
    head, other = models
    workers = [ThreadWorker(tmp_path / f"c{i}", head) for i in range(2)]
    engine = pipeline(head, workers, stage_timeout=0.5)
    pipe = engine.executor.pipeline
    caplog.set_level(logging.DEBUG, logger="flotilla.pipeline")
    if comeback == "another-model":
        reason = f"this worker's --model {other} is another model than the head's ({head})"
    else:
        reason = "answered, but with another token than this head's"
    try:
        port = workers[1].port
        workers[1].stop()
        assert wait_until(lambda: "cannot connect (connection refused)" in " ".join(pipe.problems()), 10), \
            pipe.problems()
        if comeback == "another-model":
            workers[1] = ThreadWorker(tmp_path / "c1", other, port=port)
        else:
            workers[1] = ThreadWorker(tmp_path / "c1", head, port=port, token=b"another-token-0123456789abcdef")

        def retried() -> int:  # failed repairs with the new reason, said (WARNING) or not (DEBUG)
            return sum(reason in r.getMessage() for r in caplog.records if r.name == "flotilla.pipeline")
        assert wait_until(lambda: retried() >= 3, 20), [r.getMessage() for r in caplog.records]
        (problem,) = pipe.problems()
        address = f"127.0.0.1:{port}"
        assert problem.startswith(f"pipeline stage 1 ({address}) answered, but "), problem
        assert reason in problem and "connection refused" not in problem, problem
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and reason in r.getMessage()]
        assert len(said) == 1, said  # once, not at every retry
        assert said[0].startswith(f"pipeline not repaired yet: pipeline stage 1 ({address}) answered, but"), said
        assert [up for *_, up in pipe.stage_status()] == [True, False]
        # a request gets the current reason too (here at once: the pipeline is down longer than --stage-timeout)
        engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
        (out,) = engine.step()
        assert out.finished and reason in out.error and "connection refused" not in out.error, out.error
        # the worker comes back as it should: the pipeline serves again, its problems gone
        workers[1].stop()
        workers[1] = ThreadWorker(tmp_path / "c1", head, port=port)
        assert wait_until(lambda: engine.executor.ready, 30), pipe.problems()
        assert pipe.problems() == [] and not pipe.missing and pipe.repair_error == ""
    finally:
        engine.close()
        _stop_all(workers)


# ------------------------------------------------------------------------- bug: another --model at startup

def test_a_worker_with_another_model_is_named_as_such_at_startup(models, tmp_path):
    head, other = models
    workers = [ThreadWorker(tmp_path / "c0", head), ThreadWorker(tmp_path / "c1", other)]
    try:
        with pytest.raises(FlotillaError) as err:
            pipeline(head, workers)
        message = str(err.value)
        assert message.startswith(f"worker 127.0.0.1:{workers[1].port}: this worker's --model {other} is another "
                                  f"model than the head's ({head}), and the head's model is not a flotilla "
                                  f"checkpoint"), message
        assert "give the worker the head's model as --model" in message
        assert "has no copy of the model" not in message
    finally:
        _stop_all(workers)


# ------------------------------------------------------------------------- bug: the stage timeout, unlogged

def test_requests_failed_at_the_stage_timeout_are_logged_once_and_health_says_they_fail(caplog):
    caplog.set_level(logging.WARNING, logger="flotilla.pipeline")
    eng = pipeline_engine(stage_timeout=0.3)
    for i in range(3):
        eng.add_request(f"r{i}", [i + 1] * 5, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        eng.step()
    eng.executor.fail()
    eng.step()
    (paused,) = eng.problems()
    assert paused.endswith("; requests are paused and fail after --stage-timeout 0.3s"), paused
    start, finished = time.monotonic(), []
    while eng.has_unfinished() and time.monotonic() - start < 5:
        finished += [o for o in eng.step() if o.finished]
    assert len(finished) == 3
    eng.add_request("while-down", [9, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    (refused,) = eng.step()
    assert refused.error and "refused" in refused.error
    said = [r.getMessage() for r in caplog.records if "--stage-timeout" in r.getMessage()]
    assert said == ["pipeline: 3 requests failed, down longer than --stage-timeout 0.3s: pipeline stage 1 "
                    "(10.0.0.2:7070) is unreachable: connection refused"], said
    (failing,) = eng.problems()
    assert failing == ("pipeline stage 1 (10.0.0.2:7070) is unreachable: connection refused; down longer than "
                       "--stage-timeout 0.3s: requests fail until it is back"), failing


# ------------------------------------------------------------------------- bug: two log lines glued together

class _Writes:
    def __init__(self):
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_report_lines_are_written_with_their_newline_in_one_write(models, tmp_path, monkeypatch):
    """print() writes the newline separately: another thread's line can land between the two."""
    from flotilla.runtime.pipeline import cli
    from test_pipeline_stages import serve_args

    err = _Writes()
    monkeypatch.setattr(sys, "stderr", err)
    say_line("the server's line")
    LocalWorkers(1, tmp_path, b"t" * 32, ["cpu"], spin_us=0).log("a worker's line")

    def no_start(self, timeout=600.0):
        raise RuntimeError("not starting workers in this test")
    monkeypatch.setattr(LocalWorkers, "start", no_start)
    with pytest.raises(RuntimeError, match="not starting"):  # pipeline_engine_from_args's own report, first
        cli.pipeline_engine_from_args(serve_args(str(models[0]), "--pp", "2", "--threads", "1"))
    assert err.writes == ["the server's line\n", "a worker's line\n", "starting 2 local workers (cpu, cpu)\n"]
