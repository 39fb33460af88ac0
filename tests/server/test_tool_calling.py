"""Tool calling in the chat route: tool_choice's rules (vLLM's wording), the JSON schemas that "required"
and a named function decode under (checked with `jsonschema` on hand-written good and bad instances),
earlier calls through the chat template (compared with transformers' own rendering), and whole and
streamed responses through the official openai SDK (its own stream accumulator is the reference) on a
scripted engine that replays fixed texts token by token through the real server code path."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from jaxllm.server.app import build_app
from jaxllm.server.errors import APIError
from jaxllm.server.protocol import parse_chat
from jaxllm.server.tool_choice import (
    AUTO_NEEDS_FLAGS,
    named_schema,
    plan_tool_calls,
    required_schema,
    tool_request,
)
from jaxllm.server.tool_messages import template_messages
from tests.server.conftest import LiveServer
from tests.server.scripted_engine import ScriptedEngine

TEMPLATE = (Path(__file__).parent / "data" / "hermes_tools_template.jinja").read_text(encoding="utf-8")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "units": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
TOOLS = [WEATHER, CLOCK]
USER = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]


# --- tool_choice -------------------------------------------------------------------------------------


def _plan(body: dict, auto: bool = True):
    body = {"messages": USER, **body}
    return plan_tool_calls(tool_request(parse_chat(body)), auto_tool_choice=auto)


def _error(body: dict, auto: bool = True) -> APIError:
    with pytest.raises(APIError) as e:
        _plan(body, auto)
    assert e.value.status == 400
    return e.value


def test_tool_choice_defaults_and_modes():
    assert _plan({}).mode == "none"
    assert _plan({"tools": TOOLS}).mode == "auto"
    assert _plan({"tools": TOOLS, "tool_choice": "none"}).tools == TOOLS  # tools still reach the template
    # required without a tool to call: refused where the request is parsed (protocol_chat.py)
    assert _error({"tools": [], "tool_choice": "required"}).param == "tool_choice"
    req = _plan({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    assert req.mode == "required" and req.schema == required_schema(TOOLS, parallel_tool_calls=False)
    named = _plan({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert named.mode == "named" and named.function_name == "get_weather"
    assert named.schema == WEATHER["function"]["parameters"]
    assert (
        _plan({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "text"}}).mode
        == "required"
    )


def test_tool_choice_errors_name_the_field_with_vllms_wording():
    e = _error({"tools": TOOLS}, auto=False)  # "auto" is the default with tools
    assert e.message == AUTO_NEEDS_FLAGS and e.param == "tool_choice"
    assert (
        AUTO_NEEDS_FLAGS
        == '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    )
    e = _error({"tool_choice": "required"})
    assert "requires tools" in e.message and e.param == "tool_choice"
    e = _error({"tools": TOOLS, "tool_choice": "always"})
    assert "always" in e.message and e.param == "tool_choice"
    e = _error({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert "nope" in e.message and e.param.startswith("tool_choice")
    e = _error({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}})
    assert e.param.startswith("tool_choice")
    for field in ("response_format", "structured_outputs", "guided_json"):
        value = {
            "response_format": {"type": "json_object"},
            "structured_outputs": {"json": {"type": "object"}},
            "guided_json": {"type": "object"},
        }[field]
        e = _error({"tools": TOOLS, "tool_choice": "required", field: value})
        assert e.param == "tool_choice" and field in e.message
    e = _error(
        {
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "guided_regex": "a",
        }
    )
    assert e.param == "tool_choice"
    assert _error({"tools": {"a": 1}}).param == "tools"
    assert (
        _error({"tools": [WEATHER, {"type": "function", "function": {"name": ""}}]}).param
        == "tools[1].function.name"
    )
    assert _error({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}).param == (
        "tools[0].function.parameters"
    )
    assert _error({"tools": TOOLS, "parallel_tool_calls": "yes"}).param == "parallel_tool_calls"


def test_flags_name_the_registered_parsers_and_need_each_other():
    from jaxllm.server.args import REASONING_PARSERS as REASONING_FLAG_CHOICES
    from jaxllm.server.args import TOOL_CALL_PARSERS, ServerArgs, args_from_namespace, make_arg_parser
    from jaxllm.server.reasoning import REASONING_PARSERS
    from jaxllm.server.tool_parsers import TOOL_PARSERS

    assert set(TOOL_CALL_PARSERS) == set(TOOL_PARSERS) and set(REASONING_FLAG_CHOICES) == set(
        REASONING_PARSERS
    )
    with pytest.raises(ValueError, match="--enable-auto-tool-choice.*requires --tool-call-parser"):
        ServerArgs(enable_auto_tool_choice=True)
    ns = make_arg_parser().parse_args(
        ["--enable-auto-tool-choice", "--tool-call-parser", "qwen", "--reasoning-parser", "qwen3"]
    )
    _, server = args_from_namespace(ns)
    assert (server.enable_auto_tool_choice, server.tool_call_parser, server.reasoning_parser) == (
        True,
        "qwen",
        "qwen3",
    )
    with pytest.raises(SystemExit):
        make_arg_parser().parse_args(["--tool-call-parser", "pythonic"])
    with pytest.raises(ValueError, match="tool_call_parser='pythonic'"):
        build_app(ScriptedEngine(Script()), tool_call_parser="pythonic")


# --- the schemas -------------------------------------------------------------------------------------


def _valid(schema: dict, instance) -> bool:
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_required_schema_accepts_exactly_calls_of_the_tools():
    schema = required_schema(TOOLS, parallel_tool_calls=True)
    good = [
        [{"name": "get_weather", "parameters": {"city": "Paris"}}],
        [
            {"name": "get_weather", "parameters": {"city": "Oslo", "units": "celsius", "days": 3}},
            {"name": "get_time", "parameters": {}},
        ],
        [{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}],
    ]
    bad = [
        [],  # at least one call
        {"name": "get_time", "parameters": {}},  # not an array
        [{"name": "get_news", "parameters": {}}],  # not a tool
        [{"name": "get_weather", "parameters": {}}],  # city is required
        [{"name": "get_weather", "parameters": {"city": "Paris", "days": 9}}],  # out of range
        [{"name": "get_weather", "parameters": {"city": "Paris", "units": "kelvin"}}],
        [{"name": "get_weather", "parameters": {"city": "Paris", "wind": True}}],  # additionalProperties
        [{"name": "get_weather"}],  # parameters are required
        [{"name": "get_time", "parameters": {}, "id": 1}],  # nothing else in a call
        [{"name": "get_time", "parameters": []}],
    ]
    assert all(_valid(schema, g) for g in good)
    assert not any(_valid(schema, b) for b in bad)
    single = required_schema(TOOLS, parallel_tool_calls=False)
    assert _valid(single, good[0]) and not _valid(single, good[1])


def test_required_schema_moves_definitions_and_references():
    """Two tools defining `Place` differently, one by `$defs`, one by `definitions`, and a reference to
    the parameters' own root: each keeps its meaning inside the array's schema."""
    trip = {
        "type": "function",
        "function": {
            "name": "book_trip",
            "parameters": {
                "$defs": {
                    "Place": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}},
                        "required": ["city"],
                    }
                },
                "type": "object",
                "properties": {
                    "to": {"$ref": "#/$defs/Place"},
                    "via": {"type": "array", "items": {"$ref": "#/$defs/Place"}},
                },
                "required": ["to"],
            },
        },
    }
    pin = {
        "type": "function",
        "function": {
            "name": "pin",
            "parameters": {
                "definitions": {"Place": {"type": "string", "minLength": 2}},
                "type": "object",
                "properties": {"at": {"$ref": "#/definitions/Place"}, "again": {"$ref": "#/properties/at"}},
            },
        },
    }
    tools = [trip, pin]
    before = copy.deepcopy(tools)
    schema = required_schema(tools, parallel_tool_calls=True)
    assert tools == before  # the request's tools are not changed
    assert set(schema["$defs"]) == {"Place", "pin.Place"}
    assert _valid(
        schema, [{"name": "book_trip", "parameters": {"to": {"city": "Rome"}, "via": [{"city": "Pisa"}]}}]
    )
    assert not _valid(schema, [{"name": "book_trip", "parameters": {"to": "Rome"}}])
    assert not _valid(schema, [{"name": "book_trip", "parameters": {"to": {"city": "Rome"}, "via": [{}]}}])
    assert _valid(schema, [{"name": "pin", "parameters": {"at": "Rome", "again": "Pisa"}}])
    assert not _valid(schema, [{"name": "pin", "parameters": {"at": "R"}}])
    assert not _valid(schema, [{"name": "pin", "parameters": {"again": 5}}])
    # Each tool's own schema says the same about its parameters.
    for tool, params in [(trip, {"to": {"city": "Rome"}}), (pin, {"at": "Rome"}), (pin, {"at": 1})]:
        assert _valid(named_schema(tool), params) == _valid(
            schema, [{"name": tool["function"]["name"], "parameters": params}]
        )


def test_named_schema_is_the_parameters():
    schema = named_schema(WEATHER)
    assert _valid(schema, {"city": "Paris", "days": 2})
    assert not _valid(schema, {"days": 2}) and not _valid(schema, {"city": "Paris", "x": 1})
    assert named_schema(CLOCK) == {"type": "object", "properties": {}}
    assert _valid(named_schema(CLOCK), {}) and not _valid(named_schema(CLOCK), [])


# --- earlier calls through the template ---------------------------------------------------------------


def test_template_messages_parse_arguments_and_name_a_bad_one():
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    msgs = [
        USER[0],
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21"},
    ]
    out = template_messages(msgs)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # not changed in place
    assert out[0] is msgs[0] and out[2] is msgs[2]
    bad = copy.deepcopy(msgs)
    bad[1]["tool_calls"].append(
        {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{city: Paris}"}}
    )
    with pytest.raises(APIError) as e:
        template_messages(bad)
    assert e.value.param == "messages[1].tool_calls[1].function.arguments"


# --- through the server -------------------------------------------------------------------------------


class Script:
    """What the scripted engine answers next (and what it answered)."""

    def __init__(self) -> None:
        self.reply = ""

    def __call__(self, prompt: str, params) -> str:
        return self.reply


@pytest.fixture(scope="module")
def scripted():
    script = Script()
    engine = ScriptedEngine(script)
    app = build_app(engine, chat_template=TEMPLATE, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with LiveServer(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        yield script, engine, app.state.server, client


CALLS_REPLY = (
    "I'll look both up.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "units": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
CALLS = [("get_weather", {"city": "Paris", "units": "celsius"}), ("get_time", {})]


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _streamed(client, **kw):
    """The SDK's own accumulation of a stream, and the raw chunks."""
    state = ChatCompletionStreamState(input_tools=kw.get("tools", openai.omit))
    chunks = []
    for chunk in client.chat.completions.create(model="scripted-model", stream=True, **kw):
        chunks.append(chunk)
        state.handle_chunk(chunk)
    return state.get_final_completion(), chunks


