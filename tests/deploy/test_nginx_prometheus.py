"""deploy/ with the real programs: two `jaxllm serve` replicas on the embedded model (started once for the
module, on free ports), Debian's nginx running deploy/nginx's template in front of them, Debian's
Prometheus running deploy/prometheus' config and rules against them.

    client --HTTP--> nginx (127.0.0.1:free) --keep-alive, least_conn--> jaxllm A, jaxllm B (127.0.0.1:free)
    prometheus (127.0.0.1:free, temp storage) --scrapes /metrics--> A, B

Checked: a stream's tokens arrive through nginx spread over its generation (and, as a control, bunched at
the end once the template buffers and compresses them, so the check can fail); a client leaving at nginx frees its request
in the replica; both replicas serve; Prometheus scrapes both and its API returns their series, every rule
evaluates without error; every metric the Grafana dashboard and the rules read is one the server exports.
"""

from __future__ import annotations

import json
import time
import urllib.parse

import httpx
import pytest
import yaml

from tests.deploy.promql_names import dashboard_queries, metric_names
from tests.deploy.real_services import (
    DASHBOARD,
    NGINX_TEMPLATE,
    PROMETHEUS_CONFIG,
    free_port,
    http_get,
    jaxllm_server,
    need,
    nginx,
    prometheus,
)
from tests.server.prom_text import sample_names, samples

STREAM_TOKENS = 24


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    need("nginx", "nginx-light")  # nothing to start when the programs under test are missing
    need("prometheus", "prometheus")
    folder = tmp_path_factory.mktemp("replicas")
    servers = [jaxllm_server(free_port(), folder / f"jaxllm-{i}.log") for i in range(2)]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(timeout=600)
        urls = [s.ready_url.removesuffix("/health") for s in servers]
        for url in urls:  # compile the shapes the tests use before anything is timed
            _stream(url, "warm up", STREAM_TOKENS)
            _complete(url, "warm up", 2)
        yield urls
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def balancer(replicas, tmp_path_factory):
    service, url = nginx(tmp_path_factory.mktemp("nginx"), [u.removeprefix("http://") for u in replicas])
    with service:
        service.wait_ready(timeout=30)
        yield url


