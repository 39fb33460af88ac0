"""The engine's failure as the server sees it (vLLM's name): a plain type, so the server can tell it apart
without importing the engine (which imports jax).

    engine thread: step() raises --> AsyncLLMEngine.errored = the exception
        every request in flight: its stream raises EngineDeadError     (the server answers 500 / an SSE error)
        every later generate(): RuntimeError "the engine loop failed"  (the server answers 503)
        wait_until_failed() returns                                     (the server exits non-zero)
    shutdown past its drain time: every request in flight: its stream raises EngineShutdownError (a 503 /
        an SSE error event); the process exits 0
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop failed while this request was in flight: nothing more will come for it. A server
    fault, not the client's; the engine takes no further requests and the process should be restarted."""


class EngineOverloadedError(RuntimeError):
    """The engine already holds --max-num-queued-reqs sequences (waiting or running): this request was not
    taken. Nothing is wrong with it or the engine; the server answers 503 with Retry-After so that the
    client (or a load balancer) tries again later or elsewhere, instead of the queue growing unbounded."""

    def __init__(self, message: str, limit: int):
        super().__init__(message)
        self.limit = limit


class EngineShutdownError(RuntimeError):
    """The server shut down (SIGTERM, past --shutdown-timeout) while this request was in flight: nothing
    more will come for it. Not the client's fault; another replica can serve it (the server answers 503)."""