def test_auto_tool_calls_whole_and_streamed(scripted):
    script, _, _, client = scripted
    script.reply = CALLS_REPLY
    r = client.chat.completions.create(model="scripted-model", messages=USER, tools=TOOLS)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I'll look both up."
    assert _calls(choice.message) == CALLS
    ids = [c.id for c in choice.message.tool_calls]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == 2
    final, chunks = _streamed(client, messages=USER, tools=TOOLS)
    (sc,) = final.choices
    assert sc.finish_reason == "tool_calls" and sc.message.content == "I'll look both up."
    assert _calls(sc.message) == CALLS
    # OpenAI's shape: a call's first delta has its id, type and name; later ones only arguments.
    firsts = {}
    for chunk in chunks:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                if tc.index not in firsts:
                    firsts[tc.index] = tc
                    assert tc.id and tc.type == "function" and tc.function.name
                else:
                    assert tc.id is None and tc.function.name is None and tc.function.arguments
    assert sorted(firsts) == [0, 1]
    assert sum(1 for c in chunks for ch in c.choices if ch.delta.tool_calls) > 4  # arguments streamed


def test_auto_without_a_call_and_tool_choice_none_are_content(scripted):
    script, _, _, client = scripted
    script.reply = "Paris is sunny today."
    r = client.chat.completions.create(model="scripted-model", messages=USER, tools=TOOLS)
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls, r.choices[0].finish_reason) == (
        "Paris is sunny today.",
        None,
        "stop",
    )
    script.reply = CALLS_REPLY
    r = client.chat.completions.create(model="scripted-model", messages=USER, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == CALLS_REPLY and r.choices[0].message.tool_calls is None
    final, _ = _streamed(client, messages=USER, tools=TOOLS, tool_choice="none")
    assert final.choices[0].message.content == CALLS_REPLY and final.choices[0].finish_reason == "stop"


def test_parallel_tool_calls_false_returns_the_first_call(scripted):
    script, _, _, client = scripted
    script.reply = CALLS_REPLY
    r = client.chat.completions.create(
        model="scripted-model", messages=USER, tools=TOOLS, parallel_tool_calls=False
    )
    assert _calls(r.choices[0].message) == CALLS[:1]
    final, _ = _streamed(client, messages=USER, tools=TOOLS, parallel_tool_calls=False)
    assert _calls(final.choices[0].message) == CALLS[:1]


def test_a_call_cut_by_max_tokens(scripted):
    """Whole: the cut call is content (its JSON is incomplete); streamed: the call went out with the
    arguments written so far; finish_reason "tool_calls" either way, as vLLM."""
    script, engine, _, client = scripted
    script.reply = CALLS_REPLY
    cut = len(
        engine.tokenizer.encode(
            "I'll look both up.\n<tool_call>\n" + '{"name": "get_weather", "arguments": {"ci',
            add_special_tokens=False,
        )
    )
    r = client.chat.completions.create(model="scripted-model", messages=USER, tools=TOOLS, max_tokens=cut)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content.startswith("I'll look both up.\n<tool_call>\n{")
    final, _ = _streamed(client, messages=USER, tools=TOOLS, max_tokens=cut)
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and '{"city": "Paris"'.startswith(call.function.arguments)
    assert final.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_round_trip_call_result_answer(scripted, stream):
    """The call the server returned goes back with its result; the template renders both (checked
    against transformers' rendering of the same conversation) and the answer comes back."""
    script, engine, _, client = scripted
    script.reply = CALLS_REPLY
    first = client.chat.completions.create(model="scripted-model", messages=USER, tools=TOOLS)
    assistant = first.choices[0].message.model_dump(exclude_none=True)
    results = [
        {
            "role": "tool",
            "tool_call_id": c.id,
            "content": json.dumps({"temperature": 21} if i == 0 else {"time": "12:00"}),
        }
        for i, c in enumerate(first.choices[0].message.tool_calls)
    ]
    messages = USER + [assistant] + results
    script.reply = "It is 21 °C in Paris, and 12:00."
    if stream:
        final, _ = _streamed(client, messages=messages, tools=TOOLS)
        message, finish = final.choices[0].message, final.choices[0].finish_reason
    else:
        r = client.chat.completions.create(model="scripted-model", messages=messages, tools=TOOLS)
        message, finish = r.choices[0].message, r.choices[0].finish_reason
    assert (message.content, message.tool_calls, finish) == ("It is 21 °C in Paris, and 12:00.", None, "stop")
    prompt = engine.requests[-1][0]
    expected = engine.tokenizer.apply_chat_template(
        [
            *USER,
            {
                **assistant,
                "tool_calls": [
                    {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                    for c in assistant["tool_calls"]
                ],
            },
            *results,
        ],
        tools=TOOLS,
        chat_template=TEMPLATE,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt == expected
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "units": "celsius"}}\n</tool_call>'
        in prompt
    )
    assert (
        '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response>\n<tool_response>' in prompt
    )
    assert json.dumps(WEATHER, ensure_ascii=False) in prompt  # the tools block


