"""The official `openai` package against a real uvicorn process serving the app (127.0.0.1, free port)."""

from __future__ import annotations

import math

import openai
import pytest

MESSAGES = [{"role": "user", "content": "hello world the cat sat on the mat"}]


@pytest.fixture(scope="module")
def oai(live_server):
    with openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def test_models(oai, live_engine):
    assert [m.id for m in oai.models.list().data] == [live_engine.model_name]


def test_chat_sync_and_stream(oai, live_engine):
    r = oai.chat.completions.create(
        model=live_engine.model_name, messages=MESSAGES, temperature=0, max_tokens=12
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert c.message.role == "assistant" and c.finish_reason in ("stop", "length")
    assert (
        r.usage.completion_tokens >= 1
        and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    )
    stream = oai.chat.completions.create(
        model=live_engine.model_name,
        messages=MESSAGES,
        temperature=0,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert text == c.message.content and finish == c.finish_reason
    assert usage.completion_tokens == r.usage.completion_tokens


def test_completions_sync_and_stream(oai, live_engine):
    r = oai.completions.create(
        model=live_engine.model_name, prompt="one two three", temperature=0, max_tokens=10
    )
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    stream = oai.completions.create(
        model=live_engine.model_name, prompt="one two three", temperature=0, max_tokens=10, stream=True
    )
    text = "".join(ch.text for chunk in stream for ch in chunk.choices)
    assert text == r.choices[0].text


def test_n_and_seed(oai, live_engine):
    r = oai.chat.completions.create(
        model=live_engine.model_name, messages=MESSAGES, n=3, temperature=1.0, seed=11, max_tokens=8
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    again = oai.chat.completions.create(
        model=live_engine.model_name, messages=MESSAGES, n=3, temperature=1.0, seed=11, max_tokens=8
    )
    assert [c.message.content for c in r.choices] == [c.message.content for c in again.choices]
    stream = oai.completions.create(
        model=live_engine.model_name, prompt="one two", n=2, temperature=0, max_tokens=6, stream=True
    )
    texts: dict[int, str] = {}
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert set(texts) == {0, 1} and texts[0] == texts[1]


def test_stop(oai, live_engine):
    kw = dict(
        model=live_engine.model_name,
        prompt="one two three",
        temperature=0,
        max_tokens=20,
        extra_body={"ignore_eos": True},
    )
    full = oai.completions.create(**kw).choices[0].text
    stop = full.split()[4]
    r = oai.completions.create(stop=[stop], **kw).choices[0]
    assert r.finish_reason == "stop" and r.text == full[: full.index(stop)]


def test_logprobs(oai, live_engine):
    r = oai.chat.completions.create(
        model=live_engine.model_name,
        messages=MESSAGES,
        temperature=0,
        max_tokens=5,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(e.top_logprobs) == 3 for e in content)
    assert "".join(e.token for e in content).replace(" ", "") == r.choices[0].message.content.replace(" ", "")
    c = oai.completions.create(
        model=live_engine.model_name, prompt="one two", temperature=0, max_tokens=4, logprobs=2
    )
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(c.choices[0].logprobs.top_logprobs)
    assert all(math.isfinite(x) and x <= 0 for x in lp.token_logprobs)


def test_errors_raise_openai_exceptions(oai, live_engine):
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="missing", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=live_engine.model_name, prompt="x", temperature=-1)
    assert "temperature" in str(e.value)
