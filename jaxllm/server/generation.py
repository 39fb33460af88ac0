"""Running engine requests on behalf of a handler: validation against the context, metrics, abort.

prompt ids + CommonFields --make_sampling_params--> SamplingParams (400 naming the field on error); a
    streamed request asks the engine for DELTA outputs (what is new per choice), any other for FINAL_ONLY
engine.generate(...) --tracked--> RequestOutputs observed by a RequestTracker; leaving early aborts
several prompts --start_all--> primed streams (an engine ValueError becomes a 400 before any byte
    is sent) --merge--> (prompt index, RequestOutput) as produced, or --collect--> final outputs,
    polling `request.is_disconnected()` so a client that leaves has its requests aborted.
The engine failing mid-request (EngineDeadError) is a server fault: a 500, or an error event in a stream
that has started; a request that arrives after the failure is refused with a 503. A request that finds the
engine at --max-num-queued-reqs is refused with a 503 and Retry-After (EngineOverloadedError). A request
that gives `timeout` is aborted when it passes (its KV blocks freed): a 408, or an error event in a stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import anyio

from jaxllm.engine_errors import EngineDeadError, EngineOverloadedError, EngineShutdownError
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import RequestOutputKind, SamplingParams
from jaxllm.server.errors import APIError, from_value_error
from jaxllm.server.metrics import ServerMetrics
from jaxllm.server.protocol import CommonFields

# Seconds a client refused for a full queue is told to wait (Retry-After): a step or two of a busy engine,
# short enough that a retry finds the room freed by requests that finished meanwhile.
RETRY_AFTER_S = 1


class ClientDisconnected(Exception):
    """The client went away before its non-streaming response was ready."""


def check_model(requested: str | None, served_names: list[str]) -> str:
    if requested is None or requested in served_names:
        return served_names[0]
    raise APIError(
        f"The model `{requested}` does not exist. Served models: {served_names}",
        status=404,
        param="model",
        code="model_not_found",
    )


def check_prompt_ids(ids: list[int], vocab_size: int, param: str) -> None:
    if not ids:
        raise APIError(f"'{param}' must not be empty", param=param)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(f"'{param}' holds token ids outside [0, {vocab_size}): {bad[:5]}", param=param)


def make_sampling_params(
    common: CommonFields,
    prompt_len: int,
    max_model_len: int,
    *,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    prompt_param: str = "prompt",
    vocab_size: int | None = None,
    max_kv_tokens: int | None = None,
) -> SamplingParams:
    """SamplingParams for one prompt; max_tokens=None means what the context (and the KV cache) leaves. A
    stream gets DELTA outputs (its chunks are the deltas), a single response FINAL_ONLY (one output at the
    end). `max_kv_tokens`: the whole KV cache in tokens; a request that could never be in it at once (it
    would wait or be preempted forever) is refused here, naming the limit."""
    if prompt_len >= max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    kv_limit = max_model_len if max_kv_tokens is None else min(max_model_len, max_kv_tokens)
    if prompt_len >= kv_limit:
        raise APIError(
            f"{prompt_param}: {prompt_len} tokens; the whole KV cache holds {kv_limit} tokens and must leave "
            "room to generate (--num-gpu-blocks-override, --gpu-memory-utilization)",
            param=prompt_param,
            code="context_length_exceeded",
        )
    max_tokens = common.max_tokens if common.max_tokens is not None else kv_limit - prompt_len
    if vocab_size is not None:
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
            bad = sorted({t for t in common.sampling.get(name) or () if t >= vocab_size})
            if bad:
                raise APIError(
                    f"{name}: token ids {bad[:5]} are not in the vocabulary (size {vocab_size})", param=name
                )
    try:
        params = SamplingParams(
            **common.sampling,
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            output_kind=RequestOutputKind.DELTA if common.stream else RequestOutputKind.FINAL_ONLY,
        )
    except (ValueError, TypeError) as e:
        raise from_value_error(ValueError(str(e))) from None
    if prompt_len + max_tokens > max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the input, {max_tokens} in the completion). "
            f"Please reduce the length of the input or the completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    if prompt_len + max_tokens > kv_limit:
        raise APIError(
            f"max_tokens: {prompt_len} prompt tokens + max_tokens {max_tokens} = {prompt_len + max_tokens} "
            f"tokens; the whole KV cache holds {kv_limit} tokens (--num-gpu-blocks-override, "
            "--gpu-memory-utilization). Please reduce the length of the input or the completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return params


def deadline_of(common: CommonFields) -> float | None:
    """The event loop's time at which the request's `timeout` passes (None: it gave none)."""
    if common.timeout is None:
        return None
    return asyncio.get_running_loop().time() + common.timeout


async def shielded(coro) -> None:
    # Starlette cancels a streaming response's task group on disconnect; the abort must still run.
    with anyio.CancelScope(shield=True):
        await coro


async def tracked(
    engine,
    prompt: list[int],
    params: SamplingParams,
    request_id: str,
    metrics: ServerMetrics,
    priority: int = 0,
    timeout: float | None = None,
    deadline: float | None = None,
) -> AsyncIterator[RequestOutput]:
    """engine.generate, observed for metrics; a consumer that stops early (disconnect, error) aborts it.
    `deadline` (the event loop's clock) ends the request there: aborted, then APIError 408 naming the
    request's `timeout` (seconds)."""
    tracker = metrics.tracker(params.output_kind, n=params.n, max_tokens=params.max_tokens)
    finished = False
    gen = engine.generate(prompt, params, request_id, priority=priority)
    loop = asyncio.get_running_loop()
    try:
        while True:
            try:
                if deadline is None:
                    ro = await gen.__anext__()
                else:  # on expiry the generator is cancelled at its await and closes; the abort follows
                    ro = await asyncio.wait_for(gen.__anext__(), max(deadline - loop.time(), 0.0))
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise APIError(
                    f"timeout: the request did not finish within its timeout of {timeout:g} s and was aborted",
                    status=408,
                    param="timeout",
                    code="timeout",
                ) from None
            tracker.on_output(ro)
            finished = ro.finished
            yield ro
    except EngineDeadError as e:  # a server fault: 500, not the 503 of a request refused after it
        raise APIError(f"the engine failed while serving this request: {e}", status=500) from e
    except EngineShutdownError as e:  # shut down past --shutdown-timeout: another replica may serve it
        raise APIError(str(e), status=503) from e
    finally:
        if not finished:
            await shielded(engine.abort(request_id))
        aclose = getattr(gen, "aclose", None)
        if aclose is not None:
            await shielded(aclose())


async def _prepend(first: Any, rest: AsyncIterator) -> AsyncIterator:
    try:
        yield first
        async for x in rest:
            yield x
    finally:
        await shielded(rest.aclose())


def _engine_error(e: BaseException) -> BaseException:
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineOverloadedError):
        return APIError(
            str(e), status=503, code="server_overloaded", headers={"Retry-After": str(RETRY_AFTER_S)}
        )
    if isinstance(e, ValueError):
        return from_value_error(e)
    if isinstance(e, RuntimeError):  # the engine is shutting down or its loop failed before this request
        return APIError(f"the engine cannot take requests: {e}", status=503)
    if isinstance(e, StopAsyncIteration):
        return APIError("the engine returned no output", status=500)
    return e


