"""Tensor parallel inside pipeline stages: SmolLM2-135M INT4 as two local stages, each a
tensor-parallel group of 3 processes over gloo (`runtime serve --pp 2 --tp 3`): 8 concurrent
greedy requests give exactly the tokens of pp=1 (the model in this process).

SmolLM2 has 9 attention heads and 3 KV heads, so 3 is its smallest split (2 is refused with a
one-line error, tests/test_tp.py): six processes on the CI's two cores, one thread each.
"""
from __future__ import annotations

import secrets

from flotilla.runtime.engine_args import EngineArgs, generate
from flotilla.runtime.pipeline.head import build_pipeline_engine
from flotilla.runtime.pipeline.local import LocalWorkers
from flotilla.runtime.pipeline.peer import LinkSettings
from flotilla.runtime.pipeline.pipeline import PipelineSettings
from flotilla.runtime.sampling import SamplingParams

from pipeline_helpers import smollm2_reference

TOKENS = 12  # a prefix of the reference's 24 greedy tokens


def test_pp2_x_tp3_equals_pp1_for_8_concurrent_requests(smollm2_int4):
    prompts, reference, _ = smollm2_reference(smollm2_int4)
    token = secrets.token_hex(16).encode()
    lines: list[str] = []
    workers = LocalWorkers(2, smollm2_int4, token, tp=3, log=lines.append)
    try:
        hosts = workers.start()
        assert all("device cpu x tp 3" in line for line in lines if "listening on" in line), lines
        settings = PipelineSettings(tuple(hosts), LinkSettings(token), layers=(15, 15))
        engine = build_pipeline_engine(smollm2_int4, EngineArgs(kv_cache_memory="16MiB", max_num_seqs=8), settings,
                                       lines.append, with_tokenizer=False)
        try:
            got = generate(engine, prompts[:8], SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
            stats = engine.executor.pipeline.worker_stats()
        finally:
            engine.close()
    finally:
        workers.stop()
    assert got == [r[:TOKENS] for r in reference[:8]]
    assert stats[0].decode_tokens > 0  # the tokens went around the ring, stage 0 -> stage 1
