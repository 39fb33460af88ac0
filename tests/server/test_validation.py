"""Request validation at the edge: every client mistake is a 400 in OpenAI's shape whose `param` is the
field's own path and whose message starts with it; fields of OpenAI's API that jaxllm does not serve are
refused by name; unknown fields pass with one warning line; /openapi.json describes the same models (a
JSON Schema validator, given only the document, accepts and rejects what the server does)."""

from __future__ import annotations

import json
import logging

import jsonschema
import pytest

from tests.server.test_errors import _err

MSG = [{"role": "user", "content": "hello world"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def chat(client, **fields):
    return client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, **fields})


def complete(client, **fields):
    return client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 2, **fields})


ROUTES = {"chat": chat, "completions": complete}


def check_400(r, param: str) -> dict:
    e = _err(r, 400, param)
    assert e["message"].startswith(param), e
    assert e["type"] == "invalid_request_error"
    return e


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "fields,param",
    [
        ({"temperature": 1e308}, "temperature"),  # finite, but beyond OpenAI's [0, 2]
        ({"temperature": 2.01}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),  # strict: a string is not a number
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"n": 129}, "n"),
        ({"n": 1.0}, "n"),
        ({"seed": 2**63}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 1e39}, "repetition_penalty"),  # beyond float32
        ({"stop": 3}, "stop"),
        ({"stop": ["a", 3]}, "stop[1]"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"logit_bias": {"5": "1"}}, "logit_bias.5"),
        ({"logit_bias": {str(10**6): 1}}, "logit_bias"),  # not in the vocabulary
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids[0]"),
        ({"allowed_token_ids": [3, 10**6]}, "allowed_token_ids"),  # not in the vocabulary
        ({"bad_words": ["ok", ""]}, "bad_words[1]"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # vLLM: not with stream
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # vLLM: only with stream
        ({"stream_options": {"include_usage": True}, "stream": False}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs.json"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        (
            {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
        ),
        ({"guided_json": 5}, "guided_json"),
        ({"guided_json": "[]"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": ["a"]}, "guided_regex"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"length_penalty": 0.5}, "length_penalty"),
        ({"truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"priority": "high"}, "priority"),
    ],
)
def test_bad_fields_are_400_naming_the_field(client, route, fields, param):
    check_400(ROUTES[route](client, **fields), param)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
        {"guided_json": SCHEMA, "guided_choice": ["a", "b"]},
        {"structured_outputs": {"regex": "a+"}, "guided_grammar": "root ::= 'a'"},
    ],
)
def test_two_output_constraints_are_400_naming_both(client, route, fields):
    e = _err(ROUTES[route](client, **fields), 400)
    assert all(name in e["param"] and name in e["message"] for name in fields), e


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),  # its own name, not `logprobs`
        ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
        ({"top_logprobs": -1, "logprobs": True}, "top_logprobs"),
        ({"logprobs": 1}, "logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": MSG + MSG + [{"role": "wizard", "content": "x"}]}, "messages[2].role"),
        ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, "messages[0].role"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}
                ]
            },
            "messages[0].content[1].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
        ({"messages": [{"role": "tool", "content": "18C"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}
                ]
            },
            "messages[0].function_call",
        ),
        ({"messages": [{"role": "assistant", "content": "x", "audio": {"id": "a"}}]}, "messages[0].audio"),
        ({"messages": []}, "messages"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
            "tools[0].function.parameters",
        ),
        ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),  # vLLM: tool_choice needs tools
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {}}, "tools": TOOLS}, "tool_choice.function.name"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
        ({"chat_template_kwargs": []}, "chat_template_kwargs"),
        # OpenAI's fields that are not served
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities[1]"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"verbosity": "low"}, "verbosity"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"metadata": {"k": 1}}, "metadata.k"),
        # vLLM's chat extras that are not served
        ({"echo": True}, "echo"),
        ({"add_special_tokens": True}, "add_special_tokens"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"documents": [{"text": "x"}]}, "documents"),
    ],
)
def test_chat_fields(client, fields, param):
    check_400(chat(client, **fields), param)


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"echo": 1}, "echo"),
        ({"suffix": "the end"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"best_of": 3, "n": 2}, "best_of"),
        ({"prompt": []}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
    ],
)
def test_completion_fields(client, fields, param):
    check_400(complete(client, **fields), param)


def test_top_logprobs_follows_max_logprobs(client, settings):
    settings(max_logprobs=3)
    assert chat(client, logprobs=True, top_logprobs=3).status_code == 200
    e = check_400(chat(client, logprobs=True, top_logprobs=4), "top_logprobs")
    assert "--max-logprobs 3" in e["message"]
    check_400(complete(client, logprobs=4), "logprobs")
    check_400(complete(client, prompt_logprobs=4), "prompt_logprobs")
    assert complete(client, logprobs=3, prompt_logprobs=3).status_code == 200


