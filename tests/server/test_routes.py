"""Every route through Starlette's TestClient, checked against the engine's tokenizer and its own
non-streamed output (so the same tests hold for the real engine)."""

from __future__ import annotations

import dataclasses
import math
import re
from types import MappingProxyType

import pytest

from tests.server.sse import finish_reasons, parse_sse, stream_texts

CHAT = [
    {"role": "system", "content": "you are a cat"},
    {"role": "user", "content": "hello world the cat sat"},
]


def test_health_version_models(client, engine):
    assert client.get("/health").status_code == 200
    v = client.get("/version").json()
    assert isinstance(v["version"], str) and v["version"]
    m = client.get("/v1/models").json()
    assert m["object"] == "list"
    assert [d["id"] for d in m["data"]] == [engine.model_name]
    assert m["data"][0]["object"] == "model" and m["data"][0]["max_model_len"] == engine.max_model_len


def test_tokenize_detokenize(client, engine):
    tok = engine.tokenizer
    r = client.post("/tokenize", json={"prompt": "hello world the cat"}).json()
    assert r["tokens"] == tok.encode("hello world the cat") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == engine.max_model_len
    r2 = client.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert r2["prompt"] == tok.decode(r["tokens"])
    chat = client.post("/tokenize", json={"messages": CHAT}).json()
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(text, add_special_tokens=False)


def _complete(client, **kw):
    body = {"model": client.app.state.server.model_name, "prompt": "hello world the cat", "temperature": 0}
    body.update(kw)
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _chat(client, **kw):
    body = {"model": client.app.state.server.model_name, "messages": CHAT, "temperature": 0}
    body.update(kw)
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_shape_and_usage(client, engine):
    r = _complete(client, max_tokens=7, ignore_eos=True)
    assert r["id"].startswith("cmpl-") and r["object"] == "text_completion"
    assert isinstance(r["created"], int) and r["model"] == engine.model_name
    (c,) = r["choices"]
    assert c["index"] == 0 and c["finish_reason"] == "length" and c["logprobs"] is None
    prompt_len = len(engine.tokenizer.encode("hello world the cat"))
    assert r["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 7, "total_tokens": prompt_len + 7}
    assert c["text"]


def test_chat_shape_and_usage(client, engine):
    r = _chat(client, max_tokens=5, ignore_eos=True)
    assert r["id"].startswith("chatcmpl-") and r["object"] == "chat.completion"
    (c,) = r["choices"]
    assert c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str)
    assert c["finish_reason"] == "length" and c["logprobs"] is None
    tok = engine.tokenizer
    prompt_len = len(
        tok.encode(
            tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
    )
    assert r["usage"]["prompt_tokens"] == prompt_len and r["usage"]["completion_tokens"] == 5


def test_max_completion_tokens_wins(client):
    r = _chat(client, max_tokens=9, max_completion_tokens=3, ignore_eos=True)
    assert r["usage"]["completion_tokens"] == 3


def test_greedy_is_deterministic_and_prompt_forms_agree(client, engine):
    a = _complete(client, max_tokens=10)
    ids = engine.tokenizer.encode("hello world the cat")
    b = _complete(client, max_tokens=10, prompt=ids)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    batch = _complete(client, max_tokens=10, prompt=[ids, engine.tokenizer.encode("one two three")], n=2)
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert batch["choices"][0]["text"] == batch["choices"][1]["text"] == a["choices"][0]["text"]
    other = _complete(client, max_tokens=10, prompt="one two three")
    assert batch["choices"][2]["text"] == other["choices"][0]["text"]


def test_seeded_sampling_reproducible(client):
    a = _complete(client, temperature=1.0, seed=7, n=3, max_tokens=12, ignore_eos=True)
    b = _complete(client, temperature=1.0, seed=7, n=3, max_tokens=12, ignore_eos=True)
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert len(a["choices"]) == 3


def test_stop_string_truncates(client):
    full = _complete(client, max_tokens=20, ignore_eos=True)["choices"][0]["text"]
    words = full.split()
    stop = " ".join(words[3:5])
    r = _complete(client, max_tokens=20, ignore_eos=True, stop=[stop, "zzz-never"])
    c = r["choices"][0]
    assert c["finish_reason"] == "stop"
    assert c["text"] == full[: full.index(stop)]
    chunks = parse_sse(
        client.post(
            "/v1/completions",
            json={
                "prompt": "hello world the cat",
                "temperature": 0,
                "max_tokens": 20,
                "ignore_eos": True,
                "stop": stop,
                "stream": True,
            },
        ).text
    )
    assert stream_texts(chunks, chat=False)[0] == c["text"]


def test_echo(client):
    plain = _complete(client, max_tokens=4)["choices"][0]["text"]
    r = _complete(client, max_tokens=4, echo=True)
    assert r["choices"][0]["text"] == "hello world the cat" + plain


def test_completion_logprobs(client, engine):
    r = _complete(client, max_tokens=6, ignore_eos=True, logprobs=3)
    lp = r["choices"][0]["logprobs"]
    assert (
        len(lp["tokens"])
        == len(lp["token_logprobs"])
        == len(lp["top_logprobs"])
        == len(lp["text_offset"])
        == 6
    )
    for tok, tlp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert tlp <= 0.0 and tok in top and 3 <= len(top) <= 4
        # greedy: the chosen token is the most likely one
        assert math.isclose(tlp, max(top.values()))
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    echoed = _complete(client, max_tokens=2, echo=True, logprobs=1)["choices"][0]["logprobs"]
    n_prompt = len(engine.tokenizer.encode("hello world the cat"))
    assert len(echoed["tokens"]) == n_prompt + 2 and echoed["token_logprobs"][0] is None


def test_chat_logprobs(client):
    r = _chat(client, max_tokens=5, ignore_eos=True, logprobs=True, top_logprobs=2)
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert e["bytes"] == list(e["token"].encode())
        assert len(e["top_logprobs"]) == 2
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert tops == sorted(tops, reverse=True)
        assert e["top_logprobs"][0]["token"] == e["token"] and math.isclose(e["logprob"], tops[0])


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_equals_non_streaming(client, chat):
    route = "/v1/chat/completions" if chat else "/v1/completions"
    base = {"temperature": 0, "max_tokens": 12, "n": 2}
    base.update({"messages": CHAT} if chat else {"prompt": "hello world the cat"})
    full = client.post(route, json=base).json()
    r = client.post(route, json={**base, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = parse_sse(r.text)
    obj = "chat.completion.chunk" if chat else "text_completion"
    assert all(c["object"] == obj and c["id"] == chunks[0]["id"] for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    texts = stream_texts(chunks[:-1], chat)
    expected = {c["index"]: (c["message"]["content"] if chat else c["text"]) for c in full["choices"]}
    assert texts == expected
    assert finish_reasons(chunks) == {c["index"]: c["finish_reason"] for c in full["choices"]}
    if chat:
        first = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == 0][0]
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_stream_without_usage_has_no_usage_key(client):
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "stream": True})
    chunks = parse_sse(r.text)
    assert all("usage" not in c for c in chunks)


def test_metrics(client, engine):
    _complete(client, max_tokens=4, ignore_eos=True)
    text = client.get("/metrics").text
    for name in [
        "jaxllm:num_requests_running",
        "jaxllm:num_requests_waiting",
        "jaxllm:kv_cache_usage_perc",
        "jaxllm:gpu_cache_usage_perc",
        "jaxllm:prefix_cache_queries_total",
        "jaxllm:prefix_cache_hits_total",
        "jaxllm:num_preemptions_total",
        "jaxllm:prompt_tokens_total",
        "jaxllm:generation_tokens_total",
        "jaxllm:time_to_first_token_seconds_bucket",
        "jaxllm:inter_token_latency_seconds_bucket",
        "jaxllm:e2e_request_latency_seconds_count",
        "jaxllm:request_queue_time_seconds_count",
        "jaxllm:iteration_tokens_total_bucket",
        "jaxllm:avg_prompt_throughput_toks_per_s",
        "jaxllm:avg_generation_throughput_toks_per_s",
    ]:
        assert name in text, name
    stats = engine.get_stats()
    assert (
        f'jaxllm:generation_tokens_total{{model_name="{engine.model_name}"}} {float(stats.generation_tokens)}'
        in text
    )
    assert (
        f'jaxllm:request_success_total{{finished_reason="length",model_name="{engine.model_name}"}}' in text
    )


def test_metrics_carry_the_cache_config(client, engine):
    """vLLM's cache_config_info: the KV cache's block size, page dtype and block counts, from the engine's
    start-up figures (the mock engine's: an fp8 cache of 64 blocks)."""
    text = client.get("/metrics").text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("jaxllm:cache_config_info{")]
    labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
    assert labels == {
        "model_name": engine.model_name,
        "block_size": "16",
        "cache_dtype": "float8_e4m3fn",
        "num_gpu_blocks": "64",
        "num_cpu_blocks": "0",
    }
    assert line.endswith(" 1.0")


