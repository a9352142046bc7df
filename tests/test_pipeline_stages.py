"""What a GPU pipeline stage does, checked on the CPU: decode graphs per stage (the static-buffer
path a CUDA graph replays, run eagerly here) for a first and a last stage, prefill chunks
included; the placement of local workers (`--devices`, threads of a mixed ring); stages that
share one device's memory; the random-weight checkpoint the GPU proof loads."""
from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch
from conftest import needs_gpu

from flotilla.errors import FlotillaError
from flotilla.models.llama import Stage
from flotilla.runtime.cuda_graphs import DecodeGraphRunner
from flotilla.runtime.engine import EngineConfig, LLMEngine
from flotilla.runtime.engine_args import generate
from flotilla.runtime.kv_cache import KVCache, KVCacheSpec
from flotilla.runtime.loader import load_model
from flotilla.runtime.model_runner import ModelRunner
from flotilla.runtime.pipeline.activations import HostStaging
from flotilla.runtime.pipeline.cli import check_devices, parse_devices, pipeline_engine_from_args
from flotilla.runtime.pipeline.local import LocalWorkers, local_devices, worker_threads
from flotilla.runtime.pipeline.partition import StageBudget, sharing, split_layers
from flotilla.runtime.pipeline.probe import memory_id
from flotilla.runtime.random_model import write_random_checkpoint
from flotilla.runtime.sampling import SamplingParams
from flotilla.runtime.scheduler import SchedulerConfig

BLOCK, BLOCKS, BUDGET = 4, 48, 8  # tokens a block, blocks in the pool, tokens a step
PROMPTS = [[5, 17, 42, 99, 3, 8, 1, 2, 9, 11, 13], [7] * 6, [300, 1], [33]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_random_checkpoint("tiny", tmp_path_factory.mktemp("random") / "tiny4", num_layers=4, seed=1)


def engine_over(executor, vocab: int) -> LLMEngine:
    config = EngineConfig(num_blocks=BLOCKS, block_size=BLOCK, max_model_len=64,
                          scheduler=SchedulerConfig(4, BUDGET), enable_prefix_caching=False)
    return LLMEngine(executor, config, None, (), vocab)


def stage_runner(path, stage: Stage | None, graphs: bool, device: str = "cpu") -> ModelRunner:
    lm = load_model(path, device, None, stage, with_tokenizer=False, progress=False)
    spec = KVCacheSpec(tuple(lm.model.stage.layers), lm.model.num_kv_heads, lm.config.head_dim, lm.dtype, BLOCK)
    runner = ModelRunner(lm.model, KVCache(spec, BLOCKS, lm.device))
    if graphs:  # what a GPU stage captures (runtime/pipeline/stage_runtime.py); on a CPU run eagerly
        runner.graphs = DecodeGraphRunner(lm.model, runner.cache, (1, 2, 4, 8), 64, runner.scale,
                                          capture=lm.device.type == "cuda", max_query_len=BUDGET,
                                          sampled=runner.sampled)
    return runner


class TwoStages:
    """A first and a last stage in this process, every step through their decode graphs; counts
    the replays."""

    def __init__(self, first: ModelRunner, last: ModelRunner):
        self.first, self.last, self.steps, self.replays = first, last, 0, 0

    def execute(self, step):
        self.steps += 1
        self.replays += self.first._replays(step) and self.last._replays(step)
        hidden = self.first.execute(step)  # [T, hidden]
        assert hidden.shape == (step.num_tokens, self.first.model.config.hidden_size)
        return self.last.execute(step, hidden.clone())  # a copy, as the hop makes one


@torch.inference_mode()
def test_stage_graphs_serve_decodes_and_chunks_with_the_tokens_of_the_eager_whole_model(tiny):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    whole = stage_runner(tiny, None, graphs=False)
    want = generate(engine_over(whole, 512), PROMPTS, params)
    stages = TwoStages(stage_runner(tiny, Stage(0, 2, 4), True), stage_runner(tiny, Stage(2, 4, 4), True))
    got = generate(engine_over(stages, 512), PROMPTS, params)
    assert got == want
    # every step replayed on both stages: prefill chunks (up to 8 tokens of one sequence, some not
    # sampling), chunks beside decodes, and decodes with padding rows
    assert stages.replays == stages.steps > 10
    assert not stages.first.graphs.can_run([1] * 9, [9], [[1, 2, 3]])  # longer chunks run eagerly


class PreparedStages(TwoStages):
    """As a worker runs them: the first stage's inputs written ahead with the token ids unknown
    (zeros), then only the ids (`stage`, `execute(staged=True)`); the hidden states reach the
    last stage in pinned host memory, as the hop's HostStaging hands them."""

    def __init__(self, first: ModelRunner, last: ModelRunner):
        super().__init__(first, last)
        self.staging, self.staged = HostStaging(last.device), 0

    def execute(self, step):
        self.steps += 1
        staged = self.first.stage(dataclasses.replace(step, token_ids=[0] * step.num_tokens))
        self.staged += staged
        hidden = self.first.execute(step, staged=staged) if staged else self.first.execute(step)
        data = hidden.to(torch.float16).cpu()  # the wire's form
        (pinned,) = self.staging.to_pinned(data) if self.last.device.type == "cuda" else (data,)
        out = self.last.execute(step, pinned if self.last.device.type == "cuda" else data.to(hidden.dtype))
        self.staging.release()
        return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=needs_gpu)])
