"""The client side of the online benchmark: one streaming request, and a load of them.

BenchRequest --send_request: streaming POST /v1/completions (ignore_eos, include_usage)--> RequestTiming
    (TTFT, every inter-chunk gap, E2E latency, token counts, or the error)
[BenchRequest] --run_load: Poisson arrivals at a rate (inf: all at once), at most max_concurrency in
    flight, cut at a deadline (CUT)--> timings in request order, wall time
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import numpy as np

from benchmarks.serve_metrics import RequestTiming
from benchmarks.workload import BenchRequest


# ---- one request ---------------------------------------------------------------------------------------
async def send_request(
    client: httpx.AsyncClient, url: str, model: str, req: BenchRequest, temperature: float
) -> RequestTiming:
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(req.extra_body or {}),
    }
    t = RequestTiming(success=False, prompt_len=req.input_len)
    pieces: list[str] = []
    chunks = 0
    usage = None
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                t.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return t
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("usage"):
                    usage = msg["usage"]
                if not msg.get("choices"):
                    continue
                choice = msg["choices"][0]
                pieces.append(choice.get("text") or "")
                t.finish_reason = choice.get("finish_reason") or t.finish_reason
                now = time.perf_counter()
                if chunks == 0:
                    t.ttft = now - start
                else:
                    t.itl.append(now - last)
                last = now
                chunks += 1
        t.latency = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        t.error = f"{type(e).__name__}: {e}"
        return t
    t.text = "".join(pieces)
    t.output_tokens = int(usage["completion_tokens"]) if usage else chunks
    if usage and usage.get("prompt_tokens"):
        t.prompt_len = int(usage["prompt_tokens"])
    t.success = chunks > 0
    if not t.success:
        t.error = "the stream held no tokens"
    return t


# ---- a load ----------------------------------------------------------------------------------------------
def arrival_gaps(n: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential gaps (a Poisson process), or none at rate inf."""
    if rate <= 0:
        raise ValueError(f"--request-rate={rate} must be > 0 (inf sends everything at once)")
    if math.isinf(rate):
        return [0.0] * n
    return np.random.default_rng(seed).exponential(1.0 / rate, size=n).tolist()


CUT = "cut at the sweep deadline"


async def run_load(
    base_url: str,
    model: str,
    requests: list[BenchRequest],
    rate: float,
    max_concurrency: int | None,
    temperature: float,
    seed: int,
    timeout_s: float,
    deadline: float | None = None,
) -> tuple[list[RequestTiming], float]:
    """Timings in request order and the wall time. `deadline` (Unix time): requests unfinished by then
    are cancelled and count as failed with the error CUT."""
    url = base_url.rstrip("/") + "/v1/completions"
    limit = max_concurrency or len(requests)
    sem = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:

        async def one(r: BenchRequest) -> RequestTiming:
            async with sem:
                return await send_request(client, url, model, r, temperature)

        tasks: list[asyncio.Task] = []

        async def submit_all() -> None:
            for gap, r in zip(arrival_gaps(len(requests), rate, seed), requests, strict=True):
                if gap > 0:
                    await asyncio.sleep(gap)
                tasks.append(asyncio.create_task(one(r)))
            await asyncio.gather(*tasks, return_exceptions=True)

        t0 = time.perf_counter()
        left = None if deadline is None else max(0.0, deadline - time.time())
        try:
            await asyncio.wait_for(submit_all(), left)
        except TimeoutError:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        duration = time.perf_counter() - t0
    timings = []
    for i, r in enumerate(requests):
        task = tasks[i] if i < len(tasks) else None
        if task is None or task.cancelled():
            timings.append(RequestTiming(False, prompt_len=r.input_len, error=CUT))
        elif task.exception() is not None:
            e = task.exception()
            timings.append(RequestTiming(False, prompt_len=r.input_len, error=f"{type(e).__name__}: {e}"))
        else:
            timings.append(task.result())
    return timings, duration
