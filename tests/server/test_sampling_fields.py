"""What the sampling and output-constraint fields become: the SamplingParams the engine is handed (recorded
from the engine's generate), on both routes; prompt_logprobs in the response, against the logprobs of
the mock engine's model computed here with numpy; the official openai SDK's own structured-output
request (a pydantic class turned into a strict JSON schema) arriving as that schema; the tool fields
typed and passed through."""

from __future__ import annotations

import numpy as np
import openai
import pydantic
import pytest
from openai.lib._parsing._completions import type_to_response_format_param
from openai.lib._pydantic import to_strict_json_schema

from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams
from jaxllm.server.protocol import parse_chat

MSG = [{"role": "user", "content": "hello world the cat"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture
def recorded(engine, monkeypatch):
    """The (prompt, SamplingParams, priority) of each request that reaches the engine."""
    calls = []
    inner = engine.generate

    def generate(prompt, params, request_id, *, priority=0):
        calls.append((prompt, params, priority))
        return inner(prompt, params, request_id, priority=priority)

    monkeypatch.setattr(engine, "generate", generate)
    return calls


def chat(client, **fields):
    r = client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 3, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def complete(client, **fields):
    r = client.post("/v1/completions", json={"prompt": "hello world the cat", "max_tokens": 3, **fields})
    assert r.status_code == 200, r.text
    return r.json()


ROUTES = {"chat": chat, "completions": complete}


def params_of(recorded) -> SamplingParams:
    (_, params, _) = recorded[-1]
    return params


@pytest.mark.parametrize("route", ROUTES)
def test_token_fields_reach_sampling_params(client, recorded, route):
    ROUTES[route](client, logit_bias={"5": 100, "7": -100.0, "9": 0.5}, priority=-3)
    p = params_of(recorded)
    assert p.logit_bias == {5: 100.0, 7: -100.0, 9: 0.5}
    assert recorded[-1][2] == -3
    ROUTES[route](client, allowed_token_ids=[5, 6, 7], bad_words=["cat sat", "dog"])
    p = params_of(recorded)
    assert p.allowed_token_ids == [5, 6, 7] and p.bad_words == ["cat sat", "dog"] and p.logit_bias is None
    ROUTES[route](client, spaces_between_special_tokens=False, stop=["x"], seed=4)
    p = params_of(recorded)
    assert not p.spaces_between_special_tokens and p.stop_list == ["x"] and p.seed == 4
    assert p.structured_outputs is None and p.allowed_token_ids is None


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "fields,expected",
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True, "description": "d"},
                }
            },
            StructuredOutputsParams(json=SCHEMA),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA)),
        (
            {"structured_outputs": {"json": '{"type": "object"}'}},
            StructuredOutputsParams(json={"type": "object"}),
        ),
        ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputsParams(regex="[a-z]+")),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputsParams(choice=["yes", "no"])),
        (
            {"structured_outputs": {"grammar": "root ::= 'a'"}},
            StructuredOutputsParams(grammar="root ::= 'a'"),
        ),
        (
            {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
            StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
        ),
        (
            {"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
            StructuredOutputsParams(json=SCHEMA, disable_additional_properties=True),
        ),
        ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
        ({"guided_json": '{"type": "array"}'}, StructuredOutputsParams(json={"type": "array"})),
        ({"guided_regex": r"\d+"}, StructuredOutputsParams(regex=r"\d+")),
        ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
        ({"guided_grammar": "root ::= 'a'"}, StructuredOutputsParams(grammar="root ::= 'a'")),
        ({"response_format": {"type": "text"}, "guided_regex": "a"}, StructuredOutputsParams(regex="a")),
    ],
)
def test_output_constraints_become_structured_outputs(client, recorded, route, fields, expected):
    ROUTES[route](client, **fields)
    assert params_of(recorded).structured_outputs == expected


def test_openai_sdk_response_format_arrives_as_its_strict_schema(live_server, live_engine, monkeypatch):
    """What `client.chat.completions.parse(response_format=Model)` sends (the SDK's own conversion)."""

    class Step(pydantic.BaseModel):
        explanation: str
        output: float

    class Answer(pydantic.BaseModel):
        steps: list[Step]
        verdict: bool
        tags: list[str] | None

    calls = []
    inner = live_engine.generate

    def generate(prompt, params, request_id, *, priority=0):
        calls.append(params)
        return inner(prompt, params, request_id, priority=priority)

    monkeypatch.setattr(live_engine, "generate", generate)
    with openai.OpenAI(base_url=live_server.url + "/v1", api_key="x", max_retries=0, timeout=30) as oai:
        oai.chat.completions.create(
            model=live_engine.model_name,
            messages=MSG,
            max_tokens=3,
            response_format=type_to_response_format_param(Answer),
        )
        assert calls[-1].structured_outputs == StructuredOutputsParams(json=to_strict_json_schema(Answer))
        oai.completions.create(
            model=live_engine.model_name,
            prompt="hello",
            max_tokens=3,
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}, "logit_bias": {"5": 2}},
        )
        assert calls[-1].structured_outputs == StructuredOutputsParams(choice=["yes", "no"])
        assert calls[-1].logit_bias == {5: 2.0}