@torch.inference_mode()
def test_a_first_stage_step_prepared_before_its_tokens_gives_the_plain_tokens(tiny, device):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    plain = TwoStages(stage_runner(tiny, Stage(0, 2, 4), True, device), stage_runner(tiny, Stage(2, 4, 4), True, device))
    want = generate(engine_over(plain, 512), PROMPTS, params)
    stages = PreparedStages(stage_runner(tiny, Stage(0, 2, 4), True, device),
                            stage_runner(tiny, Stage(2, 4, 4), True, device))
    assert generate(engine_over(stages, 512), PROMPTS, params) == want
    assert stages.staged == stages.steps > 10  # every step went through the staged replay
    # a step run in between overwrites the staged inputs: the staged replay refuses
    graphs = stages.first.graphs
    graphs.stage([0], [3], [[1]])
    graphs.run([5], [3], [[1]])
    with pytest.raises(ValueError, match="no step of 1 tokens is staged"):
        graphs.run_staged([5])


def test_a_stage_graph_needs_its_hidden_states(tiny):
    runner = stage_runner(tiny, Stage(2, 4, 4), True)
    with pytest.raises(ValueError, match="hidden states"):
        runner.graphs.run([1, 2], [0, 0], [[1], [2]])


def test_host_staging_on_a_cpu_stage_hands_the_tensors_through():
    staging = HostStaging(torch.device("cpu"))
    t = torch.arange(6.0).view(2, 3)
    (moved,) = staging.to_device(t)
    assert moved is t and staging.to_device(None) == (None,)
    assert staging.to_pinned(t, None)[0] is t
    data, scales = staging.to_host(t, None)
    assert data is t and scales is None
    staging.release()


def test_random_checkpoint_is_seeded_and_loads_as_a_checkpoint(tiny, tmp_path):
    again = write_random_checkpoint("tiny", tmp_path / "again", num_layers=4, seed=1)
    other = write_random_checkpoint("tiny", tmp_path / "other", num_layers=4, seed=2)
    manifest = lambda p: [s["sha256"] for s in json.loads((p / "flotilla.json").read_text())["shards"]]  # noqa: E731
    assert manifest(again) == manifest(tiny) != manifest(other)
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 4 and cfg["quantization_config"]["bits"] == 4
    lm = load_model(tiny, "cpu", None, with_tokenizer=False, progress=False)
    logits = lm.model.compute_logits(lm.model.embed(torch.tensor([1, 2])))
    assert torch.isfinite(logits).all() and logits.std() > 0.1


@needs_gpu
@pytest.mark.parametrize("device", ["cuda", None, torch.device("cuda")])
def test_a_model_loads_on_a_bare_cuda_device(tiny, device):
    """`--device cuda` (and the default on a GPU host): the loader sets the thread's current device, which
    torch.cuda.set_device accepts only with an index (a bare `cuda` failed there, bench/NOTES-kernels.md round 10)."""
    lm = load_model(tiny, device, None, with_tokenizer=False, progress=False)
    assert lm.device == torch.device("cuda", torch.cuda.current_device())
    logits = lm.model.compute_logits(lm.model.embed(torch.tensor([1, 2], device=lm.device)))
    assert torch.isfinite(logits).all()