def _complete(base: str, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(base: str, prompt: str, max_tokens: int) -> tuple[float, list[float]]:
    """Sends a streamed completion; returns when it was sent and when each token event arrived."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    arrivals = []
    sent = time.perf_counter()
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter())
    return sent, arrivals


def _metric_sum(url: str, name: str, **labels: str) -> float:
    got = samples(http_get(f"{url}/metrics")[1])
    want = set(labels.items())
    return sum(v for (n, ls), v in got.items() if n == name and want <= ls)


def _spread(sent: float, arrivals: list[float]) -> float:
    """The share of the response's time over which its token events arrived: near 1 when each came as it
    was generated, near 0 when they all came at the end."""
    return (arrivals[-1] - arrivals[0]) / (arrivals[-1] - sent)


def test_stream_tokens_arrive_through_nginx_as_they_are_generated(replicas, balancer, tmp_path):
    sent, arrivals = _stream(balancer, "The history of the city", STREAM_TOKENS)
    assert len(arrivals) == STREAM_TOKENS  # one event per token
    assert _spread(sent, arrivals) > 0.5, arrivals
    # Control: the same template with buffering on (the server's "X-Accel-Buffering: no" ignored) and
    # event streams compressed bunches the events at the end, so the measure above tells the two apart.
    # (Measured with nginx 1.22: buffering on alone still passed each event on promptly; with buffering off
    # nginx flushes every piece the replica writes, so even compression passes it at once.)
    buffered = (
        NGINX_TEMPLATE.read_text()
        .replace("proxy_buffering off;", "proxy_buffering on; proxy_ignore_headers X-Accel-Buffering;")
        .replace("gzip off;", "gzip on; gzip_types text/event-stream;")
    )
    service, url = nginx(tmp_path / "buffered", [u.removeprefix("http://") for u in replicas], buffered)
    with service:
        service.wait_ready(timeout=30)
        sent, arrivals = _stream(url, "The history of the city", STREAM_TOKENS)
    assert len(arrivals) == STREAM_TOKENS
    assert _spread(sent, arrivals) < 0.1, arrivals


def test_a_client_leaving_at_nginx_frees_its_request(replicas, balancer):
    running = "jaxllm:num_requests_running"
    before = sum(_metric_sum(u, "jaxllm:generation_tokens_total") for u in replicas)
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=300) as client:
        with client.stream("POST", f"{balancer}/v1/completions", json=body) as r:
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: {")
                if events == 3:
                    break
            assert sum(_metric_sum(u, running) for u in replicas) == 1
        # leaving the block closes the connection with the response unread
    deadline = time.monotonic() + 30
    while sum(_metric_sum(u, running) for u in replicas) != 0:
        assert time.monotonic() < deadline, "the request kept running after its client left"
        time.sleep(0.1)
    for u in replicas:
        assert _metric_sum(u, "vllm:num_requests_running") == 0
    generated = sum(_metric_sum(u, "jaxllm:generation_tokens_total") for u in replicas) - before
    assert 3 <= generated < 400  # stopped early: aborted, not run to its end


def test_both_replicas_serve_behind_nginx(replicas, balancer):
    finished = "jaxllm:request_success_total"
    before = [_metric_sum(u, finished) for u in replicas]
    for i in range(6):
        out = _complete(balancer, f"Request number {i}:", 2)
        assert out["usage"]["completion_tokens"] == 2
    served = [_metric_sum(u, finished) - b for u, b in zip(replicas, before, strict=True)]
    assert sum(served) == 6 and min(served) >= 1, served


def _query(prom: str, expr: str) -> dict:
    status, body = http_get(f"{prom}/api/v1/query?query={urllib.parse.quote(expr)}")
    out = json.loads(body)
    assert status == 200 and out["status"] == "success", (expr, body)
    return out["data"]


def test_prometheus_scrapes_the_replicas_and_evaluates_the_rules(replicas, tmp_path):
    targets = [u.removeprefix("http://") for u in replicas]
    service, prom = prometheus(tmp_path / "prometheus", targets)
    with service:
        service.wait_ready(timeout=60)
        deadline = time.monotonic() + 60
        while len(_query(prom, 'up{job="jaxllm"} == 1')["result"]) < 2:
            assert time.monotonic() < deadline, service.tail()
            time.sleep(0.5)
        # The series as the servers export them, one per replica, both prefixes equal.
        for name in ("generation_tokens_total", "num_requests_running", "kv_cache_usage_perc"):
            ours = {r["metric"]["instance"]: r["value"][1] for r in _query(prom, f"jaxllm:{name}")["result"]}
            twins = {r["metric"]["instance"]: r["value"][1] for r in _query(prom, f"vllm:{name}")["result"]}
            assert sorted(ours) == sorted(targets) and twins == ours, name
        generated = {
            r["metric"]["instance"]: float(r["value"][1])
            for r in _query(prom, "jaxllm:generation_tokens_total")["result"]
        }
        for url, target in zip(replicas, targets, strict=True):
            assert generated[target] == _metric_sum(
                url, "jaxllm:generation_tokens_total"
            )  # nothing ran since
        # Every recording and alert rule evaluated once, without error (a rule reading a label or a
        # series the wrong way evaluates to nothing, but one that fails shows health "err").
        interval = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["global"]["evaluation_interval"]
        deadline = time.monotonic() + 3 * float(interval.removesuffix("s")) + 10
        while True:
            groups = json.loads(http_get(f"{prom}/api/v1/rules")[1])["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            if rules and all(not r["lastEvaluation"].startswith("0001") for r in rules):
                break
            assert time.monotonic() < deadline, groups
            time.sleep(1)
        assert len(groups) == 4 and all(r["health"] == "ok" for r in rules), [
            r for r in rules if r["health"] != "ok"
        ]
        # The dashboard's queries are valid PromQL for this Prometheus, with either prefix.
        dashboard = json.loads(DASHBOARD.read_text())
        for prefix in ("jaxllm", "vllm"):
            for q in dashboard_queries(dashboard, prefix):
                if not q.startswith("label_values("):
                    _query(prom, q)


def test_every_metric_the_dashboard_and_rules_read_is_exported(replicas):
    exported = set()
    for url in replicas:
        exported |= sample_names(http_get(f"{url}/metrics")[1])
    exported |= {"up"}  # made by Prometheus for each scrape
    dashboard = json.loads(DASHBOARD.read_text())
    read = set()
    for prefix in ("jaxllm", "vllm"):
        for q in dashboard_queries(dashboard, prefix):
            read |= metric_names(q)
    recorded, rule_reads = set(), set()
    for path in sorted((PROMETHEUS_CONFIG.parent / "rules").glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                recorded.add(rule.get("record"))
                rule_reads |= metric_names(rule["expr"])
    assert read - exported == set()
    assert rule_reads - exported - recorded == set()
    assert len(read) >= 20
