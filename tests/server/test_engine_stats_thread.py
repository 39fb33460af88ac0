"""The real AsyncLLMEngine over HTTP (a tiny random model, token-id prompts): the engine thread publishes
an immutable stats snapshot after each step and the event loop reads only that. While streams and
single responses run and /metrics is scraped (and the stats line ticks) all along, every read of the
scheduler's and the runner's counters happens on the engine thread; the scraped counters never go back;
and once the engine is idle, /metrics shows exactly the engine's own counts and every step it ran."""

from __future__ import annotations

import asyncio
import re
import threading

import httpx
import pytest

from jaxllm.server.app import build_app
from tests.server.conftest import LiveServer

ENGINE_THREAD = "jaxllm-engine"


@pytest.fixture(scope="module")
def engine():
    from jaxllm.engine.async_engine import AsyncLLMEngine
    from jaxllm.engine_args import EngineArgs

    args = EngineArgs(
        model="tiny-llama", load_format="dummy", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64
    )
    return AsyncLLMEngine.from_engine_args(args)


def _record_threads(obj, name: str, threads: list[str]) -> None:
    inner = getattr(obj, name)

    def recorded(*a, **kw):
        threads.append(threading.current_thread().name)
        return inner(*a, **kw)

    setattr(obj, name, recorded)


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m is not None, name
    return float(m.group(1))


COUNTERS = [
    "jaxllm:generation_tokens_total",
    "jaxllm:prompt_tokens_total",
    "jaxllm:engine_steps_total",
    "jaxllm:iteration_tokens_total_count",
    "jaxllm:iteration_tokens_total_sum",
    "jaxllm:prefix_cache_queries_total",
]


def test_stats_reads_stay_on_the_engine_thread_and_metrics_match(engine):
    inner = engine.engine
    readers: list[str] = []  # the thread of every read of the scheduler's or the runner's counters
    _record_threads(inner.scheduler, "get_stats", readers)
    _record_threads(inner.runner, "num_compiling_in_background", readers)
    steps: list[int] = []  # tokens scheduled by each step, recorded where the step runs
    step = inner.step

    def counted_step():
        out = step()
        steps.append(inner.last_step_tokens)
        return out

    inner.step = counted_step
    scrapes: list[str] = []
    with LiveServer(build_app(engine, disconnect_poll_s=0.05, stats_interval_s=0.01)) as server:

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
                stop = asyncio.Event()

                async def scrape():
                    while not stop.is_set():
                        scrapes.append((await c.get("/metrics")).text)
                        await asyncio.sleep(0.005)

                async def one(i: int) -> int:
                    body = {
                        "prompt": [3 + i, 4 + i, 5 + i, 6 + (i * 7) % 40] * (1 + i % 3),
                        "max_tokens": 6 + i,
                        "temperature": 0,
                        "ignore_eos": True,
                        "stream": i % 2 == 0,
                        "stream_options": {"include_usage": True} if i % 2 == 0 else None,
                    }
                    if not body["stream"]:
                        del body["stream_options"]
                        r = await c.post("/v1/completions", json=body)
                        return r.json()["usage"]["completion_tokens"]
                    async with c.stream("POST", "/v1/completions", json=body) as r:
                        raw = "".join([x async for x in r.aiter_text()])
                    usage = re.findall(r'"completion_tokens":(\d+)', raw)
                    return int(usage[-1])

                scraper = asyncio.ensure_future(scrape())
                done = await asyncio.gather(*(one(i) for i in range(12)))
                # Idle: no request left and the step count settled (an async step may follow the last output).
                while True:
                    a = (await c.get("/metrics")).text
                    await asyncio.sleep(0.1)
                    b = (await c.get("/metrics")).text
                    if _metric(a, "jaxllm:engine_steps_total") == _metric(
                        b, "jaxllm:engine_steps_total"
                    ) and (_metric(b, "jaxllm:num_requests_running") == 0):
                        break
                stop.set()
                await scraper
                return done, b

        completion_tokens, final = asyncio.run(run())
    assert readers and set(readers) == {ENGINE_THREAD}, set(readers)
    # The server has shut down and the engine thread has ended: reading the engine directly is safe now.
    direct = inner.get_stats()
    assert len(scrapes) > 10
    for name in COUNTERS:  # a snapshot is one consistent state: counters never go back between scrapes
        values = [_metric(t, name) for t in scrapes]
        assert values == sorted(values), name
    assert (
        _metric(final, "jaxllm:generation_tokens_total") == direct.generation_tokens == sum(completion_tokens)
    )
    assert _metric(final, "jaxllm:prompt_tokens_total") == direct.prompt_tokens > 0
    assert _metric(final, "jaxllm:prefix_cache_queries_total") == direct.prefix_cache_queries
    assert _metric(final, "jaxllm:engine_steps_total") == direct.num_steps == len(steps)
    assert _metric(final, "jaxllm:iteration_tokens_total_count") == len(steps)
    assert _metric(final, "jaxllm:iteration_tokens_total_sum") == sum(steps)
    le64 = re.search(r'^jaxllm:iteration_tokens_total_bucket\{le="64.0",[^}]*\} (\S+)$', final, re.M)
    assert float(le64.group(1)) == sum(1 for s in steps if s <= 64)
    host = {p: v for p, v in direct.step_host_s.items()}
    for phase, seconds in host.items():
        got = re.search(rf'^jaxllm:step_host_seconds_total\{{[^}}]*phase="{phase}"\}} (\S+)$', final, re.M)
        assert float(got.group(1)) == pytest.approx(seconds)
