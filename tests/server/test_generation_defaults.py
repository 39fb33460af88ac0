"""The server applies the model's sampling defaults (--generation-config) to the fields a request leaves
out, on the chat and completions routes; what the client sends wins. Checked on the SamplingParams that
reach the engine: first the body rule alone, then a real engine on a tiny HF folder whose
generation_config.json sets them."""

from __future__ import annotations

import json
import os

import pytest
from starlette.testclient import TestClient

from jaxllm.server.app import build_app
from jaxllm.server.protocol import with_sampling_defaults

DEFAULTS = {"temperature": 0.0, "top_k": 5, "max_tokens": 7}


def test_only_omitted_fields_are_filled():
    body = {"prompt": "x", "temperature": 0.9, "top_k": None}
    assert with_sampling_defaults(body, DEFAULTS, chat=False) == {
        "prompt": "x",
        "temperature": 0.9,  # given
        "top_k": 5,  # null counts as left out
        "max_tokens": 7,
    }
    assert body == {"prompt": "x", "temperature": 0.9, "top_k": None}  # the client's dict is not changed
    chat = {"messages": [], "max_completion_tokens": 3}
    assert with_sampling_defaults(chat, DEFAULTS, chat=True) == {**chat, "temperature": 0.0, "top_k": 5}
    assert with_sampling_defaults(chat, {}, chat=True) is chat


class Recorder:
    """Wraps an engine's generate() to keep the SamplingParams each request reached it with."""

    def __init__(self, engine):
        self.params = []
        self.inner = engine.generate
        engine.generate = self

    def __call__(self, prompt, sampling_params, request_id, **kw):
        self.params.append(sampling_params)
        return self.inner(prompt, sampling_params, request_id, **kw)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """A real engine on a tiny HF folder whose generation_config.json sets temperature, top_k and
    max_new_tokens."""
    from jaxllm.engine.async_engine import AsyncLLMEngine
    from jaxllm.engine_args import EngineArgs
    from jaxllm.testing.tiny_models import save_tiny_llama

    folder = save_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama_generation_config")))
    with open(os.path.join(folder, "generation_config.json")) as f:
        config = json.load(f)
    config.update(do_sample=True, temperature=0.0, top_k=5, max_new_tokens=7)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(config, f)
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(
            model=folder,
            dtype="float32",
            max_model_len=128,
            compilation_cache_dir=str(tmp_path_factory.mktemp("xla")),
        )
    )
    assert engine.sampling_defaults == DEFAULTS
    recorder = Recorder(engine)
    with TestClient(build_app(engine, disconnect_poll_s=0.05)) as client:
        yield client, recorder


def _last(recorder):
    return recorder.params[-1]


def test_completions_take_the_models_defaults(real):
    client, recorder = real
    r = client.post("/v1/completions", json={"prompt": [5, 6, 7, 8]})
    assert r.status_code == 200, r.text
    p = _last(recorder)
    assert (p.temperature, p.top_k, p.max_tokens, p.top_p) == (0.0, 5, 7, 1.0)  # top_p: not in the file
    assert r.json()["usage"]["completion_tokens"] <= 7
    r = client.post(
        "/v1/completions",
        json={"prompt": [5, 6, 7, 8], "temperature": 0.9, "top_k": -1, "max_tokens": 3, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    p = _last(recorder)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.9, -1, 3)
    assert r.json()["usage"]["completion_tokens"] == 3


def test_chat_takes_the_models_defaults(real):
    client, recorder = real
    messages = [{"role": "user", "content": "hello"}]
    r = client.post("/v1/chat/completions", json={"messages": messages})
    assert r.status_code == 200, r.text
    p = _last(recorder)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.0, 5, 7)
    r = client.post(
        "/v1/chat/completions", json={"messages": messages, "temperature": 1.0, "max_completion_tokens": 2}
    )
    assert r.status_code == 200, r.text
    p = _last(recorder)
    assert (p.temperature, p.top_k, p.max_tokens) == (1.0, 5, 2)
