"""AsyncLLMEngine's engine thread steps back to back without waiting for the event loop, so the streams'
host work (SSE chunks, JSON) runs beside the next steps instead of between them. An engine stand-in
records when each step starts; while a stream blocks the event loop's thread (as CPU-bound SSE work
does), every later step must still start. Outputs arrive complete and in order, and an abort stops a
request."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from jaxllm.engine.async_engine import AsyncLLMEngine
from jaxllm.engine_errors import EngineDeadError
from jaxllm.sampling_params import SamplingParams
from jaxllm.stats import EngineStats


class StepRecordingEngine:
    """Each request yields `length` outputs, one per step; `entered[k]` is set when step k starts."""

    def __init__(self, length: int = 4):
        self.length = length
        self.tokenizer = None
        self.sampling_defaults = {}
        self.loaded = SimpleNamespace(model_name="stand-in", arch=SimpleNamespace(vocab_size=16))
        self.max_model_len = 64
        self.max_kv_tokens = 1024
        self.startup_info = {}
        self.last_step_tokens = 0
        self.left: dict[str, int] = {}
        self.entered = [threading.Event() for _ in range(64)]
        self.steps = 0

    def prepare_request(self, request_id, prompt, params, priority=0, compile_grammar=True):
        return SimpleNamespace(request_id=request_id)

    def enqueue(self, parent):
        self.left[parent.request_id] = self.length

    def abort_request(self, request_ids):
        for rid in request_ids:
            self.left.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.left)

    def get_stats(self):
        return EngineStats(num_requests_running=len(self.left), num_steps=self.steps)

    def step(self):
        k = self.steps
        self.steps += 1
        self.entered[k].set()
        outs = []
        for rid in sorted(self.left):
            self.left[rid] -= 1
            finished = self.left[rid] == 0
            if finished:
                del self.left[rid]
            outs.append(SimpleNamespace(request_id=rid, finished=finished, step=k))
        self.last_step_tokens = len(outs)
        return outs


async def _collect(engine, rid, block_until_step=None):
    steps = []
    async for out in engine.generate([1, 2, 3], SamplingParams(max_tokens=4), rid):
        if block_until_step is not None and out.step == 0:
            stand_in, last = block_until_step
            # A blocking wait on the event loop's thread: nothing else of the loop runs meanwhile.
            assert stand_in.entered[last].wait(timeout=5), f"step {last} not started while the loop was busy"
        steps.append(out.step)
    return steps


def test_steps_go_on_while_the_event_loop_is_busy():
    async def main():
        stand_in = StepRecordingEngine(length=4)
        engine = AsyncLLMEngine(stand_in)
        await engine.start()
        try:
            return await _collect(engine, "r0", block_until_step=(stand_in, 3))
        finally:
            await engine.shutdown(drain_timeout_s=1)

    assert asyncio.run(main()) == [0, 1, 2, 3]


def test_a_failed_step_fails_every_stream_and_later_requests():
    class FailingEngine(StepRecordingEngine):
        def step(self):
            raise RuntimeError("device lost")

    async def main():
        engine = AsyncLLMEngine(FailingEngine())
        await engine.start()
        try:
            waiter = asyncio.ensure_future(engine.wait_until_failed())
            await asyncio.sleep(0.05)
            assert not waiter.done()  # a healthy (idle) engine never reports a failure
            with pytest.raises(EngineDeadError, match="engine failure: RuntimeError\\('device lost'\\)"):
                await _collect(engine, "r0")
            failure = await asyncio.wait_for(waiter, timeout=5)
            assert isinstance(failure, RuntimeError) and str(failure) == "device lost"
            assert engine.errored is failure
            with pytest.raises(RuntimeError, match="the engine loop failed") as refused:
                engine.generate([1], SamplingParams(max_tokens=2), "r1")
            assert not isinstance(refused.value, EngineDeadError)  # refused (503), not failed in flight (500)
            assert not engine.is_running
        finally:
            await engine.shutdown(drain_timeout_s=1)

    asyncio.run(main())


def test_every_output_arrives_in_order_and_abort_stops_a_request():
    async def main():
        stand_in = StepRecordingEngine(length=6)
        engine = AsyncLLMEngine(stand_in)
        await engine.start()
        try:
            full = asyncio.create_task(_collect(engine, "a"))
            stream = engine.generate([1], SamplingParams(max_tokens=6), "b")
            first = await stream.__anext__()
            await stream.aclose()  # the client went away: the request is aborted
            steps = await full
            return steps, first, stand_in
        finally:
            await engine.shutdown(drain_timeout_s=1)

    steps, first, stand_in = asyncio.run(main())
    assert steps == sorted(steps) and len(steps) == 6 and steps == list(range(steps[0], steps[0] + 6))
    assert first.request_id == "b" and not first.finished
    assert "b" not in stand_in.left  # aborted, not run to its end


def test_an_idle_engine_publishes_background_compiles_as_they_finish():
    """/metrics' num_compiling_in_background is the engine thread's snapshot: an engine left idle while
    variants still compile must publish the count as it falls, not only at its next step (a client that
    waits for 0 before timing would wait forever)."""

    class Compiling(StepRecordingEngine):
        compiling = 2

        def get_stats(self):
            return EngineStats(num_compiling_in_background=self.compiling)

    async def main():
        stand_in = Compiling()
        engine = AsyncLLMEngine(stand_in)
        await engine.start()
        try:
            await asyncio.sleep(0.1)
            assert engine.get_stats().num_compiling_in_background == 2
            stand_in.compiling = 0  # the last variant is done; no request arrives
            for _ in range(40):
                await asyncio.sleep(0.05)
                if engine.get_stats().num_compiling_in_background == 0:
                    return True
            return False
        finally:
            await engine.shutdown(drain_timeout_s=1)

    assert asyncio.run(main())