def test_bad_arguments_in_history_is_a_400_naming_them(scripted):
    _, _, _, client = scripted
    messages = USER + [
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{oops"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "12:00"},
    ]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="scripted-model", messages=messages, tools=TOOLS)
    assert e.value.body["param"] == "messages[1].tool_calls[0].function.arguments"


def test_auto_needs_the_flags(scripted):
    _, _, state, client = scripted
    state.enable_auto_tool_choice = False
    try:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="scripted-model", messages=USER, tools=TOOLS)
        assert e.value.body["param"] == "tool_choice" and e.value.body["message"] == AUTO_NEEDS_FLAGS
        # "required" and a named function need no parser.
        client.chat.completions.create(
            model="scripted-model", messages=USER, tools=TOOLS, tool_choice="required"
        )
    finally:
        state.enable_auto_tool_choice = True
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="scripted-model",
            messages=USER,
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
        )
    assert e.value.body["param"] == "tool_choice"


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_decode_under_the_schema_and_read_the_output(scripted, stream):
    """The engine is asked for the schema's constraint (structured_outputs.json); the output it gives
    under that schema is read into tool_calls."""
    script, engine, _, client = scripted

    def ask(**kw):
        if stream:
            final, _ = _streamed(client, messages=USER, tools=TOOLS, **kw)
            return final.choices[0]
        return client.chat.completions.create(
            model="scripted-model", messages=USER, tools=TOOLS, **kw
        ).choices[0]

    script.reply = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}, {"name": "get_time", "parameters": {}}]'
    choice = ask(tool_choice="required")
    assert engine.requests[-1][1].structured_outputs.json == required_schema(TOOLS, parallel_tool_calls=True)
    assert _calls(choice.message) == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
    # Whole: content null; a stream's role chunk carries content "" (as vLLM's), which the SDK keeps.
    assert choice.finish_reason == "tool_calls" and choice.message.content == ("" if stream else None)
    for _, args in _calls(choice.message)[:1]:
        assert _valid(named_schema(WEATHER), args)

    ask(tool_choice="required", parallel_tool_calls=False)
    assert engine.requests[-1][1].structured_outputs.json["maxItems"] == 1

    script.reply = '{"city": "Oslo", "units": "fahrenheit"}'
    choice = ask(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert engine.requests[-1][1].structured_outputs.json == WEATHER["function"]["parameters"]
    assert _calls(choice.message) == [("get_weather", {"city": "Oslo", "units": "fahrenheit"})]
    assert choice.finish_reason == "stop"  # vLLM's finish reason for a named function
    assert re.fullmatch(r"call_[0-9a-f]{24}", choice.message.tool_calls[0].id)


def test_parsers_whose_markers_are_special_tokens_keep_them_in_the_text(scripted):
    script, engine, server, client = scripted
    script.reply = "plain"
    saved = server.tool_call_parser
    try:
        for parser, sent, expected in (
            ("mistral", None, False),
            ("llama3_json", None, False),
            ("mistral", True, True),  # the client's own value wins
            ("hermes", None, True),  # hermes' <tool_call> is text
        ):
            server.tool_call_parser = parser
            extra = {} if sent is None else {"skip_special_tokens": sent}
            client.chat.completions.create(
                model="scripted-model", messages=USER, tools=TOOLS, extra_body=extra
            )
            assert engine.requests[-1][1].skip_special_tokens is expected, parser
    finally:
        server.tool_call_parser = saved
