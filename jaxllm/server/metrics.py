"""Prometheus metrics with vLLM's names under the `jaxllm:` prefix, in a registry owned by one app.

Three sources feed it:
- the engine's start-up figures (`startup_info`): `cache_config_info`, vLLM's info gauge of the KV cache
  (value 1; labels: block size, the pages' dtype, the blocks on the device and the host);
- the engine's latest `EngineStats` snapshot (immutable, published by the engine thread after each step),
  read at scrape time by `_EngineStatsCollector`: gauges for running, waiting and KV usage; counters for
  the engine's cumulative token/prefix/preemption/step counts; the tokens-per-step histogram;
- the handlers, through one `RequestTracker` per engine request (TTFT, inter-token latency, end-to-end
  latency, queue time, request_success by finished_reason), whatever the request's output kind.
`StatsLogger.tick()` (called every few seconds by the app) turns counter deltas into the average
throughput gauges and logs a vLLM-style line.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import RequestOutputKind
from jaxllm.stats import ITERATION_TOKEN_BUCKETS, STEP_HOST_PHASES

logger = logging.getLogger("jaxllm.server")

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)


class _EngineStatsCollector:
    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        s = self.engine.get_stats()
        labels = ["model_name"]
        value = [self.model_name]

        def gauge(name, doc, v):
            g = GaugeMetricFamily(f"jaxllm:{name}", doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name, doc, v):
            c = CounterMetricFamily(f"jaxllm:{name}", doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge(
            "num_requests_running", "Number of requests in model execution batches.", s.num_requests_running
        )
        yield gauge(
            "num_requests_waiting", "Number of requests waiting to be processed.", s.num_requests_waiting
        )
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage)
        yield gauge(
            "gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage
        )
        yield gauge(
            "num_compiling_in_background",
            "Sampler variants (penalties, logprobs) still compiling after the server became ready; steps "
            "run alongside them, slower on a first start with an empty compilation cache.",
            s.num_compiling_in_background,
        )
        yield counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries
        )
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("num_preemptions", "Cumulative number of preemptions.", s.num_preemptions)
        yield counter("prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield counter("generation_tokens", "Number of generation tokens processed.", s.generation_tokens)
        yield counter("engine_steps", "Device steps the engine has run.", s.num_steps)
        yield counter(
            "step_device_wait_seconds",
            "Seconds the engine's step thread waited on the device's results. Over a stretch of wall time, "
            "a high share means the device is the bottleneck; a low one with steps running, the host.",
            s.step_device_wait_s,
        )
        host = CounterMetricFamily(
            "jaxllm:step_host_seconds",
            "Seconds of the engine's step thread spent on host work, by phase: schedule (building the "
            "batch), dispatch (building the step's inputs and enqueueing the model and sampler), process "
            "(reading the tokens back and making request outputs). Per step, against the device's step "
            "time, they say which host phase holds a host-bound engine back.",
            labels=["model_name", "phase"],
        )
        for phase in STEP_HOST_PHASES:
            host.add_metric([self.model_name, phase], s.step_host_s.get(phase, 0.0))
        yield host
        yield _iteration_histogram(s.iteration_tokens_buckets, s.iteration_tokens_sum, self.model_name)
        yield _cache_config_info(getattr(self.engine, "startup_info", {}), self.model_name)


# cache_config_info's labels (vLLM's names) and the startup_info entries they come from.
_CACHE_INFO_LABELS = {
    "block_size": "block_size",
    "cache_dtype": "kv_cache_dtype",
    "num_gpu_blocks": "num_gpu_blocks",
    "num_cpu_blocks": "num_cpu_blocks",
}


def _cache_config_info(info: dict, model_name: str) -> GaugeMetricFamily:
    """vLLM's `cache_config_info`: the KV cache's configuration as labels of a gauge of value 1.
    cache_dtype is the pages' element type as allocated (float8_e4m3fn for --kv-cache-dtype fp8)."""
    g = GaugeMetricFamily(
        "jaxllm:cache_config_info",
        "Information of the KV cache configuration (labels); the value is always 1.",
        labels=["model_name", *_CACHE_INFO_LABELS],
    )
    g.add_metric([model_name, *(str(info.get(key, "")) for key in _CACHE_INFO_LABELS.values())], 1.0)
    return g


def _iteration_histogram(counts: tuple[int, ...], total: int, model_name: str) -> HistogramMetricFamily:
    """The engine's tokens-per-step counts (one per bucket, +Inf last) as Prometheus' cumulative buckets."""
    h = HistogramMetricFamily(
        "jaxllm:iteration_tokens_total", "Number of tokens per engine step.", labels=["model_name"]
    )
    counts = counts or (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1)
    buckets, running = [], 0
    for bound, c in zip((*map(str, map(float, ITERATION_TOKEN_BUCKETS)), "+Inf"), counts, strict=True):
        running += c
        buckets.append((bound, running))
    h.add_metric([model_name], buckets, sum_value=total)
    return h