# ---- prompt_logprobs ----------------------------------------------------------------------------------------
def _reference(engine, ids: list[int], top_n: int) -> list[dict | None]:
    """Per prompt position k >= 1: log-softmax of the mock model's logits after ids[:k] (numpy), the prompt
    token and the top-N with their 1-based ranks; -inf (a token the mock never draws) as vLLM writes it."""
    out: list[dict | None] = [None]
    for k in range(1, len(ids)):
        logits = engine._logits(ids[:k]).astype(np.float64)
        lp = logits - np.logaddexp.reduce(logits)
        order = np.argsort(-lp, kind="stable")
        rank = {int(t): i + 1 for i, t in enumerate(order)}
        keep = {ids[k], *(int(t) for t in order[:top_n])}
        out.append({t: (max(float(lp[t]), -9999.0), rank[t]) for t in keep})  # JSON has no -inf
    return out


def _check(got: list, expected: list, tokenizer) -> None:
    assert len(got) == len(expected)
    assert got[0] is None
    for g, e in zip(got[1:], expected[1:]):
        assert {int(t) for t in g} == set(e)
        for t, (lp, rank) in e.items():
            entry = g[str(t)]
            assert entry["logprob"] == pytest.approx(lp, abs=1e-4)
            assert entry["rank"] == rank
            assert entry["decoded_token"] == tokenizer.decode([t])


@pytest.fixture
def mock_model(engine):
    if not hasattr(engine, "_logits"):
        pytest.skip("the reference logprobs are computed from the mock engine's model")
    return engine


def test_completion_prompt_logprobs(client, mock_model):
    ids = mock_model.tokenizer.encode("hello world the cat sat")
    r = complete(client, prompt=ids, prompt_logprobs=2, n=2, max_tokens=2)
    assert len(r["choices"]) == 2
    for choice in r["choices"]:
        _check(choice["prompt_logprobs"], _reference(mock_model, ids, 2), mock_model.tokenizer)
    r = complete(client, prompt=ids, prompt_logprobs=0, max_tokens=2)
    _check(r["choices"][0]["prompt_logprobs"], _reference(mock_model, ids, 0), mock_model.tokenizer)
    # echo + logprobs asks for prompt logprobs too: the explicit field keeps its own width.
    r = complete(client, prompt=ids, echo=True, logprobs=3, prompt_logprobs=1, max_tokens=2)
    _check(r["choices"][0]["prompt_logprobs"], _reference(mock_model, ids, 1), mock_model.tokenizer)
    assert len(r["choices"][0]["logprobs"]["top_logprobs"][1]) >= 3
    assert "prompt_logprobs" not in complete(client, prompt=ids)["choices"][0]


def test_chat_prompt_logprobs(client, mock_model):
    ids = client.post("/tokenize", json={"messages": MSG}).json()["tokens"]
    r = chat(client, prompt_logprobs=3)
    _check(r["prompt_logprobs"], _reference(mock_model, ids, 3), mock_model.tokenizer)
    assert "prompt_logprobs" not in chat(client)


# ---- tools: typed and passed through -----------------------------------------------------------------------
def test_tool_fields_pass_through_to_the_chat_request():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                "strict": True,
            },
        },
        {"type": "function", "function": {"name": "now"}},
    ]
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        {"role": "system", "content": "be brief", "name": "sys"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "weather "}, {"type": "text", "text": "in Oslo?"}],
        },
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    choice = {"type": "function", "function": {"name": "now"}}
    req = parse_chat(
        {"messages": messages, "tools": tools, "tool_choice": choice, "parallel_tool_calls": False}
    )
    assert req.tools == tools and req.tool_choice == choice and req.parallel_tool_calls is False
    assert req.messages == [
        {"role": "system", "content": "be brief", "name": "sys"},
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "18C", "tool_call_id": "call_1"},
    ]
    plain = parse_chat({"messages": MSG})
    assert (plain.tools, plain.tool_choice, plain.parallel_tool_calls) == (None, None, True)
    assert parse_chat({"messages": MSG, "tools": tools, "tool_choice": "required"}).tool_choice == "required"
