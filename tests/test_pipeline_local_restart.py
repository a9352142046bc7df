"""`runtime serve --pp N` without --hosts: the head's own workers are supervised. One killed is started
again on its address and the head picks it up (the next requests give pp=1's tokens), and so is one that hangs
(alive, not heard from); one that keeps dying is left down, said once, and reaped (no zombies)."""
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
            addr = f"{hosts[1][0]}:{hosts[1][1]}"
            assert wait_until(lambda: f"[worker 1] started again on {addr}" in lines, 20), lines
            assert f"[worker 1] exited (status -9); starting it again on {addr} in 0.5 s" in lines
            assert workers.procs[1] is not victim
            assert wait_until(lambda: sum(f"listening on {addr}" in line for line in lines) == 2, 120), lines
            assert generate(engine, prompts[2:4], params) == [r[:TOKENS] for r in reference[2:4]]
            # a hung worker (stopped: alive, silent) is killed once the head has not heard from it for the
            # timeout, and so started again
            workers.watch(engine.executor.pipeline.last_heard, 6.0)  # production: >= 30 s
            stuck = workers.procs[0]
            stuck.send_signal(signal.SIGSTOP)
            addr0 = f"{hosts[0][0]}:{hosts[0][1]}"
            assert wait_until(lambda: f"[worker 0] started again on {addr0}" in lines, 30), lines
            assert any(line.startswith("[worker 0] alive but not heard from for") for line in lines), lines
            assert stuck.wait(10) == -signal.SIGKILL
            assert wait_until(lambda: sum(f"listening on {addr0}" in line for line in lines) == 2, 120), lines
            assert generate(engine, prompts[4:6], params) == [r[:TOKENS] for r in reference[4:6]]
        finally:
            engine.close()
    finally:
        workers.stop()


def _fake_workers(monkeypatch, tmp_path, exit_code: int):
    """LocalWorkers whose workers say where they listen, then exit at once with `exit_code`."""
    monkeypatch.setattr(local, "POLL_S", 0.05)
    monkeypatch.setattr(local, "RESTART_DELAY_S", 0.01)
    monkeypatch.setattr(local, "RESTART_LIMIT", 2)
    lines: list[str] = []
    launched: list[subprocess.Popen] = []

    def launch(self, i):
        code = f"import sys; print('flotilla worker: listening on 127.0.0.1:7999', flush=True); sys.exit({exit_code})"
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        launched.append(proc)
        return proc

    monkeypatch.setattr(LocalWorkers, "_launch", launch)
    return LocalWorkers(1, tmp_path, b"t" * 32, ["cpu"], log=lines.append, spin_us=0), lines, launched


def test_a_worker_that_keeps_dying_is_left_down_and_reaped(monkeypatch, tmp_path):
    workers, lines, launched = _fake_workers(monkeypatch, tmp_path, 3)
    try:
        assert workers.start(timeout=30) == [("127.0.0.1", 7999)]
        assert wait_until(lambda: any("left down" in line for line in lines), 10), lines
        mine = [line for line in lines if "listening on" not in line]  # the supervisor's own lines
        assert mine == ["[worker 0] exited (status 3); starting it again on 127.0.0.1:7999 in 0.01 s",
                        "[worker 0] started again on 127.0.0.1:7999",
                        "[worker 0] exited (status 3); starting it again on 127.0.0.1:7999 in 0.02 s",
                        "[worker 0] started again on 127.0.0.1:7999",
                        "[worker 0] exited (status 3) after 2 restarts within 300 s: left down; its stage "
                        "cannot serve until the head is restarted"], mine
        assert len(launched) == 3
        assert not wait_until(lambda: len(launched) > 3, 0.5)  # not restarted again
        assert [p.returncode for p in launched] == [3, 3, 3]  # set by the supervisor's poll: reaped, no zombie
    finally:
        workers.stop()


def test_a_worker_asked_to_stop_is_not_started_again(monkeypatch, tmp_path):
    """Exit status 0 (or SIGTERM / SIGINT): a service manager stopping the whole group, not a crash."""
    workers, lines, launched = _fake_workers(monkeypatch, tmp_path, 0)
    try:
        workers.start(timeout=30)
        assert wait_until(lambda: "[worker 0] stopped (status 0): it was asked to; not starting it again" in lines,
                          10), lines
        assert not wait_until(lambda: len(launched) > 1, 0.5)
    finally:
        workers.stop()
