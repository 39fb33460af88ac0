"""64 simultaneous streaming clients over real HTTP: every stream completes and equals its request's
non-streamed greedy output. Also: disconnects abort, shutdown drains."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx

from jaxllm.server.app import build_app
from tests.server.conftest import LiveServer
from tests.server.sse import finish_reasons, parse_sse, stream_texts, streams_and_non_streamed

WORDS = "the cat dog sat on mat and ran fast slow red blue green sky sea sun moon star tree river".split()


def _prompt(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + i % 5)) + f" {WORDS[i % 20]}"


def test_64_concurrent_streams_match_non_streamed(live_server):
    expected, got = streams_and_non_streamed(live_server.url, _prompt, 64, 24)
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
