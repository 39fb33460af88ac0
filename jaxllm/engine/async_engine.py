"""AsyncLLMEngine: a thread of its own drives `LLMEngine.step()` back to back; each request streams its outputs.

    generate() -- validate (raises ValueError at once) [-- a new structured-outputs grammar: compiled on an
        executor thread, an invalid one fails the stream] --> pending adds --> [engine thread] enqueue between steps
    [engine thread] step() --> RequestOutputs --> call_soon_threadsafe --> per-request asyncio.Queue --> stream
    [engine thread] after each step: a fresh immutable EngineStats --> `get_stats()` on the event loop

The engine thread never waits for the event loop: it applies adds and aborts between steps, steps, hands
the outputs to the loop and steps again. The loop's work for those outputs (SSE chunks, JSON, sockets)
then runs beside the next steps instead of between them; when the loop started each step, every step
also waited for the loop's work on the previous one. The two threads still share the GIL: with Python's
default 5 ms switch interval the HTTP work delays the step thread just as much, so the server sets a
short one (`--gil-switch-interval-ms`, jaxllm/server/args.py).

Nothing mutable is shared between the threads. The engine (scheduler, runner, output processor) is
touched only by the engine thread (`prepare_request`, which validates and tokenizes, is the exception:
it reads no state a step changes). The loop gets RequestOutputs the engine no longer touches, and reads
the engine's counters only through the latest published `EngineStats` snapshot (replacing one reference
is atomic), never the scheduler's lists. A stream that is closed before its request finishes (a client
disconnect) aborts the request and frees its blocks.

A step that raises ends the thread: `errored` holds the exception, every stream in flight raises
EngineDeadError, later `generate()` calls raise RuntimeError, and `wait_until_failed()` returns (the server
then answers 503 on /health and exits so that a supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator

from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.engine_args import EngineArgs
from jaxllm.engine_errors import EngineDeadError, EngineOverloadedError, EngineShutdownError
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams
from jaxllm.stats import EngineStats, IterationTokens

logger = logging.getLogger("jaxllm")
# While idle with background compiles left, the stats are published this often (seconds).
IDLE_STATS_INTERVAL_S = 0.25


class AsyncLLMEngine:
    def __init__(
        self, engine: LLMEngine, served_model_name: str | None = None, max_num_queued_reqs: int | None = None
    ):
        """`max_num_queued_reqs` (vLLM's --max-num-queued-reqs): the most sequences (a request with n > 1
        counts n) waiting or running at once; past it generate() raises EngineOverloadedError. None: no
        bound."""
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = served_model_name or engine.loaded.model_name
        self.sampling_defaults = engine.sampling_defaults  # for requests that leave fields out
        self.max_model_len = engine.max_model_len
        self.max_kv_tokens = engine.max_kv_tokens  # the whole KV cache, in tokens
        self.max_num_queued_reqs = max_num_queued_reqs
        self.vocab_size = engine.loaded.arch.vocab_size
        self.startup_info = dict(engine.startup_info, served_model_name=self.model_name)
        self._queues: dict[str, asyncio.Queue] = {}  # the event loop's alone
        self._num_seqs: dict[str, int] = {}  # request id -> its n, for each request in _queues
        # The hand-over to the engine thread: adds (a prepared request) and aborts (a request id) in the
        # order they happened, swapped out under the lock.
        self._lock = threading.Lock()
        self._pending: list = []
        self._work = threading.Event()  # set when there is something for an idle engine thread
        self._halt = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._iterations = IterationTokens()  # the engine thread's; published inside each snapshot
        # The latest snapshot of the engine's counters: written only by the engine thread (and here, before
        # it starts), read by the event loop.
        self._stats: EngineStats = self._snapshot()
        self.errored: BaseException | None = None  # set by the engine thread when a step raised
        # Set on the event loop once every stream has been failed; made by start(), on the loop it serves.
        self._failed: asyncio.Event | None = None

    @classmethod
    def from_engine_args(
        cls, args: EngineArgs, *, served_model_name: str | None = None, usage: str = "server"
    ) -> AsyncLLMEngine:
        return cls(LLMEngine.from_engine_args(args, usage), served_model_name, args.max_num_queued_reqs)

    # ---- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._failed = asyncio.Event()
            self._halt = False
            self._thread = threading.Thread(target=self._run, name="jaxllm-engine", daemon=True)
            self._thread.start()

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Stop taking requests, let running ones finish (up to the timeout), end the rest with
        EngineShutdownError, then stop the thread."""
        self._stopping = True
        if self._thread is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout_s
        while self._queues and loop.time() < deadline and self._thread.is_alive():
            await asyncio.sleep(0.05)
        self.fail_in_flight("the server shut down before this request finished")
        self._halt = True
        self._work.set()
        thread, self._thread = self._thread, None
        await loop.run_in_executor(None, thread.join)

    @property
    def is_running(self) -> bool:
        """The engine thread is stepping: started, not stopped, and not failed (a failed thread may take a
        moment to end after it has failed every stream)."""
        return self._thread is not None and self._thread.is_alive() and self.errored is None

    async def wait_until_failed(self) -> BaseException:
        """Returns the exception that ended the engine loop, once every stream in flight has been given
        its EngineDeadError; never returns while the engine is healthy. Call it after start()."""
        if self._failed is None:
            raise RuntimeError("wait_until_failed() before start()")
        await self._failed.wait()
        assert self.errored is not None
        return self.errored

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
        limit = self.max_num_queued_reqs
        if limit is not None and self.num_queued_seqs + sampling_params.n > limit:
            raise EngineOverloadedError(
                f"the server is at its limit of {limit} queued sequences (--max-num-queued-reqs); "
                "try again later",
                limit,
            )
        parent = self.engine.prepare_request(
            request_id, prompt, sampling_params, priority=priority, compile_grammar=False
        )
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        self._num_seqs[request_id] = sampling_params.n
        so = sampling_params.structured_outputs
        if so is not None and self.engine.grammars.cached(so) is None:
            # A new grammar compiles on an executor thread (llguidance drops the GIL): neither the event loop
            # nor the engine's steps wait for it. An invalid one fails the stream before its first output.
            return self._stream_after_compile(parent, sampling_params, q)
        self._hand_over(parent)
        return self._stream(request_id, q)

    def _hand_over(self, parent) -> None:
        with self._lock:
            self._pending.append(parent)
        self._work.set()

    async def _stream_after_compile(
        self, parent, params: SamplingParams, q: asyncio.Queue
    ) -> AsyncIterator[RequestOutput]:
        request_id = parent.request_id
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.compile_grammar, params)
        except BaseException:
            self._forget(request_id)
            raise
        if self._queues.get(request_id) is not q:  # aborted while compiling
            return
        self._hand_over(parent)
        async for out in self._stream(request_id, q):
            yield out

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

    @property
    def num_queued_seqs(self) -> int:
        """Sequences of the requests this engine holds (taken, not yet finished or aborted)."""
        return sum(self._num_seqs.values())

    def _forget(self, request_id: str) -> asyncio.Queue | None:
        self._num_seqs.pop(request_id, None)
        return self._queues.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        if self._forget(request_id) is not None:
            with self._lock:
                self._pending.append(request_id)
            self._work.set()

    def fail_in_flight(self, reason: str) -> int:
        """Ends every request in flight: its stream raises EngineShutdownError(reason) and the engine
        aborts it (its blocks are freed). For a shutdown past its drain time; new requests are refused
        once shutdown() has begun. Returns how many were ended. Call it on the event loop."""
        ended = list(self._queues.items())
        self._queues.clear()
        for _, q in ended:
            q.put_nowait(EngineShutdownError(reason))
        if ended:
            with self._lock:
                self._pending.extend(rid for rid, _ in ended)
            self._work.set()
        return len(ended)

    def get_stats(self) -> EngineStats:
        """The engine's counters as of its last step (or its last applied add/abort): an immutable snapshot
        the engine thread published, so reading it never touches the scheduler."""
        return self._stats

    # ---- the engine thread ---------------------------------------------------------------------------
    def _apply_pending(self) -> bool:
        """Applies the adds and aborts handed over since the last call, in order; True if any. In order,
        a request closed before the engine saw it is added and aborted at once, and an id reused after an
        abort names the new request."""
        with self._lock:
            pending, self._pending = self._pending, []
        for item in pending:
            if isinstance(item, str):
                self.engine.abort_request([item])
            else:
                self.engine.enqueue(item)
        return bool(pending)

    def _snapshot(self) -> EngineStats:
        buckets, total = self._iterations.snapshot()
        return dataclasses.replace(
            self.engine.get_stats(), iteration_tokens_buckets=buckets, iteration_tokens_sum=total
        )

    def _run(self) -> None:
        try:
            while not self._halt:
                self._work.clear()  # before taking the pending list: a later set() is not missed
                if self._apply_pending():
                    self._stats = self._snapshot()  # an idle engine reports its aborts at once
                if not self.engine.has_unfinished_requests():
                    # Idle while variants still compile in the background: publish the count as it falls
                    # (the gauge a client waits on before timing), not only at the next step.
                    compiling = self._stats.num_compiling_in_background > 0
                    self._work.wait(IDLE_STATS_INTERVAL_S if compiling else None)
                    if compiling:
                        self._stats = self._snapshot()
                    continue
                outputs = self.engine.step()
                self._iterations.observe(self.engine.last_step_tokens)
                # Published before the outputs: a client that has its answer sees its tokens counted.
                self._stats = self._snapshot()
                if outputs:
                    self._post(self._deliver, outputs)
        except BaseException as e:  # a failed step must not leave clients waiting forever
            logger.exception("engine loop failed")
            self.errored = e
            self._post(self._fail_all, e)

    def _post(self, fn, arg) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the event loop is closed: nobody is left to read
            pass

    # ---- the event loop's side -----------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)
                if out.finished:
                    self._forget(out.request_id)

    def _fail_all(self, e: BaseException) -> None:
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(f"engine failure: {e!r}"))
        self._queues.clear()
        self._num_seqs.clear()
        self._failed.set()
