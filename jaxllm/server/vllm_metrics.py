"""The `vllm:` twins of the server's `jaxllm:` series, so vLLM's dashboards, alerts and autoscalers read
jaxllm unchanged.

    ServerMetrics' own registry (every series `jaxllm:NAME`, labels model_name[, ...])
      --VllmTwins.collect, at scrape time-->  each family as registered, then its twin `vllm:NAME`
                                               with vLLM's extra label engine="0" (one engine per server)
                                               and, for a histogram, only the bounds vLLM's has
Both prefixes come from one collection, so a scrape shows them equal (never one step apart). Our
histograms' bounds are a superset of vLLM's (`with_vllm_bounds`): finer where jaxllm needs it (inter-token
latencies of a few milliseconds on a GPU), and a cumulative bucket count at one bound does not depend on
the others, so the twin's buckets are exactly vLLM's, not re-binned.

The bounds below are vLLM v1's (vllm/v1/metrics/loggers.py, PrometheusStatLogger) by histogram name.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from jaxllm.stats import ITERATION_TOKEN_BUCKETS

JAXLLM_PREFIX = "jaxllm:"
VLLM_PREFIX = "vllm:"
ENGINE_INDEX = "0"  # vLLM's `engine` label: the data-parallel engine's index; one engine here

VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# inter_token_latency_seconds and request_time_per_output_token_seconds
VLLM_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# e2e, queue, inference, prefill and decode time of a request
VLLM_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip
VLLM_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
SPEC_ACCEPTANCE_RATE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

# Older dashboards (vLLM <= 0.10) read the inter-token latency under its earlier name; vLLM 0.11 exported
# both, observed alike. The alias exists under `vllm:` only.
VLLM_ALIASES = {"inter_token_latency_seconds": "time_per_output_token_seconds"}


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's bounds for token counts (max_value: the context)."""
    bounds, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(bounds)
            bounds.append(m * scale)
        scale *= 10


def vllm_histogram_bounds(max_model_len: int) -> dict[str, tuple[float, ...]]:
    """vLLM's bounds of each histogram the server exports, by name without the prefix."""
    tokens = build_1_2_5_buckets(max_model_len)
    return {
        "time_to_first_token_seconds": VLLM_TTFT_BUCKETS,
        "inter_token_latency_seconds": VLLM_TOKEN_LATENCY_BUCKETS,
        "request_time_per_output_token_seconds": VLLM_TOKEN_LATENCY_BUCKETS,
        "e2e_request_latency_seconds": VLLM_REQUEST_LATENCY_BUCKETS,
        "request_queue_time_seconds": VLLM_REQUEST_LATENCY_BUCKETS,
        "request_inference_time_seconds": VLLM_REQUEST_LATENCY_BUCKETS,
        "request_prefill_time_seconds": VLLM_REQUEST_LATENCY_BUCKETS,
        "request_decode_time_seconds": VLLM_REQUEST_LATENCY_BUCKETS,
        "request_prompt_tokens": tokens,
        "request_generation_tokens": tokens,
        "request_max_num_generation_tokens": tokens,
        "request_params_max_tokens": tokens,
        "request_params_n": VLLM_PARAMS_N_BUCKETS,
        "iteration_tokens_total": ITERATION_TOKEN_BUCKETS,
        # jaxllm's own (vLLM has no per-request acceptance histogram): its twin keeps every bound
        "request_spec_decode_acceptance_rate": SPEC_ACCEPTANCE_RATE_BUCKETS,
    }


def with_vllm_bounds(ours: Iterable[float], vllm: Iterable[float]) -> tuple[float, ...]:
    """Our bounds plus vLLM's, sorted: what a `jaxllm:` histogram uses so its `vllm:` twin is exact."""
    return tuple(sorted({float(b) for b in ours} | {float(b) for b in vllm}))


class VllmTwins:
    """A collector that yields every family of `source` and then its `vllm:` twin (see the module)."""

    def __init__(self, source: CollectorRegistry, bounds: Mapping[str, Iterable[float]]):
        self.source = source
        self.bounds = {name: frozenset(map(float, b)) for name, b in bounds.items()}

    def describe(self) -> list:
        return []  # names are checked in the source registry; nothing here to check twice

    def collect(self) -> Iterator[Metric]:
        families = list(self.source.collect())
        yield from families
        for family in families:
            if not family.name.startswith(JAXLLM_PREFIX):
                continue
            base = family.name[len(JAXLLM_PREFIX) :]
            keep = self.bounds.get(base) if family.type == "histogram" else None
            yield _renamed(family, base, base, keep)
            if base in VLLM_ALIASES:
                yield _renamed(family, base, VLLM_ALIASES[base], keep)


def _renamed(family: Metric, base: str, new_base: str, keep: frozenset[float] | None) -> Metric:
    twin = Metric(VLLM_PREFIX + new_base, family.documentation, family.type, family.unit)
    old_name = JAXLLM_PREFIX + base
    for s in family.samples:
        le = s.labels.get("le")
        if keep is not None and le is not None and le != "+Inf" and float(le) not in keep:
            continue
        suffix = s.name[len(old_name) :]  # "", "_total", "_bucket", "_count", "_sum", "_created"
        # Sample is a NamedTuple (name, labels, value, timestamp, exemplar, ...): the rest carried over
        twin.samples.append(
            type(s)(VLLM_PREFIX + new_base + suffix, {**s.labels, "engine": ENGINE_INDEX}, *s[2:])
        )
    return twin
