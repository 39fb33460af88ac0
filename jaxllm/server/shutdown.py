"""A bounded drain on SIGTERM: uvicorn's shutdown with --shutdown-timeout and exit status 0.

    SIGTERM (or Ctrl-C) --> uvicorn stops its main loop --> shutdown():
        close the listening socket (new connections are refused; a load balancer moves on), end idle
        keep-alive connections, wait for the responses in flight
        --at --shutdown-timeout--> on_drain_timeout(): the engine ends every request still in flight
            (engine.fail_in_flight: a non-streamed one gets a 503, a stream an error event and [DONE]),
            so their connections close with a clean answer
        --a few seconds later, a handler that still has not returned--> uvicorn cancels it (backstop)
        --> the app's lifespan shutdown: the engine thread stops --> serve() returns: exit status 0

uvicorn re-raises the signal it caught once it has shut down, so that the process dies of it; for SIGTERM
that is a status of -15 (143 from a shell), which a supervisor reads as a crash. A drain that ran its
course is a clean exit, so SIGTERM is not re-raised here (Ctrl-C still is: KeyboardInterrupt, as before).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

import uvicorn

logger = logging.getLogger("jaxllm.server")

# After the drain time: how long the handlers get to write the errors of the requests ended at that time
# before uvicorn cancels them.
ERROR_WRITE_GRACE_S = 5.0


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        *,
        shutdown_timeout_s: float,
        on_drain_timeout: Callable[[], int] | None = None,
        in_flight: Callable[[], int] | None = None,
    ):
        """`on_drain_timeout()`: ends the requests still in flight, returns how many; `in_flight()`: how
        many there are (for the log line at the start of the drain)."""
        config.timeout_graceful_shutdown = shutdown_timeout_s + ERROR_WRITE_GRACE_S
        super().__init__(config)
        self.shutdown_timeout_s = shutdown_timeout_s
        self.on_drain_timeout = on_drain_timeout
        self.in_flight = in_flight
        self.terminated = False  # SIGTERM was received

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM:
            self.terminated = True
            self.should_exit = True  # shut down, and exit normally afterwards (module docstring)
            return
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        count = self.in_flight() if self.in_flight is not None else None
        logger.info(
            "shutting down: new connections are refused; %s get up to %g s to finish (--shutdown-timeout)",
            "the requests in flight" if count is None else f"{count} requests in flight",
            self.shutdown_timeout_s,
        )
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout_s, self._drain_time_over)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _drain_time_over(self) -> None:
        if self.on_drain_timeout is None:
            return
        ended = self.on_drain_timeout()
        if ended:
            logger.warning(
                "shutdown: %d requests still in flight after %g s (--shutdown-timeout) end with a 503",
                ended,
                self.shutdown_timeout_s,
            )
