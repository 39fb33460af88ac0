"""The engine's failure as the server sees it (vLLM's name): a plain type, so the server can tell it apart
without importing the engine (which imports jax).

    engine thread: step() raises --> AsyncLLMEngine.errored = the exception
        every request in flight: its stream raises EngineDeadError     (the server answers 500 / an SSE error)
        every later generate(): RuntimeError "the engine loop failed"  (the server answers 503)
        wait_until_failed() returns                                     (the server exits non-zero)
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop failed while this request was in flight: nothing more will come for it. A server
    fault, not the client's; the engine takes no further requests and the process should be restarted."""
