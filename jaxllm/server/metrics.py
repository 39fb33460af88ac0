"""Prometheus metrics with vLLM's names under the `jaxllm:` prefix, in a registry owned by one app.

Two sources feed it:
- the engine's `EngineStats` snapshot, read at scrape time by `_EngineStatsCollector` (gauges for running,
  waiting and KV usage; counters for the engine's cumulative token/prefix/preemption counts);
- the handlers, through one `RequestTracker` per engine request (TTFT, inter-token latency, end-to-end
  latency, queue time, request_success by finished_reason).
`StatsLogger.tick()` (called every few seconds by the app) turns counter deltas into the average
throughput gauges and logs a vLLM-style line.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxllm.outputs import RequestOutput
from jaxllm.stats import STEP_HOST_PHASES

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
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


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
        # Fed from the engine's `iteration_tokens` list (tokens per step) when it has one; see drain_iterations.
        self.iteration_tokens = Histogram(
            "jaxllm:iteration_tokens_total",
            "Number of tokens per engine step.",
            labels,
            buckets=_TOKEN_BUCKETS,
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

    def drain_iterations(self) -> None:
        """Moves the engine's per-step token counts into the histogram (the engine appends, we take)."""
        steps = getattr(self.engine, "iteration_tokens", None)
        if not isinstance(steps, list):
            return
        n = len(steps)
        taken = steps[:n]
        del steps[:n]  # appends made meanwhile land after n and stay for next time
        for t in taken:
            self.iteration_tokens.observe(t)

    def render(self) -> bytes:
        self.drain_iterations()
        return generate_latest(self.registry)

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)


class RequestTracker:
    """Observes one engine request's outputs as they arrive."""

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics
        self.arrival = time.monotonic()
        self.last_token_time: float | None = None
        self.num_tokens = 0

    def on_output(self, ro: RequestOutput) -> None:
        now = time.monotonic()
        n = max((len(o.token_ids) for o in ro.outputs), default=0)
        if n > self.num_tokens:
            if self.last_token_time is None:
                self.m.ttft.observe(now - self.arrival)
                mt = ro.metrics
                if mt is not None and mt.first_scheduled_time is not None:
                    self.m.queue_time.observe(max(0.0, mt.first_scheduled_time - mt.arrival_time))
            else:
                # One observation per new token, spread evenly over the gap since the last output.
                gap = (now - self.last_token_time) / (n - self.num_tokens)
                for _ in range(n - self.num_tokens):
                    self.m.itl.observe(gap)
            self.last_token_time = now
            self.num_tokens = n
        if ro.finished:
            self.m.e2e.observe(now - self.arrival)
            for o in ro.outputs:
                self.m.request_finished(o.finish_reason or "stop")


class StatsLogger:
    """Turns the engine's cumulative counters into throughput gauges and a periodic log line."""

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics
        self._last_time = time.monotonic()
        s = metrics.engine.get_stats()
        self._last_prompt, self._last_gen = s.prompt_tokens, s.generation_tokens
        self.idle = True  # nothing ran during the last tick (the app then skips the log line, as vLLM)

    def tick(self) -> str:
        self.m.drain_iterations()
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