def test_metrics_report_background_compiles(client, engine):
    # As the engine thread does: publish a new snapshot (EngineStats is frozen).
    engine._stats = dataclasses.replace(engine._stats, num_compiling_in_background=3)
    try:
        text = client.get("/metrics").text
        assert f'jaxllm:num_compiling_in_background{{model_name="{engine.model_name}"}} 3.0' in text
    finally:
        engine._stats = dataclasses.replace(engine._stats, num_compiling_in_background=0)
    assert (
        f'jaxllm:num_compiling_in_background{{model_name="{engine.model_name}"}} 0.0'
        in client.get("/metrics").text
    )


def test_metrics_report_engine_steps_and_device_wait(client, engine):
    saved = engine._stats
    engine._stats = dataclasses.replace(
        saved,
        num_steps=42,
        step_device_wait_s=0.25,
        step_host_s=MappingProxyType({"schedule": 0.5, "dispatch": 1.25}),
    )
    try:
        text = client.get("/metrics").text
        assert f'jaxllm:engine_steps_total{{model_name="{engine.model_name}"}} 42.0' in text
        assert f'jaxllm:step_device_wait_seconds_total{{model_name="{engine.model_name}"}} 0.25' in text
        host = f'jaxllm:step_host_seconds_total{{model_name="{engine.model_name}",phase='
        assert host + '"schedule"} 0.5' in text
        assert host + '"dispatch"} 1.25' in text
        assert host + '"process"} 0.0' in text  # not reported yet: zero, not absent
    finally:
        engine._stats = saved


def test_stats_logger_throughput(client, engine):
    from jaxllm.server.metrics import StatsLogger

    logger = StatsLogger(client.app.state.server.metrics)
    before = engine.get_stats().generation_tokens
    _complete(client, max_tokens=8, ignore_eos=True)
    line = logger.tick()
    assert engine.get_stats().generation_tokens - before == 8
    assert "Avg generation throughput" in line and not logger.idle
    assert "jaxllm:avg_generation_throughput_toks_per_s" in client.get("/metrics").text
    assert client.app.state.server.metrics.generation_throughput._value.get() > 0
    logger.tick()
    assert logger.idle  # nothing ran since
