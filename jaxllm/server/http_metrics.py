"""HTTP request metrics with the names vLLM's server exports (it uses prometheus-fastapi-instrumentator's
defaults), so dashboards and alerts count errors and latencies per route the same way for both servers.

    request --HTTPMetricsMiddleware (outermost: a 401 of the API-key check counts too)--> the app
      the status of its `http.response.start` and the time until the app returns (for a stream: its end)
      --> http_requests_total{method, status="2xx".."5xx", handler}
          http_request_duration_seconds{method, handler}   few buckets, per route
          http_request_duration_highr_seconds               many buckets, all routes together
`handler` is the route's path, or "none" for a path no route serves (bounded label values whatever
clients send); /metrics and /health are not counted, as in vLLM (scrapes and probes would drown the rest).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram

from jaxllm.server.http_options import route_path

EXCLUDED_PATHS = frozenset({"/metrics", "/health"})
_LOWR_BUCKETS = (0.1, 0.5, 1.0)
_HIGHR_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 7.5, 10.0,
    30.0, 60.0,
)  # fmt: skip


class HTTPMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter(
            "http_requests_total",
            "Total number of requests by method, status and handler.",
            ["method", "status", "handler"],
            registry=registry,
        )
        self.duration = Histogram(
            "http_request_duration_seconds",
            "Latency with only few buckets by handler.",
            ["method", "handler"],
            buckets=_LOWR_BUCKETS,
            registry=registry,
        )
        self.duration_highr = Histogram(
            "http_request_duration_highr_seconds",
            "Latency with many buckets but no API specific labels.",
            buckets=_HIGHR_BUCKETS,
            registry=registry,
        )

    def observe(self, method: str, status: int, handler: str, seconds: float) -> None:
        self.requests.labels(method, f"{status // 100}xx", handler).inc()
        self.duration.labels(method, handler).observe(seconds)
        self.duration_highr.observe(seconds)


class HTTPMetricsMiddleware:
    """ASGI middleware; `paths`: the app's route paths (the `handler` label's values)."""

    def __init__(self, app, metrics: HTTPMetrics, paths: Iterable[str]):
        self.app = app
        self.metrics = metrics
        self.paths = frozenset(paths)

    async def __call__(self, scope, receive, send):
        path = route_path(scope)  # below --root-path: what the routes match
        if scope["type"] != "http" or path in EXCLUDED_PATHS:
            return await self.app(scope, receive, send)
        status = 500  # what the client gets when the app raises before starting a response
        start = time.perf_counter()

        async def send_and_note_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            handler = path if path in self.paths else "none"
            self.metrics.observe(scope.get("method", ""), status, handler, time.perf_counter() - start)
