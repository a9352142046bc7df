"""Prometheus metrics in the text exposition format (version 0.0.4), written here, no dependency.

Counters and histograms are updated by the request handlers; the engine's gauges (queue depth,
running sequences, KV usage, and each pipeline stage's state) are read from `EngineStats` when
/metrics is scraped.

Dashboards built for vLLM read its names (`vllm:num_requests_running`, ...; labelled with
`model_name`): `Alias` renders some of ours under them as well, from the same values, so nothing
is counted twice.
"""
from __future__ import annotations

import bisect
import math

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# seconds; TTFT on a CPU reaches seconds under load, inter-token latency is milliseconds
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# a whole request: minutes on a CPU (a long reply at a few tokens a second)
E2E_BUCKETS = TTFT_BUCKETS + (120.0, 300.0, 600.0, 1200.0, 1800.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# tokens of one request's prompt or reply: 1, 2, 5, 10, 20, 50, ... 500 000 (vLLM's 1-2-5 series)
TOKEN_BUCKETS = tuple(float(m * 10 ** e) for e in range(6) for m in (1, 2, 5))
FINISH_REASONS = ("stop", "length", "abort")  # shown at 0 before the first, so that rate() has a series


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v)) if abs(v) < 2**53 else repr(float(v))


class Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labelnames: tuple[str, ...] = ()):
        self.name = name
        self.help = help_text
        self.labelnames = labelnames

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        return self.header() + self.samples(self.name)

    def samples(self, name: str, extra: str = "") -> list[str]:
        """The sample lines under `name`, each with the label pair `extra` (e.g. 'model_name="m"') too."""
        raise NotImplementedError


class Counter(Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str, labelnames: tuple[str, ...] = ()):
        super().__init__(name, help_text, labelnames)
        self.values: dict[tuple[str, ...], float] = {} if labelnames else {(): 0.0}

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def get(self, *labels: str) -> float:
        return self.values.get(labels, 0.0)

    def set_total(self, value: float, *labels: str) -> None:
        """Mirror a running total kept elsewhere (the engine's counters)."""
        self.values[labels] = value

    def samples(self, name: str, extra: str = "") -> list[str]:
        return [f"{name}{_labels(self.labelnames, k, extra)} {_num(v)}" for k, v in sorted(self.values.items())]


class Gauge(Metric):
    kind = "gauge"

    def __init__(self, name: str, help_text: str, labelnames: tuple[str, ...] = ()):
        super().__init__(name, help_text, labelnames)
        self.values: dict[tuple[str, ...], float] = {} if labelnames else {(): 0.0}

    @property
    def value(self) -> float:
        return self.values.get((), 0.0)

    def set(self, value: float, *labels: str) -> None:
        self.values[labels] = value

    def clear(self) -> None:
        """Forget every labelled value (before setting the current ones: a label set may be gone)."""
        self.values = {} if self.labelnames else {(): 0.0}

    def render(self) -> list[str]:
        return super().render() if self.values else []  # a labelled gauge with nothing to say is left out

    def samples(self, name: str, extra: str = "") -> list[str]:
        return [f"{name}{_labels(self.labelnames, k, extra)} {_num(v)}" for k, v in sorted(self.values.items())]


