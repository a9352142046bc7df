"""`runtime serve --pp N` without --hosts: the head's own workers are supervised. One killed is started
again on its address and the head picks it up (the next requests give pp=1's tokens); one that keeps dying
is left down, said once, and reaped (no zombies)."""
from __future__ import annotations

import secrets
import signal
import subprocess
import sys

from flotilla.runtime.engine_args import EngineArgs, generate
from flotilla.runtime.pipeline import local
from flotilla.runtime.pipeline.head import build_pipeline_engine
from flotilla.runtime.pipeline.local import LocalWorkers
from flotilla.runtime.pipeline.peer import LinkSettings
from flotilla.runtime.pipeline.pipeline import PipelineSettings
from flotilla.runtime.sampling import SamplingParams

from pipeline_helpers import smollm2_reference, wait_until

TOKENS = 8


def test_a_killed_local_worker_is_started_again_and_the_head_serves_on(smollm2_int4):
    prompts, reference, _ = smollm2_reference(smollm2_int4)
    token = secrets.token_hex(16).encode()
    lines: list[str] = []
    workers = LocalWorkers(2, smollm2_int4, token, threads=1, log=lines.append)
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    try:
        hosts = workers.start()
        settings = PipelineSettings(tuple(hosts), LinkSettings(token), layers=(15, 15), stage_timeout=120)
        engine = build_pipeline_engine(smollm2_int4, EngineArgs(kv_cache_memory="16MiB", max_num_seqs=4), settings,
                                       lines.append, with_tokenizer=False)
        try:
            assert generate(engine, prompts[:2], params) == [r[:TOKENS] for r in reference[:2]]
            victim = workers.procs[1]
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            assert wait_until(lambda: any(f"[worker 1] exited (status -9); starting it again on "
                                          f"{hosts[1][0]}:{hosts[1][1]}" in line for line in lines), 10), lines
            assert workers.procs[1] is not victim
            assert wait_until(lambda: sum(f"listening on {hosts[1][0]}:{hosts[1][1]}" in line
                                          for line in lines) == 2, 120), lines
            assert generate(engine, prompts[2:4], params) == [r[:TOKENS] for r in reference[2:4]]
        finally:
            engine.close()
    finally:
        workers.stop()


def test_a_worker_that_keeps_dying_is_left_down_and_reaped(monkeypatch, tmp_path):
    monkeypatch.setattr(local, "POLL_S", 0.05)
    monkeypatch.setattr(local, "RESTART_LIMIT", 2)
    lines: list[str] = []
    launched: list[subprocess.Popen] = []

    def launch(self, i, listen):  # a worker that says where it listens, then dies at once
        code = "import sys; print('flotilla worker: listening on 127.0.0.1:7999', flush=True); sys.exit(3)"
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        launched.append(proc)
        return proc

    monkeypatch.setattr(LocalWorkers, "_launch", launch)
    workers = LocalWorkers(1, tmp_path, b"t" * 32, ["cpu"], log=lines.append, spin_us=0)
    try:
        assert workers.start(timeout=30) == [("127.0.0.1", 7999)]
        assert wait_until(lambda: any("left down" in line for line in lines), 10), lines
        restarts = [line for line in lines if "starting it again on 127.0.0.1:7999" in line]
        assert len(restarts) == 2 and restarts[0] == "[worker 0] exited (status 3); starting it again on 127.0.0.1:7999"
        assert len(launched) == 3
        n = len(lines)
        assert not wait_until(lambda: len(lines) > n, 0.5)  # said once, not restarted again
        assert all(p.poll() == 3 for p in launched)  # reaped: no zombie left behind
    finally:
        workers.stop()