class ServerMetrics:
    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineStatsCollector(engine, model_name))
        r, labels = self.registry, ["model_name"]
        self.ttft = Histogram(
            "jaxllm:time_to_first_token_seconds",
            "Time to first token in seconds.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.itl = Histogram(
            "jaxllm:inter_token_latency_seconds",
            "Inter-token latency in seconds.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            "jaxllm:e2e_request_latency_seconds",
            "End-to-end request latency in seconds.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.queue_time = Histogram(
            "jaxllm:request_queue_time_seconds",
            "Time spent waiting in the queue in seconds.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model_name)
        self._success = Counter(
            "jaxllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.prompt_throughput = Gauge(
            "jaxllm:avg_prompt_throughput_toks_per_s",
            "Average prefill throughput in tokens/s.",
            labels,
            registry=r,
        ).labels(model_name)
        self.generation_throughput = Gauge(
            "jaxllm:avg_generation_throughput_toks_per_s",
            "Average generation throughput in tokens/s.",
            labels,
            registry=r,
        ).labels(model_name)

    def request_finished(self, finish_reason: str) -> None:
        self._success.labels(self.model_name, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self, kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> RequestTracker:
        return RequestTracker(self, kind)


class RequestTracker:
    """Observes one engine request's outputs as they arrive. Streams (CUMULATIVE or DELTA outputs) are timed
    as their tokens reach the server; a FINAL_ONLY request has one output, so its first-token and
    inter-token times come from the engine's timestamps in that output's metrics."""

    def __init__(self, metrics: ServerMetrics, kind: RequestOutputKind = RequestOutputKind.CUMULATIVE):
        self.m = metrics
        self.kind = kind
        self.arrival = time.monotonic()
        self.last_token_time: float | None = None
        self.num_tokens = 0
        self._delta_tokens: dict[int, int] = {}  # DELTA: tokens so far per choice

    def _tokens_so_far(self, ro: RequestOutput) -> int:
        """The most tokens any choice has so far."""
        if self.kind is not RequestOutputKind.DELTA:
            return max((len(o.token_ids) for o in ro.outputs), default=0)
        counts = self._delta_tokens
        for o in ro.outputs:
            if o.token_ids:
                counts[o.index] = counts.get(o.index, 0) + len(o.token_ids)
        return max(counts.values(), default=0)

    def on_output(self, ro: RequestOutput) -> None:
        now = time.monotonic()
        n = self._tokens_so_far(ro)
        if self.kind is RequestOutputKind.FINAL_ONLY:
            if ro.finished:
                self._observe_from_engine_times(ro, n)
        elif n > self.num_tokens:
            if self.last_token_time is None:
                self.m.ttft.observe(now - self.arrival)
                self._observe_queue_time(ro)
            else:
                # One observation per new token, spread evenly over the gap since the last output.
                gap = (now - self.last_token_time) / (n - self.num_tokens)
                for _ in range(n - self.num_tokens):
                    self.m.itl.observe(gap)
            self.last_token_time = now
            self.num_tokens = n
        if self.kind is RequestOutputKind.DELTA:  # each choice's finish reason comes once, when it ends
            for o in ro.outputs:
                if o.finish_reason is not None:
                    self.m.request_finished(o.finish_reason)
        elif ro.finished:  # the last output lists every choice
            for o in ro.outputs:
                self.m.request_finished(o.finish_reason or "stop")
        if ro.finished:
            self.m.e2e.observe(now - self.arrival)

    def _observe_queue_time(self, ro: RequestOutput) -> None:
        mt = ro.metrics
        if mt is not None and mt.first_scheduled_time is not None:
            self.m.queue_time.observe(max(0.0, mt.first_scheduled_time - mt.arrival_time))

    def _observe_from_engine_times(self, ro: RequestOutput, n: int) -> None:
        """TTFT from the engine's arrival to its first token; the time from the first token to the last
        spread evenly over the n - 1 tokens after the first (all on the engine's clock)."""
        mt = ro.metrics
        if not n or mt is None or mt.first_token_time is None:
            return
        self.m.ttft.observe(max(0.0, mt.first_token_time - mt.arrival_time))
        self._observe_queue_time(ro)
        if n > 1 and mt.last_token_time is not None:
            gap = max(0.0, mt.last_token_time - mt.first_token_time) / (n - 1)
            for _ in range(n - 1):
                self.m.itl.observe(gap)


class StatsLogger:
    """Turns the engine's cumulative counters into throughput gauges and a periodic log line."""

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics
        self._last_time = time.monotonic()
        s = metrics.engine.get_stats()
        self._last_prompt, self._last_gen = s.prompt_tokens, s.generation_tokens
        self.idle = True  # nothing ran during the last tick (the app then skips the log line, as vLLM)

    def tick(self) -> str:
        now = time.monotonic()
        s = self.m.engine.get_stats()
        dt = max(now - self._last_time, 1e-6)
        prompt_tps = (s.prompt_tokens - self._last_prompt) / dt
        gen_tps = (s.generation_tokens - self._last_gen) / dt
        self._last_time, self._last_prompt, self._last_gen = now, s.prompt_tokens, s.generation_tokens
        self.m.prompt_throughput.set(prompt_tps)
        self.m.generation_throughput.set(gen_tps)
        self.idle = (
            prompt_tps == 0 and gen_tps == 0 and s.num_requests_running == 0 and s.num_requests_waiting == 0
        )
        hit = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        return (
            f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, Avg generation throughput: {gen_tps:.1f} tokens/s, "
            f"Running: {s.num_requests_running} reqs, Waiting: {s.num_requests_waiting} reqs, "
            f"KV cache usage: {100 * s.kv_cache_usage:.1f}%, Prefix cache hit rate: {100 * hit:.1f}%"
        )
