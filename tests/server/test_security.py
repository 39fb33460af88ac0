"""Security at the edge, on the mock engine: the API key guards every protected route (with and without
--root-path, each compared with hmac.compare_digest) and leaves /health, /metrics, /version open; every
request limit is refused with the status docs/openai_api.md gives, naming the field and the limit's
number; no request can make the chat template read a file."""

from __future__ import annotations

import hmac

import pytest
from starlette.testclient import TestClient

from jaxllm.server import auth
from jaxllm.server.app import build_app
from jaxllm.server.http_options import HTTPOptions
from jaxllm.server.protocol_common import MAX_N, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from tests.server.mock_engine import MockAsyncEngine
from tests.server.test_errors import _err

KEY = "s3cret-key"
MSG = [{"role": "user", "content": "hello world"}]
# Every route behind the key, with a body it would accept.
PROTECTED = [
    ("POST", "/v1/chat/completions", {"messages": MSG, "max_tokens": 2}),
    ("POST", "/v1/completions", {"prompt": "hello world", "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"prompt": "hello world"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
]
OPEN = ["/health", "/metrics", "/version", "/openapi.json"]


@pytest.fixture(scope="module")
def keyed():
    """An app with an API key, behind the proxy prefix /api (--root-path)."""
    app = build_app(
        MockAsyncEngine(), api_key=KEY, http=HTTPOptions(root_path="/api"), disconnect_poll_s=0.05
    )
    with TestClient(app) as c:
        yield c


def _call(c, method, path, body, headers=None):
    return c.request(method, path, json=body, headers=headers or {})


@pytest.mark.parametrize("prefix", ["", "/api"])
@pytest.mark.parametrize("method,path,body", PROTECTED)
def test_every_protected_route_needs_the_key(keyed, monkeypatch, prefix, method, path, body):
    compared = []
    real = hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    url = prefix + path
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": KEY},
        {"Authorization": f"bearer {KEY}"},
    ):
        r = _call(keyed, method, url, body, headers)
        e = _err(r, 401)
        assert e["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    r = _call(keyed, method, url, body, {"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    # Every one of the five answers went through the constant-time comparison, none around it.
    assert len(compared) == 5
    assert all(b == f"Bearer {KEY}".encode() for _, b in compared)


@pytest.mark.parametrize("prefix", ["", "/api"])
@pytest.mark.parametrize("path", OPEN)
def test_health_metrics_version_stay_open(keyed, prefix, path):
    assert keyed.get(prefix + path).status_code == 200


def test_a_path_that_only_looks_protected_is_no_way_round_the_key(keyed):
    # Unknown paths are 404s, never a route reached without the key; a doubled slash is no other route.
    for path in ("/v1/models/", "/api/v1/models/", "//v1/models", "/v1/../v1/models"):
        r = keyed.get(path)
        assert r.status_code in (401, 404), (path, r.status_code)
        assert "data" not in r.text


# ---- limits ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain():
    with TestClient(build_app(MockAsyncEngine(max_model_len=256), disconnect_poll_s=0.05)) as c:
        yield c


CHAT = "/v1/chat/completions"
COMPLETE = "/v1/completions"


@pytest.mark.parametrize(
    "route,fields,param,number",
    [
        (CHAT, {"n": MAX_N + 1}, "n", MAX_N),
        (COMPLETE, {"n": MAX_N + 1}, "n", MAX_N),
        (CHAT, {"max_tokens": 10_000}, "max_tokens", 256),
        (COMPLETE, {"max_tokens": 10_000}, "max_tokens", 256),
        (CHAT, {"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop", MAX_STOP_STRINGS),
        (COMPLETE, {"stop": "y" * (MAX_STOP_STRING_CHARS + 1)}, "stop", MAX_STOP_STRING_CHARS),
        (CHAT, {"stop": ["ok", "z" * (MAX_STOP_STRING_CHARS + 1)]}, "stop", MAX_STOP_STRING_CHARS),
        (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", 20),
        (COMPLETE, {"logprobs": 21}, "logprobs", 20),
        (COMPLETE, {"prompt_logprobs": 21}, "prompt_logprobs", 20),
        (COMPLETE, {"prompt": "word " * 300}, "prompt", 256),
        (CHAT, {"messages": [{"role": "user", "content": "word " * 300}]}, "messages", 256),
        (CHAT, {"timeout": 0}, "timeout", 0),
    ],
)
def test_each_limit_is_a_400_naming_the_field_and_the_limit(plain, route, fields, param, number):
    base = {"messages": MSG} if route == CHAT else {"prompt": "hello world"}
    e = _err(plain.post(route, json={**base, "max_tokens": 2, **fields}), 400, param)
    assert f"{number:,}".replace(",", "") in e["message"].replace(",", ""), e
    # Within the limit, the same field passes.
    assert plain.post(route, json={**base, "max_tokens": 2}).status_code == 200


def test_stop_strings_at_the_limit_pass(plain):
    stop = ["q" * MAX_STOP_STRING_CHARS] + ["zz"] * (MAX_STOP_STRINGS - 1)
    assert plain.post(COMPLETE, json={"prompt": "hi", "max_tokens": 2, "stop": stop}).status_code == 200


def test_body_size_limit_is_413_with_the_number(plain):
    state = plain.app.state.server
    saved, state.max_request_body_bytes = state.max_request_body_bytes, 4096
    try:
        e = _err(plain.post(COMPLETE, json={"prompt": "a" * 5000}), 413)
        assert "4096" in e["message"] and e["code"] == "request_too_large"
    finally:
        state.max_request_body_bytes = saved


# ---- the chat template reads no file a request names -------------------------------------------------------
def test_a_request_cannot_name_a_template(plain, tmp_path):
    secret = tmp_path / "secret.jinja"
    secret.write_text("TOP-SECRET-FILE {{ messages }}")
    e = _err(plain.post(CHAT, json={"messages": MSG, "chat_template": str(secret)}), 400, "chat_template")
    assert "TOP-SECRET" not in e["message"]
    # chat_template_kwargs cannot replace the server's template either.
    r = plain.post(CHAT, json={"messages": MSG, "chat_template_kwargs": {"chat_template": str(secret)}})
    e = _err(r, 400, "messages")
    assert "TOP-SECRET" not in r.text


@pytest.mark.parametrize("tag", ["include", "import", "extends"])
def test_the_operators_template_cannot_read_files(tmp_path, tag):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-FILE")
    stmt = {"include": f'{{% include "{secret}" %}}', "import": f'{{% import "{secret}" as s %}}'}.get(
        tag, f'{{% extends "{secret}" %}}'
    )
    template = stmt + "{% for m in messages %}{{ m.content }}{% endfor %}"
    with TestClient(build_app(MockAsyncEngine(), chat_template=template)) as c:
        r = c.post(CHAT, json={"messages": MSG, "max_tokens": 2})
        _err(r, 400, "messages")
        assert "TOP-SECRET" not in r.text