class Histogram(Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        super().__init__(name, help_text)
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    def samples(self, name: str, extra: str = "") -> list[str]:
        lines, total = [], 0
        for bound, c in zip(self.bounds + (math.inf,), self.counts):
            total += c
            lines.append(f"{name}_bucket{_labels(('le',), (_num(bound),), extra)} {total}")
        return lines + [f"{name}_sum{_labels((), (), extra)} {_num(self.sum)}",
                        f"{name}_count{_labels((), (), extra)} {self.count}"]


class Alias(Metric):
    """Another metric's values under a peer server's name, with constant labels (vLLM's `model_name`)."""

    def __init__(self, name: str, help_text: str, of: Metric, labels: dict[str, str] | None = None):
        super().__init__(name, help_text)
        self.kind = of.kind
        self.of = of
        self.labels = labels or {}

    def samples(self, name: str, extra: str = "") -> list[str]:
        pairs = ",".join(f'{k}="{_escape(str(v))}"' for k, v in self.labels.items())
        return self.of.samples(name, ",".join(p for p in (pairs, extra) if p))


class ServerMetrics:
    def __init__(self):
        self.requests = Counter("flotilla_requests_total", "HTTP requests by endpoint and status code",
                                ("endpoint", "status"))
        self.prompt_tokens = Counter("flotilla_prompt_tokens_total", "Prompt tokens of admitted requests")
        self.generation_tokens = Counter("flotilla_generation_tokens_total", "Generated tokens")
        self.in_flight = Gauge("flotilla_in_flight_sequences", "Sequences admitted and not finished")
        self.queue_depth = Gauge("flotilla_queue_depth", "Sequences waiting in the engine for a running slot")
        self.running = Gauge("flotilla_running_sequences", "Sequences the engine is running")
        self.kv_usage = Gauge("flotilla_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1)")
        self.kv_free = Gauge("flotilla_kv_cache_free_blocks", "KV cache blocks free")
        self.kv_total = Gauge("flotilla_kv_cache_total_blocks", "KV cache blocks in the pool (a hybrid cache's: "
                              "blocks of one group of layers each)")
        self.ttft = Histogram("flotilla_time_to_first_token_seconds", "Time from arrival to the first token",
                              TTFT_BUCKETS)
        self.itl = Histogram("flotilla_inter_token_latency_seconds", "Time between consecutive tokens of a sequence",
                             ITL_BUCKETS)
        self.e2e = Histogram("flotilla_request_duration_seconds", "Time from arrival to the last token",
                             E2E_BUCKETS)
        self.finished = Counter("flotilla_request_success_total", "Sequences finished, by finish reason (stop, "
                                "length, abort); each choice of an n > 1 request counts", ("finished_reason",))
        for reason in FINISH_REASONS:
            self.finished.inc(0, reason)
        self.request_prompt = Histogram("flotilla_request_prompt_tokens", "Prompt tokens of each finished sequence",
                                        TOKEN_BUCKETS)
        self.request_generation = Histogram("flotilla_request_generation_tokens",
                                            "Generated tokens of each finished sequence", TOKEN_BUCKETS)
        self.queue_time = Histogram("flotilla_request_queue_time_seconds",
                                    "Time each sequence waited in the engine before its first admission", E2E_BUCKETS)
        self.prefill_time = Histogram("flotilla_request_prefill_time_seconds",
                                      "Time to each sequence's first token less its queue time", E2E_BUCKETS)
        self.decode_time = Histogram("flotilla_request_decode_time_seconds",
                                     "Time from each sequence's first token to its last", E2E_BUCKETS)
        self.inference_time = Histogram("flotilla_request_inference_time_seconds",
                                        "Time to each sequence's last token less its queue time", E2E_BUCKETS)
        self.preemptions = Counter("flotilla_preemptions_total",
                                   "Sequences preempted for KV blocks (their work is recomputed when they resume)")
        self.cache_queries = Counter("flotilla_prefix_cache_queries_total",
                                     "Prompt tokens looked up in the prefix cache at admissions")
        self.cache_hits = Counter("flotilla_prefix_cache_hits_total",
                                  "Of those, tokens found there (not computed again)")
        self.spec_draft = Counter("flotilla_spec_draft_tokens_total",
                                  "Speculative decoding: draft tokens verified by the target")
        self.spec_accepted = Counter("flotilla_spec_accepted_tokens_total",
                                     "Speculative decoding: draft tokens accepted")
        self.spec_steps = Counter("flotilla_spec_verify_steps_total",
                                  "Speculative decoding: sequence-steps that verified drafts")
        self.spec_rate = Gauge("flotilla_spec_acceptance_rate",
                               "Speculative decoding: accepted / verified draft tokens since the start (0..1)")
        self.spec_per_step = Gauge("flotilla_spec_accepted_tokens_per_step",
                                   "Speculative decoding: draft tokens accepted per verifying sequence-step "
                                   "(each also yields one token of the target's own)")
        self.stage_up = Gauge("flotilla_pipeline_stage_up",
                              "Pipeline stages (serve --pp): 1 while the stage's worker is connected and serving, "
                              "0 while it is down", ("stage", "host", "device"))
        self.vllm: list[Alias] = []

    def name_model(self, model_name: str) -> None:
        """Offer vLLM's names for our metrics, labelled with the served model's name as vLLM's are."""
        m = {"model_name": model_name}
        self.vllm = [
            Alias("vllm:num_requests_running", "Number of requests in model execution batches "
                  "(flotilla_running_sequences)", self.running, m),
            Alias("vllm:num_requests_waiting", "Number of requests waiting to be processed (flotilla_queue_depth)",
                  self.queue_depth, m),
            Alias("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent (flotilla_kv_cache_usage_ratio)",
                  self.kv_usage, m),
            Alias("vllm:gpu_cache_usage_perc", "KV-cache usage, 1 means 100 percent (vLLM's older name of "
                  "vllm:kv_cache_usage_perc; on any device)", self.kv_usage, m),
            Alias("vllm:prompt_tokens_total", "Number of prefill tokens processed (flotilla_prompt_tokens_total)",
                  self.prompt_tokens, m),
            Alias("vllm:generation_tokens_total", "Number of generation tokens processed "
                  "(flotilla_generation_tokens_total)", self.generation_tokens, m),
            Alias("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds "
                  "(flotilla_time_to_first_token_seconds)", self.ttft, m),
            Alias("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds "
                  "(flotilla_request_duration_seconds)", self.e2e, m),
            Alias("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds "
                  "(flotilla_inter_token_latency_seconds)", self.itl, m),
            Alias("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds (vLLM's older "
                  "name of vllm:inter_token_latency_seconds)", self.itl, m),
            Alias("vllm:request_success_total", "Count of successfully processed requests "
                  "(flotilla_request_success_total)", self.finished, m),
            Alias("vllm:request_prompt_tokens", "Number of prefill tokens processed "
                  "(flotilla_request_prompt_tokens)", self.request_prompt, m),
            Alias("vllm:request_generation_tokens", "Number of generation tokens processed "
                  "(flotilla_request_generation_tokens)", self.request_generation, m),
            Alias("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request "
                  "(flotilla_request_queue_time_seconds)", self.queue_time, m),
            Alias("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request "
                  "(flotilla_request_prefill_time_seconds)", self.prefill_time, m),
            Alias("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request "
                  "(flotilla_request_decode_time_seconds)", self.decode_time, m),
            Alias("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request "
                  "(flotilla_request_inference_time_seconds)", self.inference_time, m),
            Alias("vllm:num_preemptions_total", "Cumulative number of preemption from the engine "
                  "(flotilla_preemptions_total)", self.preemptions, m),
            Alias("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens "
                  "(flotilla_prefix_cache_queries_total)", self.cache_queries, m),
            Alias("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens "
                  "(flotilla_prefix_cache_hits_total)", self.cache_hits, m),
        ]

    def all(self) -> list[Metric]:
        """Every metric of ours, in the order they were made, then vLLM's names."""
        return [m for m in vars(self).values() if isinstance(m, Metric)] + self.vllm

    def update_engine(self, stats, in_flight: int) -> None:
        self.queue_depth.set(stats.num_waiting)
        self.running.set(stats.num_running)
        self.kv_usage.set(round(stats.kv_usage, 6))
        self.kv_free.set(stats.kv_blocks_free)
        self.kv_total.set(stats.kv_blocks_total)
        self.in_flight.set(in_flight)
        self.preemptions.set_total(stats.preemptions)
        self.cache_queries.set_total(stats.prefix_cache_queries)
        self.cache_hits.set_total(stats.prefix_cache_hits)
        self.spec_draft.set_total(stats.spec_draft_tokens)
        self.spec_accepted.set_total(stats.spec_accepted_tokens)
        self.spec_steps.set_total(stats.spec_verify_steps)
        self.spec_rate.set(round(stats.spec_acceptance_rate, 6))
        self.spec_per_step.set(round(stats.spec_accepted_tokens_per_step, 6))
        self.stage_up.clear()
        for st in stats.stages:
            self.stage_up.set(1 if st.up else 0, str(st.index), st.host, st.device)

    def render(self) -> str:
        return "\n".join(line for m in self.all() for line in m.render()) + "\n"
