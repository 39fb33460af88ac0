"""Tool calling and reasoning on the real engine and the embedded SmolLM2-135M-Instruct, through the
official openai SDK, with a hermes-style chat template that renders tools (data/hermes_tools_template.jinja)
and the hermes parser:
- tool_choice "required" and a named function give tool_calls whose arguments validate against the
  function's schema;
- an earlier call and its result go back through the template: the prompt is transformers' rendering
  of the conversation (its token count, and the answer equals /v1/completions on that text), the answer
  streamed equals the answer whole;
- the model writes no tool-call markers by itself: "auto" gives the content "none" gives;
- reasoning: with the template opening <think>, deepseek_r1 makes the whole answer reasoning_content
  (the model writes no </think>); qwen3 leaves an answer without <think> as content.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest

from jaxllm.engine.async_engine import AsyncLLMEngine
from jaxllm.engine_args import EngineArgs
from jaxllm.server.app import build_app
from tests.server.conftest import LiveServer

TEMPLATE = (Path(__file__).parent / "data" / "hermes_tools_template.jinja").read_text(encoding="utf-8")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "units": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "units"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def real():
    args = EngineArgs(
        max_model_len=1024, num_gpu_blocks_override=512, max_num_seqs=8, max_num_batched_tokens=1024
    )
    engine = AsyncLLMEngine.from_engine_args(args)
    app = build_app(
        engine,
        chat_template=TEMPLATE,
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        disconnect_poll_s=0.05,
    )
    with LiveServer(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        yield client, engine, app.state.server, client.models.list().data[0].id


def _stream(client, **kw):
    """(content, reasoning_content, {index: [name, arguments]}, finish_reason) of a stream."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            for tc in ch.delta.tool_calls or []:
                calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, reasoning, calls, finish


def test_required_and_named_always_give_valid_arguments(real):
    client, _, _, model = real
    common = dict(model=model, messages=USER, tools=TOOLS, temperature=0, max_tokens=200)
    r = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **common)
    (call,) = r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert r.choices[0].finish_reason == "tool_calls"
    _, _, calls, finish = _stream(client, tool_choice="required", parallel_tool_calls=False, **common)
    assert [v for v in calls.values()] == [
        [call.function.name, call.function.arguments]
    ] and finish == "tool_calls"
    prompts = ("Weather in Oslo for three days?", "What time is it in Berlin?", "Hello!")
    named = [(prompt, name) for prompt in prompts for name in SCHEMAS]

    def named_call(prompt: str, name: str):
        kw = {**common, "messages": [{"role": "user", "content": prompt}]}
        return client.chat.completions.create(
            tool_choice={"type": "function", "function": {"name": name}}, **kw
        )

    with ThreadPoolExecutor(len(named)) as pool:  # decoded in one batch: the same tokens as one by one
        answers = list(pool.map(lambda pn: named_call(*pn), named))
    for (_, name), r in zip(named, answers, strict=True):
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == name and r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[name])
    # The round trip from a call the engine made.
    r = client.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, **common
    )
    assistant = r.choices[0].message.model_dump(exclude_none=True)
    result = {
        "role": "tool",
        "tool_call_id": assistant["tool_calls"][0]["id"],
        "content": '{"temperature": 21}',
    }
    answer = client.chat.completions.create(
        model=model,
        messages=USER + [assistant, result],
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=24,
    )
    assert answer.choices[0].message.content


def test_round_trip_through_the_template(real):
    client, engine, _, model = real
    call = {
        "id": "call_0123456789abcdef01234567",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "units": "celsius"}'},
    }
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    kw = dict(model=model, messages=messages, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=24)
    whole = client.chat.completions.create(**kw)
    content, _, calls, finish = _stream(client, **kw)
    assert (content, calls, finish) == (whole.choices[0].message.content, {}, whole.choices[0].finish_reason)
    assert whole.choices[0].message.content
    tok = engine.tokenizer
    rendered = tok.apply_chat_template(
        [
            *USER,
            {
                **messages[1],
                "tool_calls": [
                    {
                        **call,
                        "function": {
                            **call["function"],
                            "arguments": json.loads(call["function"]["arguments"]),
                        },
                    }
                ],
            },
            messages[2],
        ],
        tools=TOOLS,
        chat_template=TEMPLATE,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert '"arguments": {"city": "Paris", "units": "celsius"}' in rendered and "<tool_response>" in rendered
    assert whole.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    ref = client.completions.create(model=model, prompt=rendered, temperature=0, max_tokens=24)
    assert ref.choices[0].text == whole.choices[0].message.content


def test_auto_on_an_answer_without_calls_is_its_content(real):
    client, _, _, model = real
    kw = dict(model=model, messages=USER, tools=TOOLS, temperature=0, max_tokens=24)
    plain = client.chat.completions.create(tool_choice="none", **kw).choices[0]
    auto = client.chat.completions.create(**kw).choices[0]
    assert "<tool_call>" not in plain.message.content  # the model writes no markers by itself
    assert (auto.message.content, auto.message.tool_calls, auto.finish_reason) == (
        plain.message.content,
        None,
        plain.finish_reason,
    )
    content, _, calls, finish = _stream(client, **kw)
    assert (content, calls, finish) == (plain.message.content, {}, plain.finish_reason)


def test_reasoning_split_on_the_embedded_model(real):
    client, _, state, model = real
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": "Why is the sky blue?"}],
        temperature=0,
        max_tokens=24,
    )
    think = {"chat_template_kwargs": {"think": True}}
    plain_think = client.chat.completions.create(extra_body=think, **kw).choices[0].message.content
    plain = client.chat.completions.create(**kw).choices[0].message.content
    try:
        state.reasoning_parser = "deepseek_r1"
        m = client.chat.completions.create(extra_body=think, **kw).choices[0].message
        assert "</think>" not in plain_think
        assert (m.reasoning_content, m.content) == (plain_think, None)
        content, reasoning, _, _ = _stream(client, extra_body=think, **kw)
        assert (reasoning, content) == (plain_think, "")
        state.reasoning_parser = "qwen3"
        m = client.chat.completions.create(**kw).choices[0].message
        assert not plain.startswith("<think>") and (m.reasoning_content, m.content) == (None, plain)
    finally:
        state.reasoning_parser = None