def test_a_bare_cuda_device_is_given_the_current_gpus_index(monkeypatch):
    from flotilla.runtime.loader import parse_device, with_index

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert parse_device("cuda") == parse_device(None) == parse_device("auto") == torch.device("cuda", 3)
    assert parse_device("cuda:1") == torch.device("cuda", 1)
    assert with_index(torch.device("cuda")) == torch.device("cuda", 3)
    assert with_index(torch.device("cpu")) == torch.device("cpu") == parse_device("cpu")
    assert parse_devices("cuda,cuda:1", 2) == ["cuda:3", "cuda:1"]


# ------------------------------------------------------------------------------ placement

def test_devices_give_the_stages_and_their_count():
    assert parse_devices("cpu,cpu,cpu", 1) == ["cpu"] * 3  # --pp taken from the list
    assert parse_devices(" cpu , cpu ", 2) == ["cpu", "cpu"]
    with pytest.raises(FlotillaError, match="names 2 devices, but --pp is 3"):
        parse_devices("cpu,cpu", 3)
    with pytest.raises(FlotillaError, match="unknown device 'tpu:0'"):
        parse_devices("cpu,tpu:0", 2)
    with pytest.raises(FlotillaError, match="expected devices separated by commas"):
        parse_devices("cpu,,cpu", 3)
    check_devices(["cpu", "cpu"], 3, "--devices")  # CPU stages: any --tp
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(FlotillaError, match=f"cuda:{count}..cuda:{count + 1} .--tp 2. asked for; this host has"):
        check_devices([f"cuda:{count}"], 2, "--devices")


def test_cpu_workers_split_the_cores_left_by_the_gpu_workers():
    assert worker_threads(["cpu", "cpu"], 2) == [1, 1]
    assert worker_threads(["cpu", "cpu", "cpu"], 16) == [5, 5, 5]
    assert worker_threads(["cuda:0", "cpu", "cuda:0"], 16) == [1, 14, 1]  # one core drives each GPU stage
    assert worker_threads(["cuda:0", "cuda:1"], 16) == [None, None]  # torch's default
    assert worker_threads(["cuda:0", "cpu"], 1) == [1, 1]
    workers = LocalWorkers(3, "model", b"t" * 16, ["cuda:0", "cuda:0", "cpu"], tp=2)
    assert workers.describe() == "cuda:0, cuda:0, cpu, each a group of tp 2"
    if not torch.cuda.is_available():
        assert local_devices(2, tp=2) == ["cpu", "cpu"]


def serve_args(*argv: str) -> argparse.Namespace:
    from flotilla.runtime.cli import COMMANDS, build_parser
    from flotilla.server.cli import SERVE

    return build_parser(COMMANDS + [SERVE]).parse_args(["serve", *argv])


