"""64 simultaneous streaming clients over real HTTP: every stream completes and equals its request's
non-streamed greedy output. Also: disconnects abort, shutdown drains."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx

from server.app import build_app
from tests.server.conftest import LiveServer
from tests.server.sse import finish_reasons, parse_sse, stream_texts

WORDS = "the cat dog sat on mat and ran fast slow red blue green sky sea sun moon star tree river".split()


def _prompt(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + i % 5)) + f" {WORDS[i % 20]}"


def test_64_concurrent_streams_match_non_streamed(live_server):
    async def run():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=live_server.url, timeout=600, limits=limits) as c:

            async def one(i: int, stream: bool):
                chat = i % 2 == 0
                body = {"temperature": 0, "max_tokens": 24, "stream": stream}
                if chat:
                    body["messages"] = [{"role": "user", "content": _prompt(i)}]
                else:
                    body["prompt"] = _prompt(i)
                route = "/v1/chat/completions" if chat else "/v1/completions"
                if not stream:
                    r = await c.post(route, json=body)
                    assert r.status_code == 200, r.text
                    ch = r.json()["choices"][0]
                    return (ch["message"]["content"] if chat else ch["text"]), ch["finish_reason"]
                async with c.stream("POST", route, json=body) as r:
                    assert r.status_code == 200
                    text = "".join([part async for part in r.aiter_text()])
                chunks = parse_sse(text)
                return stream_texts(chunks, chat)[0], finish_reasons(chunks)[0]

            expected = await asyncio.gather(*(one(i, False) for i in range(64)))
            t0 = time.monotonic()
            got = await asyncio.gather(*(one(i, True) for i in range(64)))
            return expected, got, time.monotonic() - t0

    expected, got, elapsed = asyncio.run(run())
    assert got == expected
    assert len({t for t, _ in expected}) > 8  # the prompts really differ


def _raw_request(port: int, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_disconnect_aborts_streaming_and_non_streaming(live_server, live_engine):
    long = {"temperature": 0, "max_tokens": 200, "ignore_eos": True}
    for stream in (True, False):
        before = len(live_engine.abort_calls)
        s = _raw_request(live_server.port, "/v1/completions", {"prompt": "one two", "stream": stream, **long})
        if stream:
            assert s.recv(4096).startswith(b"HTTP/1.1 200")  # streaming started
        else:
            time.sleep(0.1)
        s.close()
        assert _wait_for(lambda b=before: len(live_engine.abort_calls) > b), f"no abort (stream={stream})"
        assert live_engine.abort_calls[-1].startswith("cmpl-")
    assert _wait_for(lambda: live_engine.get_stats().num_requests_running == 0)


def test_disconnect_before_the_first_token_aborts(live_server, live_engine, monkeypatch):
    monkeypatch.setattr(live_engine, "first_step_delay_s", 2.0, raising=False)
    for stream in (True, False):
        before = len(live_engine.abort_calls)
        s = _raw_request(
            live_server.port,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "stream": stream},
        )
        time.sleep(0.2)
        t0 = time.monotonic()
        s.close()
        assert _wait_for(lambda b=before: len(live_engine.abort_calls) > b), f"no abort (stream={stream})"
        assert time.monotonic() - t0 < 1.5  # found by polling, not by the first token arriving
        assert live_engine.abort_calls[-1].startswith("chatcmpl-")


def test_shutdown_drains_running_requests():
    from tests.server.conftest import make_engine

    eng = make_engine()
    server = LiveServer(build_app(eng))
    result = {}
    with server:

        def client():
            with httpx.Client(base_url=server.url, timeout=60) as c:
                body = {
                    "prompt": "one two",
                    "max_tokens": 60,
                    "ignore_eos": True,
                    "stream": True,
                    "temperature": 0,
                    "stream_options": {"include_usage": True},
                }
                with c.stream("POST", "/v1/completions", json=body) as r:
                    result["text"] = "".join(r.iter_text())

        t = threading.Thread(target=client)
        t.start()
        assert _wait_for(lambda: eng.get_stats().num_requests_running == 1)
    t.join(30)
    chunks = parse_sse(result["text"])  # complete, ending in [DONE]
    assert finish_reasons(chunks) == {0: "length"}
    assert chunks[-1]["usage"]["completion_tokens"] == 60 and stream_texts(chunks[:-1], chat=False)[0]
