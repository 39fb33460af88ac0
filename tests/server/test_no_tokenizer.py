"""A model without a tokenizer (random weights from a preset) serves token-id prompts; text prompts are a
clear 400 naming the field, never a 500."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from jaxllm.server.app import build_app


@pytest.fixture(scope="module")
def client():
    from jaxllm.engine.async_engine import AsyncLLMEngine
    from jaxllm.engine_args import EngineArgs

    args = EngineArgs(
        model="tiny-llama", load_format="dummy", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64
    )
    engine = AsyncLLMEngine.from_engine_args(args)
    assert engine.tokenizer is None
    with TestClient(build_app(engine, disconnect_poll_s=0.05)) as c:
        yield c


def test_token_id_prompt_is_served(client):
    r = client.post(
        "/v1/completions",
        json={
            "model": "tiny-llama",
            "prompt": [5, 6, 7, 8],
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["text"] == ""


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hello"}, "prompt"),
        ("/v1/completions", {"prompt": [1, 512]}, "prompt"),  # the model's vocabulary is 512 ids
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ("/tokenize", {"prompt": "hello"}, "prompt"),
        ("/detokenize", {"tokens": [1, 2]}, "tokens"),
    ],
)
def test_text_needs_a_tokenizer(client, path, body, param):
    r = client.post(path, json={"model": "tiny-llama", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
