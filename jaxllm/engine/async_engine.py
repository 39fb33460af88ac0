"""AsyncLLMEngine: one background task drives `LLMEngine.step()`; each request streams its outputs.

    generate() -- validate (raises ValueError at once) --> pending queue --> [loop] enqueue between steps
    [loop] step() in a worker thread --> RequestOutputs --> per-request asyncio.Queue --> the caller's stream
    (the next step() is already running in the worker while the streams handle these outputs)

The engine itself is touched only by the loop (adds and aborts are applied between steps), so the device
step can run in a thread while the event loop keeps serving. A stream that is closed before its request
finishes (a client disconnect) aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import AsyncIterator

from jaxllm.config import EngineConfig
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams
from jaxllm.stats import EngineStats

logger = logging.getLogger("jaxllm")


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, served_model_name: str | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = (
            served_model_name or engine.config.model.served_model_name or engine.loaded.model_name
        )
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.loaded.arch.vocab_size
        self.startup_info = dict(engine.startup_info, served_model_name=self.model_name)
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending_adds: list = []
        self._pending_aborts: list[str] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="jaxllm-step"
        )
        self.iteration_tokens: list[int] = []  # tokens per step since the last read (for metrics)
        self.errored: BaseException | None = None

    @classmethod
    def from_config(
        cls, config: EngineConfig, *, user_set: frozenset[str] = frozenset(), usage: str = "server"
    ) -> AsyncLLMEngine:
        return cls(LLMEngine(config, user_set=user_set, usage=usage))

    # ---- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.create_task(self._run(), name="jaxllm-engine-loop")

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Stop taking requests, let running ones finish (up to the timeout), then stop the loop."""
        self._stopping = True
        if self._task is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout_s
        while self._queues and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self._queues):
            await self.abort(rid)
        self._task.cancel()
        try:
            await self._task
        except (asyncio.CancelledError, Exception):
            pass
        self._task = None
        self._executor.shutdown(wait=True)

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    # ---- requests ------------------------------------------------------------------------------------
    def generate(
        self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str, *, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        if self._stopping:
            raise RuntimeError("the engine is shutting down")
        if self.errored is not None:
            raise RuntimeError(f"the engine loop failed: {self.errored!r}")
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        parent = self.engine.prepare_request(request_id, prompt, sampling_params, priority=priority)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        self._pending_adds.append(parent)
        if self._wakeup is not None:
            self._wakeup.set()
        return self._stream(request_id, q)

    async def _stream(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        if self._queues.pop(request_id, None) is not None:
            self._pending_aborts.append(request_id)
            if self._wakeup is not None:
                self._wakeup.set()

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    # ---- the loop ------------------------------------------------------------------------------------
    def _apply_pending(self) -> None:
        adds, self._pending_adds = self._pending_adds, []
        for parent in adds:
            if parent.request_id in self._queues:
                self.engine.enqueue(parent)
        aborts, self._pending_aborts = self._pending_aborts, []
        if aborts:
            self.engine.abort_request(aborts)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._apply_pending()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.clear()
                    if self._pending_adds or self._pending_aborts:
                        continue
                    await self._wakeup.wait()
                    continue
                step = loop.run_in_executor(self._executor, self.engine.step)
                while step is not None:
                    outputs = await step
                    self.iteration_tokens.append(self.engine.last_step_tokens)
                    if len(self.iteration_tokens) > 10_000:  # nobody is reading: keep the newest
                        del self.iteration_tokens[:5_000]
                    # The next step starts before the streams see this one's outputs: their work (SSE
                    # chunks, JSON) then overlaps the step's device time instead of delaying its start.
                    self._apply_pending()
                    step = (
                        loop.run_in_executor(self._executor, self.engine.step)
                        if self.engine.has_unfinished_requests()
                        else None
                    )
                    self._deliver(outputs)
                    if step is None:
                        await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a failed step must not leave clients waiting forever
            logger.exception("engine loop failed")
            self.errored = e
            for q in self._queues.values():
                q.put_nowait(RuntimeError(f"engine failure: {e!r}"))
            self._queues.clear()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)
                if out.finished:
                    self._queues.pop(out.request_id, None)