@pytest.mark.parametrize("argv, message", [
    (["--devices", "cpu,cpu", "--hosts", "a,b"], "with --hosts each `runtime worker` picks its own --device"),
    (["--pp", "2", "--hosts", "a,b", "--tp", "2"], "as tensor-parallel as its own `runtime worker --tp M`"),
    (["--pp", "3", "--devices", "cpu,cpu"], "names 2 devices, but --pp is 3"),
    (["--pp", "2", "--tp", "0"], "at least 1"),
])
def test_bad_placements_are_one_line_errors_before_anything_starts(argv, message, monkeypatch):
    def no_model(path):  # resolving the default model may download it: placements are checked first
        raise AssertionError("the model was resolved before the placement was checked")

    monkeypatch.setattr("flotilla.runtime.default_model.resolve_model_path", no_model)
    with pytest.raises(FlotillaError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pipeline_engine_from_args(serve_args(*argv), report=lambda line: None)


# --------------------------------------------------------------------------- shared memory

def test_stages_that_share_a_device_split_its_memory():
    assert sharing(["gpu-a", "gpu-a", "host/cpu"]) == [2, 2, 1]
    a = memory_id(torch.device("cpu"))
    assert a == memory_id(torch.device("cpu")) and a.endswith("/cpu")
    gib = 2**30
    # two stages on a 20 GiB GPU: each would take 16 layers of 1 GiB on its own, 8 when they share it
    budgets = lambda free: [StageBudget(f"w{i}", free, gib, 0, 1.0, 0.0) for i in range(2)]  # noqa: E731
    assert split_layers(24, budgets(20 * gib)) == [12, 12]
    with pytest.raises(FlotillaError, match="do not fit"):
        split_layers(24, budgets(20 * gib // 2))


def test_probe_reports_whose_memory_and_the_stage_tp(tiny):
    from flotilla.runtime.pipeline.messages import Probe
    from flotilla.runtime.pipeline.probe import worker_info

    config = (tiny / "config.json").read_text()
    info = worker_info(Probe(config, True, "auto"), torch.device("cpu"), "v", tp=2)
    assert info.memory_id == memory_id(torch.device("cpu")) and info.tp == 2
    assert info.layer_ms > 0 and info.head_ms > 0 and info.layer_bytes > 0 and info.free_memory > 0
    quick = worker_info(Probe(config, False, "auto"), torch.device("cpu"), "v")
    assert quick.layer_ms == 0 and quick.layer_bytes == info.layer_bytes and quick.tp == 1


def test_a_cpu_stage_sizes_its_kv_pool_as_a_single_process_run(tiny):
    """By default a CPU stage holds room for the CPU default's tokens (a context, or a few
    sequences' worth), as `runtime serve` without --pp does, not a fraction of the host's RAM;
    --kv-cache-memory and a rejoining stage's exact size still rule."""
    from flotilla.runtime.kv_cache import CPU_SHARED_TOKENS
    from flotilla.runtime.pipeline.messages import LoadStage
    from flotilla.runtime.pipeline.stage_runtime import StageRuntime

    lm = load_model(tiny, "cpu", None, Stage(0, 2, 4), with_tokenizer=False, progress=False)
    runtime = StageRuntime(lm, LoadStage("f" * 64, {}, {}, 0, 2, 4, "auto", 0, 0.0, 1024, 64, 2, 16, 0), "test")

    def capacity(max_model_len, max_num_seqs, kv_memory=0, exact=0):
        req = LoadStage("f" * 64, {}, {}, 0, 2, 4, "auto", kv_memory, 0.0, max_model_len, max_num_seqs, 2, 16, exact)
        return runtime.capacity(req)

    # 64 sequences of 1024: the shared CPU_SHARED_TOKENS (8192) tokens, 512 blocks + the null block
    assert capacity(1024, 64) == CPU_SHARED_TOKENS // 16 + 1
    assert capacity(1024, 2) == 2 * 1024 // 16 + 1  # never more than max_num_seqs whole contexts
    assert capacity(32768, 4) == 32768 // 16 + 1  # one whole context when it is longer
    per_block = runtime.spec.bytes_per_block
    assert capacity(1024, 64, kv_memory=10 * per_block) == 10
    assert capacity(1024, 64, exact=7) == 7


def test_stage_0_prepares_a_held_decode_and_runs_it_as_the_plain_step(tiny):
    """StageRuntime.prepare (the mirror and inputs of a decode waiting for its ids), then run with
    the ids filled in: the same hidden states as a stage that runs it plainly; a different step
    may not run while one is prepared."""
    from flotilla.runtime.model_runner import StepInput
    from flotilla.runtime.pipeline.messages import Configure, LoadStage
    from flotilla.runtime.pipeline.stage_runtime import StageRuntime
    from flotilla.runtime.pipeline.step_codec import StepEncoder, fill_tokens

    def stage0() -> StageRuntime:
        lm = load_model(tiny, "cpu", None, Stage(0, 2, 4), with_tokenizer=False, progress=False)
        rt = StageRuntime(lm, LoadStage("f" * 64, {}, {}, 0, 2, 4, "auto", 0, 0.0, 64, 4, 2, BLOCK, 0), "test")
        rt.configure(Configure(1, BLOCKS, None, "fp16", 0, 0, 1, 64))
        return rt

    enc = StepEncoder()
    tables = [[1, 2], [3, 4]]
    prefill = enc.encode(StepInput(["a", "b"], [5, 6, 7, 8, 9], [0, 0], [3, 2], tables, 0, [False, False]), 1, 1)
    ahead = [enc.encode(StepInput(["a", "b"], [0, 0], [3 + i, 2 + i], [1, 1], tables, 2, [False, False],
                                  prev_rows=[1, 0]), 1, 2 + i, prev_mb=1 + i) for i in range(3)]
    plain, prepared = stage0(), stage0()
    for rt in (plain, prepared):
        rt.run(prefill)
    for i, step in enumerate(ahead[:2]):
        prepared.prepare(step)
        assert prepared.prepared_mb == step.mb
        filled = fill_tokens(step, [40 + i, 50 + i])
        assert torch.equal(prepared.run(filled).hidden, plain.run(filled).hidden)
        assert prepared.prepared_mb is None
    prepared.prepare(ahead[2])
    with pytest.raises(ValueError, match="came to run while step 4 was prepared"):
        prepared.run(dataclasses.replace(fill_tokens(ahead[2], [1, 2]), mb=9))
    prepared.configure(Configure(2, BLOCKS, None, "fp16", 0, 0, 1, 64))  # a new epoch forgets it
    assert prepared.prepared_mb is None

    # a prepare that fails after the mirror took the step (writing the graph's inputs): its run does
    # not apply the step (a new block for "a") to the mirror a second time
    enc = StepEncoder()
    prefill = enc.encode(StepInput(["a", "b"], [5, 6, 7, 8, 9], [0, 0], [3, 2], [[1], [3]], 0, [False, False]), 3, 1)
    grows = enc.encode(StepInput(["a", "b"], [0, 0], [4, 2], [1, 1], [[1, 2], [3]], 2, [False, False],
                                 prev_rows=[1, 0]), 3, 2, prev_mb=1)
    for rt in (plain, prepared):
        rt.configure(Configure(3, BLOCKS, None, "fp16", 0, 0, 1, 64))
        rt.run(prefill)

    def fails(step):
        raise RuntimeError("the graph's inputs could not be written")

    prepared.runner.stage = fails
    with pytest.raises(RuntimeError, match="could not be written"):
        prepared.prepare(grows)
    filled = fill_tokens(grows, [40, 50])
    assert torch.equal(prepared.run(filled).hidden, plain.run(filled).hidden)
    assert prepared.seqs.tables == plain.seqs.tables


def test_probe_times_the_head_as_the_stage_runs_it(tiny, monkeypatch):
    """The lm_head probe goes through LMHead.logits_fn (on a CPU the compiled kernels in the weight's
    smallest exact form) over fp16 values, as a checkpoint's head is: timed in fp32 through F.linear it
    read twice the bytes, and the split left the last stage one layer."""
    from flotilla.models.config import ModelConfig
    from flotilla.models.linear import LMHead
    from flotilla.runtime.pipeline import probe

    seen = []
    real = LMHead.logits_fn

    def logits_fn(self, device):
        seen.append(torch.equal(self.weight, self.weight.half().float()))
        return real(self, device)

    monkeypatch.setattr(LMHead, "logits_fn", logits_fn)
    config = ModelConfig.from_hf_dict(json.loads((tiny / "config.json").read_text()))
    assert probe._time_head(config, torch.device("cpu"), torch.float32) > 0
    assert seen == [True]


def test_a_random_qwen3_checkpoint_holds_its_q_and_k_norms(tmp_path):
    """write_random_checkpoint of a Qwen3 shape (bench's qwen3-8b; tiny-qwen3 here) writes the q/k norms, so
    that the checkpoint loads and runs through the engine."""
    from flotilla.runtime.engine_args import EngineArgs, build_engine, generate
    from flotilla.runtime.random_model import SHAPES
    from flotilla.runtime.sampling import SamplingParams

    assert SHAPES["qwen3-8b"].qk_norm and SHAPES["qwen3-8b"].family == "qwen3"
    path = write_random_checkpoint("tiny-qwen3", tmp_path / "q3", num_layers=2, seed=1)
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3"
    lm = load_model(path, "cpu", None, with_tokenizer=False, progress=False)
    assert lm.model.config.qk_norm
    out = generate(build_engine(lm, EngineArgs(kv_cache_memory="4MiB")), [[1, 2, 3]],
                   SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0]) == 4
