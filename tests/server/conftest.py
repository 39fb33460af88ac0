"""Fixtures: the engine (a mock by default: swap `make_engine` for the real one), an in-process
TestClient app, and a real uvicorn server on 127.0.0.1 (a free port) in a thread, always shut down."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import uvicorn
from starlette.testclient import TestClient

from jaxllm.server.app import build_app
from tests.server.mock_engine import MockAsyncEngine


def make_engine():
    """The engine under test: the mock, or with JAXLLM_SERVER_TEST_ENGINE=real the real engine on the
    embedded model (slow on a CPU: minutes of compilation per engine, three engines)."""
    if os.environ.get("JAXLLM_SERVER_TEST_ENGINE") == "real":
        from jaxllm.engine.async_engine import AsyncLLMEngine
        from jaxllm.engine_args import EngineArgs

        return AsyncLLMEngine.from_engine_args(EngineArgs(max_model_len=512))
    return MockAsyncEngine()


def record_aborts(engine):
    """Makes `engine.abort_calls` list every aborted request id, whatever the engine."""
    if hasattr(engine, "abort_calls"):
        return engine
    engine.abort_calls = []
    inner = engine.abort

    async def abort(request_id: str) -> None:
        engine.abort_calls.append(request_id)
        await inner(request_id)

    engine.abort = abort
    return engine


# Two engines: an engine's background loop lives on the event loop that started it, and the TestClient
# and the uvicorn thread each run their own loop.
@pytest.fixture(scope="session")
def engine():
    return record_aborts(make_engine())


@pytest.fixture(scope="session")
def client(engine):
    with TestClient(build_app(engine, disconnect_poll_s=0.05)) as c:
        yield c


@pytest.fixture
def settings(client):
    """Changes ServerState fields (api_key, max_request_body_bytes, ...) of the client's app for one test."""
    state = client.app.state.server
    saved = {}

    def set_(**kw):
        for k, v in kw.items():
            saved.setdefault(k, getattr(state, k))
            setattr(state, k, v)

    yield set_
    for k, v in saved.items():
        setattr(state, k, v)


@pytest.fixture(scope="session")
def live_engine():
    return record_aborts(make_engine())


class LiveServer:
    def __init__(self, app):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=30)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=60)
        self.sock.close()


@pytest.fixture(scope="session")
def live_server(live_engine):
    with LiveServer(build_app(live_engine, disconnect_poll_s=0.05)) as s:
        yield s