def _warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "jaxllm.server" and r.levelno == logging.WARNING]


@pytest.mark.parametrize("route", ROUTES)
def test_unknown_fields_pass_with_one_warning(client, caplog, route):
    with caplog.at_level(logging.WARNING, logger="jaxllm.server"):
        r = ROUTES[route](client, frobnicate=1, guided_decoding_backend="xgrammar", **{"x-extra": {"a": 1}})
    assert r.status_code == 200, r.text
    (warning,) = _warnings(caplog)
    assert "ignored" in warning.getMessage()
    for name in ("frobnicate", "guided_decoding_backend", "x-extra"):
        assert name in warning.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxllm.server"):
        assert ROUTES[route](client).status_code == 200
    assert _warnings(caplog) == []


def test_unknown_keys_inside_messages_are_named_in_the_same_line(client, caplog):
    messages = [{"role": "user", "content": "hi", "cache_control": {"type": "ephemeral"}}]
    with caplog.at_level(logging.WARNING, logger="jaxllm.server"):
        assert chat(client, messages=messages, frobnicate=1).status_code == 200
    (warning,) = _warnings(caplog)
    assert "messages[0].cache_control" in warning.getMessage() and "frobnicate" in warning.getMessage()


@pytest.mark.parametrize(
    "fields",
    [
        {"user": "u-1", "store": False, "metadata": {"team": "a"}, "service_tier": "auto"},
        {
            "service_tier": "default",
            "modalities": ["text"],
            "prompt_cache_key": "k",
            "safety_identifier": "s",
        },
        {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}},
        {"audio": None, "functions": None, "prediction": None},  # null counts as left out
        {"use_beam_search": False, "length_penalty": 1.0, "echo": False, "add_special_tokens": False},
        {"response_format": {"type": "text"}, "parallel_tool_calls": False},
        {"tools": TOOLS, "tool_choice": "none"},
        {"tool_choice": "none"},
    ],
)
def test_accepted_without_effect(client, caplog, fields):
    with caplog.at_level(logging.WARNING, logger="jaxllm.server"):
        r = chat(client, **fields)
    assert r.status_code == 200, r.text
    assert _warnings(caplog) == []


def test_completion_accepts(client):
    assert complete(client, user="u", suffix=None, best_of=2, n=2, echo=True).status_code == 200


# ---- /openapi.json --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def openapi(client):
    r = client.get("/openapi.json")
    assert r.status_code == 200
    return json.loads(r.text)


def _validator(doc: dict, name: str) -> jsonschema.Draft202012Validator:
    # The document itself is the root, so its "#/components/schemas/..." references resolve.
    return jsonschema.Draft202012Validator({**doc, "$ref": f"#/components/schemas/{name}"})


def test_openapi_names_the_request_schemas(openapi):
    assert openapi["openapi"].startswith("3.1")
    bodies = {
        "/v1/chat/completions": "ChatCompletionBody",
        "/v1/completions": "CompletionBody",
        "/tokenize": "TokenizeBody",
        "/detokenize": "DetokenizeBody",
    }
    for path, name in bodies.items():
        schema = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": f"#/components/schemas/{name}"}
        jsonschema.Draft202012Validator.check_schema(openapi["components"]["schemas"][name])
    for path in ("/v1/models", "/health", "/version", "/metrics", "/openapi.json"):
        assert "get" in openapi["paths"][path]
    refs = set()

    def walk(x):
        if isinstance(x, dict):
            if isinstance(x.get("$ref"), str):
                refs.add(x["$ref"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(openapi)
    for ref in refs:
        assert ref.removeprefix("#/components/schemas/") in openapi["components"]["schemas"], ref
    chat_props = openapi["components"]["schemas"]["ChatCompletionBody"]["properties"]
    assert {"messages", "temperature", "top_logprobs", "response_format", "tools", "logit_bias"} <= set(
        chat_props
    )
    assert "suffix" not in openapi["components"]["schemas"]["CompletionBody"]["properties"]  # refused


@pytest.mark.parametrize(
    "fields,ok",
    [
        ({}, True),
        (
            {
                "temperature": 0.3,
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            },
            True,
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, True),
        ({"temperature": 3}, False),
        ({"top_p": 0}, False),
        ({"n": 0}, False),
        ({"messages": [{"role": "wizard", "content": "x"}]}, False),
        ({"stop": 3}, False),
        ({"service_tier": "flex"}, False),
    ],
)
def test_openapi_schema_agrees_with_the_server(client, openapi, fields, ok):
    body = {"messages": MSG, "max_tokens": 2, **fields}
    errors = list(_validator(openapi, "ChatCompletionBody").iter_errors(body))
    assert (not errors) == ok, errors
    r = client.post("/v1/chat/completions", json=body)
    assert (r.status_code == 200) == ok, r.text
