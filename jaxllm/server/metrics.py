"""Prometheus metrics with vLLM's names, under the `jaxllm:` prefix and again under vLLM's `vllm:`.

Three sources feed one registry of `jaxllm:` series (`ServerMetrics.own`):
- the engine's start-up figures (`startup_info`): `cache_config_info`, vLLM's info gauge of the KV cache
  (value 1; labels: block size, the pages' dtype, the blocks on the device and the host);
- the engine's latest `EngineStats` snapshot (immutable, published by the engine thread after each step),
  read at scrape time by `_EngineStatsCollector`: gauges for running, waiting and KV usage; counters for
  the engine's cumulative token/prefix/preemption/step counts; the tokens-per-step histogram;
- the handlers, through one `RequestTracker` per engine request, whatever the request's output kind: TTFT
  and inter-token latency as tokens arrive; when the request finishes, vLLM's per-request histograms
  (end-to-end, queue, prefill, decode and inference time, time per output token, prompt and generation
  tokens, the n and max_tokens parameters) and request_success by finished_reason.
/metrics renders `ServerMetrics.registry`: the `jaxllm:` families, their `vllm:` twins (vllm_metrics.py:
vLLM's labels and bucket bounds), the HTTP metrics vLLM's server has (http_metrics.py: requests by route
and status class, latencies) and the process metrics vLLM's default registry carries (process_*,
python_gc_*, python_info).
Counting as vLLM's engine does with a parent request of n samples: request_success and
request_generation_tokens once per sample (choice); the other per-request histograms once per request.
`StatsLogger.tick()` (called every few seconds by the app) turns counter deltas into the average
throughput gauges and logs a vLLM-style line.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import RequestOutputKind
from jaxllm.server.http_metrics import HTTPMetrics
from jaxllm.server.vllm_metrics import VllmTwins, vllm_histogram_bounds, with_vllm_bounds
from jaxllm.stats import HOST_PHASES, ITERATION_TOKEN_BUCKETS

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
            "(reading the tokens back and making request outputs); token_rules, on a thread of its own beside "
            "them, fills the masks of rows under structured outputs. Per step, against the device's step "
            "time, they say which host phase holds a host-bound engine back.",
            labels=["model_name", "phase"],
        )
        for phase in HOST_PHASES:
            host.add_metric([self.model_name, phase], s.step_host_s.get(phase, 0.0))
        yield host
        xla = CounterMetricFamily(
            "jaxllm:compilation_cache_events",
            "The persistent compilation cache, by event: hit (a program loaded instead of compiled), miss "
            "(compiled: no entry), store (an entry written), corrupt (an entry that failed its checksum or "
            "did not load: removed, compiled again and rewritten), write_error (an entry that could not be "
            "written, e.g. a full disk: serving goes on). A warm restart shows hits and no stores.",
            labels=["model_name", "event"],
        )
        for event, key in _CACHE_EVENTS.items():
            xla.add_metric([self.model_name, event], s.compilation_cache.get(key, 0))
        yield xla
        yield counter(
            "spec_decode_num_drafts",
            "Speculative decoding: steps of a request that verified proposed tokens.",
            s.spec_decode_num_drafts,
        )
        yield counter(
            "spec_decode_num_draft_tokens",
            "Speculative decoding: tokens proposed.",
            s.spec_decode_num_draft_tokens,
        )
        yield counter(
            "spec_decode_num_accepted_tokens",
            "Speculative decoding: proposed tokens accepted.",
            s.spec_decode_num_accepted_tokens,
        )
        per_pos = CounterMetricFamily(
            "jaxllm:spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: proposed tokens accepted, by position in the step's proposals (0: first).",
            labels=["model_name", "position"],
        )
        for position, accepted in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            per_pos.add_metric([self.model_name, str(position)], accepted)
        yield per_pos
        yield _iteration_histogram(s.iteration_tokens_buckets, s.iteration_tokens_sum, self.model_name)
        yield _cache_config_info(getattr(self.engine, "startup_info", {}), self.model_name)


# jaxllm:compilation_cache_events's event label -> EngineStats.compilation_cache key
_CACHE_EVENTS = {
    "hit": "hits",
    "miss": "misses",
    "store": "stores",
    "corrupt": "corrupt",
    "write_error": "write_errors",
}

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
        vllm_bounds = vllm_histogram_bounds(engine.max_model_len)  # token histograms go up to the context
        self.own = CollectorRegistry(auto_describe=True)  # the jaxllm: series
        self.own.register(_EngineStatsCollector(engine, model_name))
        r, labels = self.own, ["model_name"]

        def histogram(name: str, doc: str, ours: tuple = ()) -> Histogram:
            buckets = with_vllm_bounds(ours, vllm_bounds[name])
            return Histogram(f"jaxllm:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token in seconds.", _LATENCY_BUCKETS
        )
        self.itl = histogram("inter_token_latency_seconds", "Inter-token latency in seconds.", _ITL_BUCKETS)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "End-to-end request latency in seconds.", _LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Time from the request's arrival to its first step (WAITING phase) in seconds.",
            _LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "Time from the request's first step to its first token (PREFILL phase) in seconds.",
            _LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "request_decode_time_seconds",
            "Time from the request's first token to its last (DECODE phase) in seconds.",
            _LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "request_inference_time_seconds",
            "Time from the request's first step to its last token (RUNNING phase) in seconds.",
            _LATENCY_BUCKETS,
        )
        self.time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Per request: decode time over the tokens after the first (0 with one token), in seconds.",
            _ITL_BUCKETS,
        )
        self.prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed (per sample)."
        )
        self.max_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens (the longest sample of a request).",
        )
        self.spec_acceptance = histogram(
            "request_spec_decode_acceptance_rate",
            "Per request that had tokens proposed (speculative decoding): the share of them accepted.",
        )
        self.params_n = histogram("request_params_n", "Histogram of the n request parameter.")
        self.params_max_tokens = histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter."
        )
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
        # What /metrics shows: ours, the vllm: twins, vLLM's HTTP metrics and the process metrics of
        # vLLM's default registry.
        self.registry = CollectorRegistry()
        self.registry.register(VllmTwins(self.own, vllm_bounds))
        self.http = HTTPMetrics(self.registry)
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(collector)

    def request_finished(self, finish_reason: str) -> None:
        self._success.labels(self.model_name, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(
        self,
        kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        *,
        n: int = 1,
        max_tokens: int | None = None,
    ) -> RequestTracker:
        """`n`, `max_tokens`: the request's parameters (vLLM's request_params_* histograms)."""
        return RequestTracker(self, kind, n=n, max_tokens=max_tokens)


class RequestTracker:
    """Observes one engine request's outputs as they arrive. Streams (CUMULATIVE or DELTA outputs) are timed
    as their tokens reach the server; a FINAL_ONLY request has one output, so its first-token and
    inter-token times come from the engine's timestamps in that output's metrics. The phases of a finished
    request (queue, prefill, decode, inference) come from the engine's timestamps whatever the kind."""

    def __init__(
        self,
        metrics: ServerMetrics,
        kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        *,
        n: int = 1,
        max_tokens: int | None = None,
    ):
        self.m = metrics
        self.kind = kind
        self.n = n
        self.max_tokens = max_tokens
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
            counts[o.index] = counts.get(o.index, 0) + len(o.token_ids)
        return max(counts.values(), default=0)

    def _tokens_per_choice(self, final: RequestOutput) -> list[int]:
        """Each choice's generated tokens, from the request's last output (it lists every choice unless
        the outputs are deltas, which were summed as they came)."""
        if self.kind is RequestOutputKind.DELTA:
            return list(self._delta_tokens.values())
        return [len(o.token_ids) for o in final.outputs]

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
            self._observe_finished(ro)

    def _observe_finished(self, ro: RequestOutput) -> None:
        m = self.m
        per_choice = self._tokens_per_choice(ro)
        longest = max(per_choice, default=0)
        m.prompt_tokens.observe(len(ro.prompt_token_ids))
        for count in per_choice:
            m.generation_tokens.observe(count)
        m.max_generation_tokens.observe(longest)
        m.params_n.observe(self.n)
        if self.max_tokens:
            m.params_max_tokens.observe(self.max_tokens)
        mt = ro.metrics
        if mt is not None and mt.spec_num_draft_tokens:
            m.spec_acceptance.observe(mt.spec_num_accepted_tokens / mt.spec_num_draft_tokens)
        if mt is None or None in (mt.first_scheduled_time, mt.first_token_time, mt.last_token_time):
            return  # no token came (the engine's times are what the phases are made of)
        decode = mt.last_token_time - mt.first_token_time
        m.prefill_time.observe(max(0.0, mt.first_token_time - mt.first_scheduled_time))
        m.decode_time.observe(decode)
        m.inference_time.observe(max(0.0, mt.last_token_time - mt.first_scheduled_time))
        m.time_per_output_token.observe(decode / (longest - 1) if longest > 1 else 0.0)

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
