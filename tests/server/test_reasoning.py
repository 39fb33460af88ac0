"""Reasoning parsers: `<think>` text to reasoning_content, hand-computed on outputs of each family, the
same in any split of the stream; then through the server (official openai SDK, a scripted engine that
replays the text token by token, so the tags arrive split over several tokens): reasoning deltas first,
then content, and tool calls read from the content after the reasoning."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from jaxllm.server.app import build_app
from jaxllm.server.reasoning import REASONING_PARSERS
from tests.server.conftest import LiveServer
from tests.server.scripted_engine import ScriptedEngine
from tests.server.test_tool_parsers import _splits

TEMPLATE = (Path(__file__).parent / "data" / "hermes_tools_template.jinja").read_text(encoding="utf-8")

# (parser, output, reasoning_content, content)
CASES = [
    (
        "deepseek_r1",
        "The user wants X.\nSo: Y.\n</think>\n\nThe answer is Y.",
        "The user wants X.\nSo: Y.\n",
        "\n\nThe answer is Y.",
    ),
    ("deepseek_r1", "<think>\nWritten by the model.</think>Answer", "\nWritten by the model.", "Answer"),
    ("deepseek_r1", "Cut short while thinking <", "Cut short while thinking <", None),
    ("deepseek_r1", "</think>Straight to it", None, "Straight to it"),
    ("deepseek_r1", "a </think> b </think> c", "a ", " b </think> c"),
    ("deepseek_r1", "", None, None),
    ("qwen3", "<think>\nLet me think.\n</think>\n\nDone.", "\nLet me think.\n", "\n\nDone."),
    ("qwen3", "No thinking here. <think>x</think>", None, "No thinking here. <think>x</think>"),
    ("qwen3", "<think>\n\n</think>\n\nThinking off.", "\n\n", "\n\nThinking off."),
    ("qwen3", "<think>cut short", "cut short", None),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "", None, None),
]


@pytest.mark.parametrize("family,text,reasoning,content", CASES)
def test_reasoning_parser_whole_and_streamed_in_any_split(family, text, reasoning, content):
    cls = REASONING_PARSERS[family]
    assert cls.extract(text) == (reasoning, content)
    for pieces in _splits(text) if text else [[""]]:
        p = cls()
        r = c = ""
        seen_content = False
        for d in [p.feed(x) for x in pieces] + [p.finish()]:
            assert not (seen_content and d.reasoning), "reasoning after content"
            seen_content |= bool(d.content)
            r, c = r + d.reasoning, c + d.content
        assert (r or None, c or None) == (reasoning, content), pieces


class Script:
    reply = ""

    def __call__(self, prompt, params):
        return self.reply


@pytest.fixture(scope="module")
def scripted():
    script = Script()
    engine = ScriptedEngine(script)
    app = build_app(
        engine,
        chat_template=TEMPLATE,
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        reasoning_parser="deepseek_r1",
    )
    with LiveServer(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        yield script, engine, app.state.server, client


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
THINKING = {"chat_template_kwargs": {"think": True}}


def _stream(client, **kw) -> tuple[list[tuple[str, str]], str | None]:
    """The stream's deltas as (field, text) in order, and the finish reason."""
    out, finish = [], None
    for chunk in client.chat.completions.create(model="scripted-model", stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            for name in ("reasoning_content", "content"):
                piece = getattr(d, name, None)
                if piece:
                    out.append((name, piece))
            finish = ch.finish_reason or finish
    return out, finish


def test_deepseek_r1_split_whole_and_streamed(scripted):
    script, engine, _, client = scripted
    script.reply = "France's capital... that is Paris.\n</think>\n\nThe capital of France is Paris."
    r = client.chat.completions.create(model="scripted-model", messages=MESSAGES, extra_body=THINKING)
    assert engine.requests[-1][0].endswith("<|im_start|>assistant\n<think>\n")  # the template opened it
    m = r.choices[0].message
    assert m.reasoning_content == "France's capital... that is Paris.\n"
    assert m.content == "\n\nThe capital of France is Paris."
    deltas, finish = _stream(client, messages=MESSAGES, extra_body=THINKING)
    assert finish == "stop"
    fields = [f for f, _ in deltas]
    assert fields == sorted(fields, key=lambda f: f != "reasoning_content")  # all reasoning, then content
    assert fields.count("reasoning_content") > 3  # streamed as written, not at the end
    assert "".join(t for f, t in deltas if f == "reasoning_content") == m.reasoning_content
    assert "".join(t for f, t in deltas if f == "content") == m.content


def test_output_cut_while_thinking_is_all_reasoning(scripted):
    script, engine, _, client = scripted
    script.reply = "Long thoughts that go on and on</think>never reached"
    cut = len(engine.tokenizer.encode("Long thoughts that go on", add_special_tokens=False))
    r = client.chat.completions.create(
        model="scripted-model", messages=MESSAGES, max_tokens=cut, extra_body=THINKING
    )
    m = r.choices[0].message
    assert (m.reasoning_content, m.content, r.choices[0].finish_reason) == (
        "Long thoughts that go on",
        None,
        "length",
    )


def test_qwen3_and_tool_calls_after_the_reasoning(scripted):
    script, _, state, client = scripted
    state.reasoning_parser = "qwen3"
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            },
        }
    ]
    try:
        script.reply = "Plain answer, no thinking."
        m = client.chat.completions.create(model="scripted-model", messages=MESSAGES).choices[0].message
        assert (m.reasoning_content, m.content) == (None, "Plain answer, no thinking.")
        script.reply = '<think>\nI should look it up.\n</think>\n\n<tool_call>\n{"name": "lookup", "arguments": {"q": "capital of France"}}\n</tool_call>'
        r = client.chat.completions.create(model="scripted-model", messages=MESSAGES, tools=tools)
        m = r.choices[0].message
        assert m.reasoning_content == "\nI should look it up.\n" and m.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [
            ("lookup", {"q": "capital of France"})
        ]
        assert r.choices[0].finish_reason == "tool_calls"
        reasoning, calls, finish = "", {}, None
        for chunk in client.chat.completions.create(
            model="scripted-model", messages=MESSAGES, tools=tools, stream=True
        ):
            for ch in chunk.choices:
                reasoning += getattr(ch.delta, "reasoning_content", None) or ""
                assert not ch.delta.content  # nothing but whitespace between the tags and the call
                for tc in ch.delta.tool_calls or []:
                    assert not calls or reasoning == m.reasoning_content  # reasoning came first
                    calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments
                finish = ch.finish_reason or finish
        assert reasoning == m.reasoning_content and finish == "tool_calls"
        assert [(n, json.loads(a)) for n, a in calls.values()] == [("lookup", {"q": "capital of France"})]
    finally:
        state.reasoning_parser = "deepseek_r1"
