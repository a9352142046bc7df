"""The pipeline across three network namespaces: each worker in its own namespace, joined to the
head's by a veth link into a bridge that this test creates, so every hop of the ring crosses
real (virtual) network interfaces with their own addresses. Skipped, with the reason, where
namespaces cannot be made (no CAP_NET_ADMIN, no iproute2)."""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys

import pytest

from flotilla.runtime.engine_args import EngineArgs
from flotilla.runtime.pipeline.head import build_pipeline_engine
from flotilla.runtime.pipeline.peer import LinkSettings
from flotilla.runtime.pipeline.pipeline import PipelineSettings
from flotilla.runtime.sampling import SamplingParams

from pipeline_helpers import TOKEN, ProcessWorker, smollm2_reference


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


class Namespaces:
    """A bridge in this namespace and `n` namespaces, each with a veth pair into it."""

    def __init__(self, n: int):
        tag = f"{os.getpid() % 100000}"
        self.bridge = f"flb{tag}"
        self.names = [f"flt{tag}{chr(97 + i)}" for i in range(n)]
        self.veths = [f"flv{tag}{chr(97 + i)}" for i in range(n)]
        used = _ip("-4", "-o", "addr")
        self.subnet = next(f"10.{x}.77" for x in range(213, 250) if f" 10.{x}.77." not in used)
        self.addresses = [f"{self.subnet}.{i + 2}" for i in range(n)]

    def __enter__(self) -> "Namespaces":
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for ns, veth, addr in zip(self.names, self.veths, self.addresses):
                _ip("netns", "add", ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}n")
                _ip("link", "set", veth, "master", self.bridge)
                _ip("link", "set", veth, "up")
                _ip("link", "set", f"{veth}n", "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", f"{veth}n")
                _ip("-n", ns, "link", "set", f"{veth}n", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as e:
            self.__exit__()
            raise RuntimeError(f"`{' '.join(e.cmd)}` failed: {e.stderr.strip()}") from None
        return self

    def __exit__(self, *exc) -> None:
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def rx_bytes(self, i: int) -> int:
        """Bytes received by namespace i's end of its veth link."""
        out = _ip("-n", self.names[i], "-s", "link", "show", f"{self.veths[i]}n").splitlines()
        return int(out[out.index(next(x for x in out if x.strip().startswith("RX:"))) + 1].split()[0])


@pytest.fixture(scope="module")
def namespaces():
    if shutil.which("ip") is None:
        reason = "network namespaces cannot be made here: the `ip` command (iproute2) is not installed"
    else:
        try:
            with Namespaces(3) as ns:
                yield ns
            return
        except RuntimeError as e:
            reason = f"network namespaces cannot be made here (needs root / CAP_NET_ADMIN): {e}"
    print(f"SKIPPED: {reason}", file=sys.stderr)
    pytest.skip(reason)


def test_three_workers_in_three_namespaces_equal_pp1(namespaces, smollm2_int4):
    prompts, want, _ = smollm2_reference(smollm2_int4)
    workers = [ProcessWorker(port=7070, model=smollm2_int4, host=addr, prefix=["ip", "netns", "exec", ns])
               for ns, addr in zip(namespaces.names, namespaces.addresses)]
    engine = None
    try:
        for w in workers:
            w.wait_listening()
        rx_before = [namespaces.rx_bytes(i) for i in range(3)]
        settings = PipelineSettings(tuple(w.address for w in workers), LinkSettings(TOKEN), layers=(10, 10, 10))
        engine = build_pipeline_engine(smollm2_int4, EngineArgs(kv_cache_memory="64MiB", max_num_seqs=16), settings)
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"ns-{i}", p, params)
        got: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert [got[f"ns-{i}"] for i in range(16)] == [w[:16] for w in want]
        stats = engine.executor.pipeline.worker_stats()
        for i in (1, 2):  # the hidden states that stage i-1 sent crossed namespace i's veth link
            assert namespaces.rx_bytes(i) - rx_before[i] >= stats[i - 1].bytes_sent > 0
    finally:
        if engine is not None:
            engine.close()
        for w in workers:
            w.stop()
