"""A real `jaxllm serve` (the embedded model) fuzzed with bodies of our own (fuzz_strategies.py): chat
messages of every role with content parts and tool calls, unicode edge cases, numbers at and past every
bound (NaN, 1e999, 5,000 digits), deep nesting, mixed-type lists, bodies that are not JSON, and wrong
methods and paths. Pass: nothing answers >= 500, every 4xx carries OpenAI's error object, the process stays
up with no traceback in its log, and a greedy request answers afterwards exactly as before."""

from __future__ import annotations

import time

import httpx
import pytest
from hypothesis import strategies as st

from tests.server import fuzz_strategies as fs
from tests.server.fuzz_support import (
    Request,
    describe,
    generated,
    send_all,
    start_server,
    to_json,
    tracebacks,
)

# examples per route (the bodies' strategy, how many)
BODIES = {
    "/v1/chat/completions": (fs.chat_bodies, 260),
    "/v1/completions": (fs.completion_bodies, 300),
    "/tokenize": (fs.tokenize_bodies, 200),
    "/detokenize": (fs.detokenize_bodies, 150),
}
RAW_BODIES = 20  # per POST route
ALL_PATHS = [*BODIES, "/v1/models", "/health", "/version", "/metrics", "/openapi.json"]
WRONG_ROUTES = [  # each answered with the error object too (405, 404)
    Request("GET", "/v1/chat/completions"),
    Request("PUT", "/tokenize", b"{}"),
    Request("DELETE", "/v1/models"),
    Request("POST", "/health", b"{}"),
    Request("GET", "/v1/nothing-here"),
    Request("GET", "/v1/chat/completions/../../etc/passwd"),
    Request("GET", "/%00"),
    Request("GET", "/v1/models", params={"q": "\x00" * 10, "limit": "-1"}),
    *[Request("GET", path) for path in ALL_PATHS[len(BODIES) :]],
]


@pytest.fixture(scope="module")
def server():
    s = start_server()
    yield s
    s.process.stop()


def fuzz_requests() -> list[Request]:
    requests = []
    for path, (bodies, n) in BODIES.items():
        requests += [Request.json(path, body) for body in generated(bodies, n)]
        requests += [
            Request("POST", path, raw, {"content-type": "application/json"})
            for raw in generated(fs.raw_bodies, RAW_BODIES)
        ]
    return requests + WRONG_ROUTES


def test_fuzzed_messages_unicode_numbers_nesting(server, record_property):
    before = server.greedy_answers()
    t0 = time.perf_counter()
    requests = fuzz_requests()
    generate_s = time.perf_counter() - t0
    outcome = send_all(server.url, requests)
    print(
        outcome.report(
            f"own strategies ({generate_s:.0f} s to generate, {time.perf_counter() - t0:.0f} s in all)"
        )
    )
    record_property("fuzz_requests", dict(outcome.tried))
    assert not outcome.failures, describe(outcome.failures)
    assert server.alive()
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert server.greedy_answers() == before
    assert not tracebacks(server.log()), tracebacks(server.log())
    for path in BODIES:  # each route both ran requests and refused some
        assert outcome.statuses[(path, 200)] > 0 and outcome.statuses[(path, 400)] > 0, outcome.report(path)


def test_to_json_writes_what_json_dumps_cannot():
    # hand-written expected texts: NaN and a 5,000-digit integer spliced, a lone surrogate escaped
    assert to_json({"a": [fs.Raw("NaN"), "\ud800", 1.5, None]}) == '{"a":[NaN,"\\ud800",1.5,null]}'
    assert to_json(fs.deep(3, "list")) == "[[[1]]]"
    assert to_json(fs.deep(2, "dict")) == '{"a":{"a":1}}'
    body = generated(st.just({"prompt": fs.Raw("9" * 5000)}), 1)[0]
    assert len(to_json(body)) == 5000 + len('{"prompt":}')