async def _wait_all(request, coros: list, poll_s: float) -> list:
    """Results of all coroutines; the first failure, or the client leaving, cancels the rest."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        while True:
            done, pending = await asyncio.wait(tasks, timeout=poll_s, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    raise _engine_error(t.exception())
            if not pending:
                return [t.result() for t in tasks]
            if request is not None and await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await shielded(asyncio.gather(*tasks, return_exceptions=True))


async def start_all(
    streams: list[AsyncIterator[RequestOutput]], request=None, poll_s: float = 0.5
) -> list[AsyncIterator[RequestOutput]]:
    """Waits for each stream's first output so a rejected prompt becomes a 400 before the response starts
    (a client that leaves meanwhile gets its requests aborted: ClientDisconnected)."""
    try:
        firsts = await _wait_all(request, [s.__anext__() for s in streams], poll_s)
    except BaseException:
        for s in streams:
            await shielded(s.aclose())
        raise
    return [_prepend(f, s) for f, s in zip(firsts, streams, strict=True)]


_DONE = object()


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves several streams in arrival order as (stream index, item)."""
    if len(streams) == 1:
        try:
            async for x in streams[0]:
                yield 0, x
        finally:
            await shielded(streams[0].aclose())
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator) -> None:
        try:
            async for x in s:
                await queue.put((i, x, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, None, e))
        finally:
            await shielded(s.aclose())
            queue.put_nowait((i, None, _DONE))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, x, err = await queue.get()
            if err is _DONE:
                remaining -= 1
            elif err is not None:
                raise err
            else:
                yield i, x
    finally:
        for t in tasks:
            t.cancel()
        await shielded(asyncio.gather(*tasks, return_exceptions=True))


async def collect(
    request, streams: list[AsyncIterator[RequestOutput]], poll_s: float = 0.5
) -> list[RequestOutput]:
    """Final output of each stream; raises ClientDisconnected (having aborted all) if the client leaves."""

    async def last(s: AsyncIterator[RequestOutput]) -> RequestOutput:
        out = None
        async for out in s:  # noqa: B007
            pass
        if out is None:
            raise APIError("the engine returned no output", status=500)
        return out

    return await _wait_all(request, [last(s) for s in streams], poll_s)
