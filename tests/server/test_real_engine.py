"""The server on the real engine and the embedded SmolLM2-135M-Instruct: the official openai client gets a
sensible chat answer, and 64 simultaneous streaming clients each receive exactly their request's
non-streamed greedy output."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from jaxllm.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from jaxllm.engine.async_engine import AsyncLLMEngine
from server.app import build_app
from tests.server.conftest import LiveServer
from tests.server.sse import finish_reasons, parse_sse, stream_texts

PROMPTS = [
    "The capital of France is",
    "List three colors:",
    "Once upon a time",
    "The best way to learn programming is",
    "Water boils at",
    "My favourite animal is",
    "In 1969, humans",
    "A haiku about autumn:",
]


@pytest.fixture(scope="module")
def real_server():
    config = EngineConfig(
        model=ModelSpec(max_model_len=512),
        cache=CacheConfig(num_gpu_blocks_override=2048),
        scheduler=SchedulerConfig(max_model_len=512, max_num_seqs=64, max_num_batched_tokens=512),
    )
    engine = AsyncLLMEngine.from_config(
        config, user_set=frozenset({"max_model_len", "max_num_seqs", "max_num_batched_tokens"})
    )
    with LiveServer(build_app(engine, disconnect_poll_s=0.05)) as s:
        yield s


def test_openai_client_chat_on_the_embedded_model(real_server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{real_server.url}/v1", api_key="EMPTY", timeout=600)
    model = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=16,
    )
    assert "Paris" in r.choices[0].message.content
    assert r.usage.completion_tokens <= 16 and r.usage.prompt_tokens > 5


def test_64_streams_equal_non_streamed_on_the_embedded_model(real_server):
    async def run():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=real_server.url, timeout=900, limits=limits) as c:

            async def one(i: int, stream: bool):
                chat = i % 2 == 0
                body = {"temperature": 0, "max_tokens": 10, "stream": stream}
                text = f"{PROMPTS[i % len(PROMPTS)]} ({i})"
                if chat:
                    body["messages"] = [{"role": "user", "content": text}]
                else:
                    body["prompt"] = text
                route = "/v1/chat/completions" if chat else "/v1/completions"
                if not stream:
                    r = await c.post(route, json=body)
                    assert r.status_code == 200, r.text
                    ch = r.json()["choices"][0]
                    return (ch["message"]["content"] if chat else ch["text"]), ch["finish_reason"]
                async with c.stream("POST", route, json=body) as r:
                    assert r.status_code == 200
                    raw = "".join([part async for part in r.aiter_text()])
                chunks = parse_sse(raw)
                assert raw.rstrip().endswith("data: [DONE]")
                return stream_texts(chunks, chat)[0], finish_reasons(chunks)[0]

            expected = await asyncio.gather(*(one(i, False) for i in range(64)))
            got = await asyncio.gather(*(one(i, True) for i in range(64)))
            return expected, got

    expected, got = asyncio.run(run())
    assert got == expected
    assert len({t for t, _ in expected}) > 8
