"""vLLM's HTTP metrics (prometheus-fastapi-instrumentator's names): each request counted once by method,
status class and route, whatever answered it (the handler, the API-key check, no route, an engine that
cannot take requests); /metrics and /health not counted."""

from __future__ import annotations

from tests.server.prom_text import samples, value


def _counts(client) -> dict:
    got = samples(client.get("/metrics").text)
    return {
        dict(ls)["method"] + " " + dict(ls)["status"] + " " + dict(ls)["handler"]: v
        for (n, ls), v in got.items()
        if n == "http_requests_total"
    }


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}


def test_requests_are_counted_by_route_and_status_class(client, engine, settings, monkeypatch):
    before = _counts(client)
    ok = {"prompt": "hello", "max_tokens": 2}
    assert client.post("/v1/completions", json=ok).status_code == 200
    assert client.post("/v1/completions", json={**ok, "stream": True}).status_code == 200
    assert client.post("/v1/completions", json={**ok, "temperature": -1}).status_code == 400
    assert client.get("/v1/models").status_code == 200
    assert client.get("/no/such/route").status_code == 404
    assert client.get("/health").status_code == 200  # not counted
    settings(api_key="k")
    assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 401
    settings(api_key=None)

    async def refuse(*args, **kwargs):
        raise RuntimeError("the engine loop failed")
        yield  # an async generator, as engine.generate is

    monkeypatch.setattr(engine, "generate", refuse)
    assert client.post("/v1/completions", json=ok).status_code == 503
    assert _delta(before, _counts(client)) == {
        "POST 2xx /v1/completions": 2,
        "POST 4xx /v1/completions": 1,
        "GET 2xx /v1/models": 1,
        "GET 4xx none": 1,
        "POST 4xx /v1/chat/completions": 1,
        "POST 5xx /v1/completions": 1,
    }


def test_request_durations_cover_the_whole_stream(client):
    """A stream's duration runs to its last byte: at least the sum of its inter-token gaps."""
    text = client.get("/metrics").text
    d0 = value(text, "http_request_duration_seconds_sum", handler="/v1/completions", method="POST")
    h0 = value(text, "http_request_duration_highr_seconds_count")
    i0 = value(text, "jaxllm:inter_token_latency_seconds_sum")
    body = {"prompt": "hello", "max_tokens": 30, "ignore_eos": True, "stream": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    text = client.get("/metrics").text
    took = value(text, "http_request_duration_seconds_sum", handler="/v1/completions", method="POST") - d0
    gaps = value(text, "jaxllm:inter_token_latency_seconds_sum") - i0
    assert took >= gaps > 0
    assert value(text, "http_request_duration_highr_seconds_count") - h0 == 1
