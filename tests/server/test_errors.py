"""Every client mistake gets OpenAI's error shape with the right status, and the server keeps serving."""

from __future__ import annotations

import pytest

from tests.server.sse import parse_sse


def _err(r, status: int, param: str | None = None, contains: str | None = None) -> dict:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"}
    assert isinstance(e["message"], str) and e["message"]
    if param is not None:
        assert e["param"] == param, e
    if contains is not None:
        assert contains in e["message"], e
    return e


def test_malformed_json(client):
    _err(client.post("/v1/completions", content=b"[" * 100000), 400)
    nan = b'{"prompt": "hi", "temperature": NaN}'
    _err(client.post("/v1/completions", content=nan), 400, "temperature")
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    _err(r, 400, contains="JSON")
    _err(client.post("/v1/chat/completions", content=b"[1, 2]"), 400, contains="object")
    _err(client.post("/v1/completions", content=b"\xff\xfe"), 400)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
        ({"prompt": "hi", "n": True}, "n"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": "hi", "stop": 3}, "stop"),
        ({"prompt": "hi", "stop_token_ids": ["a"]}, "stop_token_ids[0]"),
        ({"prompt": "hi", "stream_options": []}, "stream_options"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": [[1, 2], "x"]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "hi", "model": 3}, "model"),
    ],
)
def test_wrong_types_completions(client, body, param):
    _err(client.post("/v1/completions", json=body), 400, param)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_wrong_types_chat(client, body, param):
    _err(client.post("/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1),
        ("top_p", 0),
        ("top_p", 1.5),
        ("n", 0),
        ("max_tokens", 0),
        ("min_p", 2),
        ("presence_penalty", 3),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("logprobs", 50),
        ("seed", -1),
        ("top_k", -5),
        ("min_tokens", -1),
        ("n", 100000),
        ("stop_token_ids", [10**9]),
    ],
)
def test_invalid_sampling_params_name_the_field(client, field, value):
    e = _err(client.post("/v1/completions", json={"prompt": "hi", field: value}), 400, field)
    assert field in e["message"]


def test_unknown_model_is_404(client):
    e = _err(client.post("/v1/completions", json={"prompt": "hi", "model": "nope"}), 404, "model")
    assert e["code"] == "model_not_found"
    _err(
        client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "model": "nope"}
        ),
        404,
    )


def test_context_length(client, engine):
    long_prompt = " ".join(["cat"] * (engine.max_model_len + 5))
    e = _err(client.post("/v1/completions", json={"prompt": long_prompt}), 400, "prompt")
    assert e["code"] == "context_length_exceeded"
    e = _err(
        client.post("/v1/completions", json={"prompt": "hi", "max_tokens": engine.max_model_len}),
        400,
        "max_tokens",
    )
    assert str(engine.max_model_len) in e["message"]
    msgs = [{"role": "user", "content": long_prompt}]
    _err(client.post("/v1/chat/completions", json={"messages": msgs}), 400, "messages")


def test_bad_prompts(client, engine):
    _err(client.post("/v1/completions", json={"prompt": ""}), 400, "prompt")
    _err(client.post("/v1/completions", json={"prompt": [len(engine.tokenizer) + 10]}), 400, "prompt")
    _err(client.post("/v1/completions", json={"prompt": [-1]}), 400, "prompt")
    _err(client.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")
    _err(client.post("/detokenize", json={"tokens": "abc"}), 400, "tokens")
    _err(client.post("/tokenize", json={}), 400, "prompt")


def test_engine_value_error_is_400(client, engine, monkeypatch):
    async def reject(prompt, params, request_id, *, priority=0):
        raise ValueError("prompt_token_ids=[...] is not acceptable to the engine")
        yield  # pragma: no cover

    monkeypatch.setattr(engine, "generate", reject)
    for stream in (False, True):
        e = _err(
            client.post("/v1/completions", json={"prompt": "hi", "stream": stream}), 400, "prompt_token_ids"
        )
        assert "engine" in e["message"]


def test_handler_exception_answers_only_that_request(client, engine, monkeypatch):
    real = engine.generate
    calls = []

    def flaky(prompt, params, request_id, *, priority=0):
        calls.append(request_id)
        if len(calls) == 1:
            raise KeyError("boom")
        return real(prompt, params, request_id, priority=priority)

    monkeypatch.setattr(engine, "generate", flaky)
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    _err(r, 500)
    ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_unknown_route_and_method(client):
    _err(client.get("/v1/nothing"), 404)
    _err(client.get("/v1/completions"), 405)


def test_body_limit(client, settings):
    settings(max_request_body_bytes=200)
    big = {"prompt": "hi " * 200}
    _err(client.post("/v1/completions", json=big), 413)

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(50):
            yield b"          "

    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in {k.lower() for k in r.request.headers}
    _err(r, 413)
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_api_key(client, settings):
    settings(api_key="s3cret")
    body = {"prompt": "hi", "max_tokens": 1}
    e = _err(client.post("/v1/completions", json=body), 401)
    assert e["type"] == "authentication_error"
    _err(client.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401)
    _err(client.get("/v1/models", headers={"Authorization": "s3cret"}), 401)
    _err(client.post("/tokenize", json={"prompt": "hi"}), 401)
    assert (
        client.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"}).status_code
        == 200
    )
    assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200


def test_engine_failure_mid_stream_ends_the_stream_cleanly(client, engine, monkeypatch):
    real = engine.generate

    async def dies(prompt, params, request_id, *, priority=0):
        async for ro in real(prompt, params, request_id, priority=priority):
            yield ro
            raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "generate", dies)
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "stream": True})
    chunks = parse_sse(r.text)
    assert chunks[-1]["error"]["code"] is None and "device lost" in chunks[-1]["error"]["message"]
    monkeypatch.undo()
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_engine_unavailable_is_503(client, engine, monkeypatch):
    def stopping(prompt, params, request_id, *, priority=0):
        raise RuntimeError("the engine is shutting down")

    monkeypatch.setattr(engine, "generate", stopping)
    e = _err(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}), 503)
    assert "shutting down" in e["message"]


@pytest.mark.parametrize(
    "message,param",
    [
        ("temperature=1e+308 must be at most 100", "temperature"),
        ("research: not served under tensor parallelism or across hosts", "research"),  # the engine's
        ("scale.head=40: the model has query heads 0..31", "scale.head"),
        ("prompt: this model has no tokenizer; pass token ids instead of text", "prompt"),
        ("prompt token ids [9, 10] are outside the vocabulary [0, 8)", None),
    ],
)
def test_an_engine_value_error_names_the_field_its_message_starts_with(message, param):
    from jaxllm.server.errors import from_value_error

    e = from_value_error(ValueError(message))
    assert (e.status, e.param, e.message) == (400, param, message)
