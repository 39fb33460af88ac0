"""An engine that fails while serving: /health answers 503, a stream in flight gets an OpenAI-shaped error
event and then `data: [DONE]`, a non-streamed request in flight a 500 with an error body, a new request a
503, and the server stops so that its process exits non-zero (as vLLM's server does on EngineDeadError).

In-process, a stand-in engine fails the way AsyncLLMEngine does (its own failure path is tested in
tests/engine/test_async_engine_loop.py); then a real `jaxllm serve` on the embedded model, run as a child
process whose engine step raises on purpose (tests/server/engine_fault_injection.py), must exit with
status 1 after answering both requests it had in flight.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from starlette.testclient import TestClient

from jaxllm.engine_errors import EngineDeadError
from jaxllm.server.app import build_app
from tests.server.engine_fault_injection import INJECTED
from tests.server.mock_engine import MockAsyncEngine
from tests.server.sse import parse_sse

REPO = Path(__file__).resolve().parents[2]


class FailingEngine(MockAsyncEngine):
    """MockAsyncEngine with AsyncLLMEngine's failure contract: once `fail_now` is set, its next step fails
    the engine: `errored` is set, every stream in flight raises EngineDeadError, a later generate() raises
    RuntimeError, and wait_until_failed() returns."""

    def __init__(self):
        super().__init__(step_delay_s=0.01)
        self.errored: BaseException | None = None
        self.fail_now = False  # set from the test's thread; the event loop acts on it at the next step
        self._failed = None

    async def start(self) -> None:
        import asyncio

        self._failed = asyncio.Event()
        await super().start()

    async def wait_until_failed(self) -> BaseException:
        await self._failed.wait()
        return self.errored

    async def generate(self, prompt, sampling_params, request_id, *, priority=0):
        if self.errored is not None:
            raise RuntimeError(f"the engine loop failed: {self.errored!r}")
        async for out in super().generate(prompt, sampling_params, request_id, priority=priority):
            if self.fail_now and self.errored is None:
                self.errored = RuntimeError("device lost")
                self._failed.set()
            if self.errored is not None:
                raise EngineDeadError(f"engine failure: {self.errored!r}")
            yield out


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_after_an_engine_failure_health_is_503_and_requests_get_errors():
    engine = FailingEngine()
    dead_calls = []
    app = build_app(
        engine, disconnect_poll_s=0.05, on_engine_dead=lambda: dead_calls.append(time.monotonic())
    )
    long = {"prompt": "hello world", "max_tokens": 200, "ignore_eos": True}
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        non_streamed = {}
        t = threading.Thread(target=lambda: non_streamed.update(r=client.post("/v1/completions", json=long)))
        t.start()
        _wait_for(lambda: len(engine._active) == 1, 10, "the non-streamed request to run")
        events = []
        with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 3:
                    engine.fail_now = True  # both requests are in flight, the stream has sent tokens
        t.join(timeout=30)

        chunks = parse_sse("\n\n".join(events) + "\n\n")  # ends with data: [DONE]
        assert all(c["choices"][0]["text"] is not None for c in chunks[:3])
        assert chunks[-1] == {
            "error": {
                "message": "the engine failed while serving this request: engine failure: "
                "RuntimeError('device lost')",
                "type": "internal_server_error",
                "param": None,
                "code": None,
            }
        }
        r = non_streamed["r"]
        assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "internal_server_error"

        health = client.get("/health")
        assert health.status_code == 503 and "device lost" in health.json()["error"]["message"]
        for route, body in (
            ("/v1/completions", {"prompt": "hello", "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "stream": True}),
        ):
            refused = client.post(route, json=body)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["type"] == "service_unavailable"
        assert client.get("/v1/models").status_code == 200  # what needs no engine still answers
        assert len(dead_calls) == 1


def test_a_healthy_engine_never_calls_on_engine_dead():
    engine = FailingEngine()
    dead_calls = []
    with TestClient(build_app(engine, on_engine_dead=lambda: dead_calls.append(1))) as client:
        r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and client.get("/health").status_code == 200
    assert dead_calls == []


# ---- a real server, the embedded model, an engine step that raises -----------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_real_server_answers_in_flight_requests_then_exits_non_zero(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "JAX_PLATFORMS": "cpu",
        "JAXLLM_CACHE_DIR": str(tmp_path / "xla"),
    }
    argv = ["serve", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256"]
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115 - read back after the process ends
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests/server/engine_fault_injection.py"), "3", *argv],
        env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        with httpx.Client(base_url=url, timeout=300) as c:

            def up() -> bool:
                assert proc.poll() is None, f"the server exited at start-up: {Path(log.name).read_text()}"
                try:
                    return c.get("/health").status_code == 200
                except httpx.TransportError:
                    return False

            _wait_for(up, 300, "the server to start")
            body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
            lines, non_streamed = [], {}
            t = threading.Thread(target=lambda: non_streamed.update(r=c.post("/v1/completions", json=body)))
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line:
                        continue
                    lines.append(line)
                    if len(lines) == 1:  # the stream has started: now a second request in flight
                        t.start()
            t.join(timeout=300)
        returncode = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = Path(log.name).read_text()
    chunks = parse_sse("\n\n".join(lines) + "\n\n")
    assert len(chunks) >= 2 and "choices" in chunks[0], output[-3000:]
    error = chunks[-1]["error"]
    assert error["type"] == "internal_server_error" and INJECTED in error["message"]
    r = non_streamed["r"]
    assert r.status_code == 500 and INJECTED in r.json()["error"]["message"], r.text
    assert returncode == 1, output[-3000:]
    assert "exiting with status 1 because the engine failed" in output
