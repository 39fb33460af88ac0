"""Every route of a real `jaxllm serve` (the embedded model) fuzzed from its own /openapi.json with
schemathesis: bodies that fit the schema (positive) and bodies that break it (negative: wrong types, missing
fields, out-of-range numbers, non-JSON bytes). Nothing may answer >= 500, every 4xx carries OpenAI's error
object, the process stays up with no traceback in its log, and a greedy request answers afterwards exactly
as it did before. The work each request asks of the engine is capped (fuzz_support.bounded)."""

from __future__ import annotations

import time

import httpx
import pytest
import schemathesis
from schemathesis import GenerationMode

from tests.server.fuzz_support import (
    Request,
    bounded,
    describe,
    generated,
    send_all,
    start_server,
    tracebacks,
)

# GET routes take no parameters, so hypothesis stops once it has the few
# distinct requests there are.
# (positive, negative) examples per route; generating a chat or a negative /tokenize body is the slow part.
EXAMPLES = {
    "/v1/chat/completions": (100, 100),
    "/v1/completions": (150, 150),
    "/tokenize": (100, 40),
    "/detokenize": (120, 120),
}
GET_EXAMPLES = 5


@pytest.fixture(scope="module")
def server():
    s = start_server()
    yield s
    s.process.stop()


def to_request(case) -> Request:
    kw = case.as_transport_kwargs(base_url="")
    path = case.operation.path
    if "json" in kw:
        req = Request.json(path, kw["json"], method=kw["method"])
    else:
        req = Request(kw["method"], path, kw.get("data"))
    content_type = {k.lower(): v for k, v in kw["headers"].items()}.get("content-type")
    if content_type is not None:
        req.headers["content-type"] = content_type
    req.params = kw.get("params") or None
    return req


def test_every_route_from_openapi(server, record_property):
    before = server.greedy_answers()
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [op.ok() for op in schema.get_all_operations()]
    assert {op.path for op in operations} >= {*EXAMPLES, "/v1/models", "/health", "/metrics", "/version"}
    t0 = time.perf_counter()
    requests = []
    for op in operations:
        for mode, n in zip(GenerationMode, EXAMPLES.get(op.path, (GET_EXAMPLES, 0)), strict=True):
            requests += [to_request(c) for c in generated(op.as_strategy(generation_mode=mode), n)]
    generate_s = time.perf_counter() - t0
    outcome = send_all(server.url, requests)
    print(
        outcome.report(
            f"schemathesis ({generate_s:.0f} s to generate, {time.perf_counter() - t0:.0f} s in all)"
        )
    )
    record_property("fuzz_requests", dict(outcome.tried))
    assert not outcome.failures, describe(outcome.failures)
    assert server.alive()
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert server.greedy_answers() == before
    assert not tracebacks(server.log()), tracebacks(server.log())
    # the fuzzing reached the engine and its refusals alike on each generation route
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        assert outcome.statuses[(path, 200)] > 0 and outcome.statuses[(path, 400)] > 0, outcome.report(path)


def test_bounded_caps_only_runnable_values():
    # hand-computed: runnable counts are lowered, refused ones kept, an absent max_tokens becomes 1
    assert bounded(
        "/v1/completions", {"prompt": ["a", "b", "c"], "n": 5, "best_of": 5, "max_tokens": 50}
    ) == {
        "prompt": ["a", "b"],
        "n": 2,
        "best_of": 2,
        "max_tokens": 2,
    }
    refused = {"messages": [], "n": 129, "max_tokens": 10**30, "max_completion_tokens": -1}
    assert bounded("/v1/chat/completions", refused) == refused
    assert bounded("/v1/chat/completions", {"messages": []}) == {"messages": [], "max_tokens": 1}
    assert bounded("/tokenize", {"prompt": "x"}) == {"prompt": "x"}
