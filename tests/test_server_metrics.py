"""/metrics' exposition, without a model: vLLM's names as aliases of ours (same values, never counted
twice, labelled with the model's name), and the per-stage gauge present only for a pipeline."""
from __future__ import annotations

from flotilla.server.engine_client import EngineStats, StageState
from flotilla.server.metrics import ServerMetrics
from test_server_limits import parse_exposition

M = (("model_name", "tiny-model"),)


def _scrape(metrics: ServerMetrics, stats: EngineStats) -> dict:
    metrics.update_engine(stats, in_flight=3)
    return parse_exposition(metrics.render())


def test_vllm_names_carry_our_values_once():
    m = ServerMetrics()
    m.name_model("tiny-model")
    m.prompt_tokens.inc(7)
    m.generation_tokens.inc(5)
    m.ttft.observe(0.03)
    m.ttft.observe(2.0)
    m.e2e.observe(4.0)
    m.itl.observe(0.02)
    got = _scrape(m, EngineStats(num_running=2, num_waiting=1, kv_blocks_total=10, kv_blocks_free=4))
    pairs = {"vllm:num_requests_running": "flotilla_running_sequences",
             "vllm:num_requests_waiting": "flotilla_queue_depth",
             "vllm:kv_cache_usage_perc": "flotilla_kv_cache_usage_ratio",
             "vllm:gpu_cache_usage_perc": "flotilla_kv_cache_usage_ratio",
             "vllm:prompt_tokens_total": "flotilla_prompt_tokens_total",
             "vllm:generation_tokens_total": "flotilla_generation_tokens_total"}
    for theirs, ours in pairs.items():
        assert got[(theirs, M)] == got[(ours, ())], theirs
    assert got[("vllm:num_requests_running", M)] == 2 and got[("vllm:kv_cache_usage_perc", M)] == 0.6
    assert got[("vllm:prompt_tokens_total", M)] == 7 and got[("vllm:generation_tokens_total", M)] == 5
    for theirs, ours in (("vllm:time_to_first_token_seconds", "flotilla_time_to_first_token_seconds"),
                         ("vllm:e2e_request_latency_seconds", "flotilla_request_duration_seconds"),
                         ("vllm:inter_token_latency_seconds", "flotilla_inter_token_latency_seconds"),
                         ("vllm:time_per_output_token_seconds", "flotilla_inter_token_latency_seconds")):
        ours_samples = {(n.replace(ours, theirs), labels + M): v
                        for (n, labels), v in got.items() if n.startswith(ours + "_")}
        theirs_samples = {k: v for k, v in got.items() if k[0].startswith(theirs + "_")}
        assert theirs_samples == ours_samples and theirs_samples
    assert got[("vllm:time_to_first_token_seconds_count", M)] == 2
    assert got[('vllm:time_to_first_token_seconds_bucket', (("le", "0.05"),) + M)] == 1
    text = m.render()
    assert "# TYPE vllm:prompt_tokens_total counter" in text and "# TYPE vllm:kv_cache_usage_perc gauge" in text
    assert "# TYPE vllm:e2e_request_latency_seconds histogram" in text
    m.generation_tokens.inc(1)  # one counter behind both names
    assert _scrape(m, EngineStats(0, 0, 10, 10))[("vllm:generation_tokens_total", M)] == 6


def test_vllm_request_counts_preemptions_and_prefix_cache():
    m = ServerMetrics()
    m.name_model("tiny-model")
    got = _scrape(m, EngineStats(0, 0, 10, 10))
    for reason in ("stop", "length", "abort"):  # a series for each reason from the start, as vLLM's
        assert got[("vllm:request_success_total", (("finished_reason", reason),) + M)] == 0
    m.finished.inc(1, "stop")
    m.request_prompt.observe(30)
    m.request_generation.observe(7)
    got = _scrape(m, EngineStats(0, 0, 10, 10, preemptions=2, prefix_cache_queries=100, prefix_cache_hits=64))
    assert got[("vllm:request_success_total", (("finished_reason", "stop"),) + M)] == 1
    assert got[("flotilla_request_success_total", (("finished_reason", "stop"),))] == 1
    assert got[("vllm:request_prompt_tokens_bucket", (("le", "20"),) + M)] == 0
    assert got[("vllm:request_prompt_tokens_bucket", (("le", "50"),) + M)] == 1
    assert got[("vllm:request_generation_tokens_sum", M)] == 7
    assert got[("vllm:num_preemptions_total", M)] == got[("flotilla_preemptions_total", ())] == 2
    assert got[("vllm:prefix_cache_queries_total", M)] == 100 and got[("vllm:prefix_cache_hits_total", M)] == 64
    assert "# TYPE vllm:request_success_total counter" in m.render()
    for phase in ("queue", "prefill", "decode", "inference"):
        assert f"# TYPE vllm:request_{phase}_time_seconds histogram" in m.render()


def test_a_stage_gauge_per_pipeline_stage_only_for_a_pipeline():
    m = ServerMetrics()
    m.name_model("tiny-model")
    assert not any(n.startswith("flotilla_pipeline_stage_up") for n, _ in _scrape(m, EngineStats(0, 0, 10, 10)))
    assert "flotilla_pipeline_stage_up" not in m.render()
    stages = (StageState(0, "10.0.0.1:7070", "cuda:0", True), StageState(1, "10.0.0.2:7070", "cpu", False))
    got = _scrape(m, EngineStats(0, 0, 10, 10, stages=stages))
    up = {labels: v for (n, labels), v in got.items() if n == "flotilla_pipeline_stage_up"}
    assert up == {(("stage", "0"), ("host", "10.0.0.1:7070"), ("device", "cuda:0")): 1,
                  (("stage", "1"), ("host", "10.0.0.2:7070"), ("device", "cpu")): 0}
    # a stage's labels that are gone (another worker's address) leave with it
    got = _scrape(m, EngineStats(0, 0, 10, 10, stages=stages[:1]))
    assert [k for k in got if k[0] == "flotilla_pipeline_stage_up"] == [
        ("flotilla_pipeline_stage_up", (("stage", "0"), ("host", "10.0.0.1:7070"), ("device", "cuda:0")))]
