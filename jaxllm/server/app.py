"""The Starlette app: routes -> handlers, with OpenAI-shaped errors and the engine's lifetime.

    build_app(engine, ...) -> Starlette
      lifespan: engine.start(), a periodic stats log line; on exit engine.shutdown() (drains requests);
        once the engine has failed, `on_engine_dead()` (the CLI stops uvicorn and exits non-zero)
      POST /v1/chat/completions, /v1/completions -> serving_chat / serving_completion
      GET /v1/models, /health, /version, /metrics, /openapi.json (from the request models);
      POST /tokenize, /detokenize
      middleware: --root-path, CORS, X-Request-Id (http_options.py), then the API key (auth.py)
The generation routes fill the fields a request leaves out from the model's sampling defaults
(--generation-config; protocol.with_sampling_defaults) before parsing it; a value the client sends wins.
Every handler runs inside `_guard`: an APIError (or a client ValueError) answers that request alone; an
unexpected exception is logged and answered with a 500 without touching other requests.
After an engine failure /health answers 503, requests in flight get a 500 (or an SSE error event) and new
generation requests a 503, as vLLM's server does on EngineDeadError.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import jaxllm
from jaxllm.server.auth import APIKeyMiddleware
from jaxllm.server.body import read_json_object
from jaxllm.server.errors import APIError, error_body, error_response
from jaxllm.server.generation import check_model
from jaxllm.server.http_metrics import HTTPMetricsMiddleware
from jaxllm.server.http_options import HTTPOptions
from jaxllm.server.metrics import ServerMetrics, StatsLogger
from jaxllm.server.openapi import openapi_document
from jaxllm.server.protocol import parse_detokenize, parse_tokenize, with_sampling_defaults
from jaxllm.server.reasoning import REASONING_PARSERS
from jaxllm.server.request_log import RequestLogger
from jaxllm.server.research import ResearchLimits, research_model
from jaxllm.server.serving_chat import create_chat_completion, render_chat
from jaxllm.server.serving_completion import create_completion
from jaxllm.server.state import ServerState
from jaxllm.server.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("jaxllm.server")


def _guard(handler):
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as e:
            return error_response(e)
        except Exception:
            logger.exception("error while handling %s %s", request.method, request.url.path)
            return JSONResponse(error_body("internal server error", 500), status_code=500)

    return wrapped


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def chat_completions(request: Request) -> Response:
    s = _state(request)
    body = await read_json_object(request, s.max_request_body_bytes)
    body = with_sampling_defaults(body, s.sampling_defaults, chat=True)
    return await create_chat_completion(s, body, request)


async def completions(request: Request) -> Response:
    s = _state(request)
    body = await read_json_object(request, s.max_request_body_bytes)
    body = with_sampling_defaults(body, s.sampling_defaults, chat=False)
    return await create_completion(s, body, request)


async def models(request: Request) -> Response:
    s = _state(request)
    data = [
        {
            "id": name,
            "object": "model",
            "created": int(s.start_time),
            "owned_by": "jaxllm",
            "root": s.model_name,
            "parent": None,
            "max_model_len": s.max_model_len,
        }
        for name in s.served_names
    ]
    return JSONResponse({"object": "list", "data": data})


async def health(request: Request) -> Response:
    failure = getattr(_state(request).engine, "errored", None)
    if failure is not None:  # a supervisor's probe (or a load balancer) takes this replica out
        return JSONResponse(error_body(f"the engine has failed: {failure!r}", 503), status_code=503)
    return Response(status_code=200)


async def version(request: Request) -> Response:
    return JSONResponse({"version": jaxllm.__version__})


async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def tokenize(request: Request) -> Response:
    s = _state(request)
    req = parse_tokenize(await read_json_object(request, s.max_request_body_bytes))
    check_model(req.model, s.served_names)
    if req.messages is not None:
        from jaxllm.server.protocol import ChatRequest, CommonFields

        chat = ChatRequest(common=CommonFields(None, False, False), messages=req.messages)
        ids = render_chat(s, chat)
    else:
        ids = s.require_tokenizer("prompt").encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return JSONResponse({"count": len(ids), "max_model_len": s.max_model_len, "tokens": ids})


async def detokenize(request: Request) -> Response:
    s = _state(request)
    model, tokens = parse_detokenize(await read_json_object(request, s.max_request_body_bytes))
    check_model(model, s.served_names)
    tok = s.require_tokenizer("tokens")
    vocab = len(tok)
    if any(not 0 <= t < vocab for t in tokens):
        raise APIError(f"'tokens' must be in [0, {vocab})", param="tokens")
    return JSONResponse({"prompt": tok.decode(tokens)})


async def openapi(request: Request) -> Response:
    doc = openapi_document(jaxllm.__version__)
    if root_path := request.scope.get("root_path"):  # behind a proxy's prefix (--root-path), as FastAPI
        doc = {**doc, "servers": [{"url": root_path}]}
    return JSONResponse(doc)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return JSONResponse(error_body(str(exc.detail), exc.status_code), status_code=exc.status_code)


def build_app(
    engine,
    *,
    served_model_names: list[str] | None = None,
    api_key: str | None = None,
    chat_template: str | None = None,
    max_request_body_bytes: int = 1 << 20,
    disconnect_poll_s: float = 0.5,
    stats_interval_s: float = 10.0,
    log_stats: bool = True,
    manage_engine: bool = True,
    max_logprobs: int = 20,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    http: HTTPOptions | None = None,
    request_logger: RequestLogger | None = None,
    research_limits: ResearchLimits | None = None,
    on_engine_dead: Callable[[], None] | None = None,
) -> Starlette:
    """`manage_engine`: start the engine on startup and shut it down (draining) on exit; `log_stats`: log a
    line of throughput and KV cache use every `stats_interval_s` while busy (--disable-log-stats: off);
    `max_logprobs`: the engine's --max-logprobs, which requests are checked against. The next three are the
    flags of the same names (tool calling and reasoning in chat responses). `http`: CORS, request-id
    headers, root path, /openapi.json (http_options.py; default: vLLM's); `request_logger`: a log line per
    generation request (--enable-log-requests; None: none). `research_limits`: --enable-research-api and
    its bounds (None: research refused). `on_engine_dead`: called once the engine has
    failed and every request in flight has been given its error (the CLI passes one that stops uvicorn,
    which lets those responses finish, so that the process exits non-zero)."""
    http = http or HTTPOptions()
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser={tool_call_parser!r} must be one of {sorted(TOOL_PARSERS)}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={reasoning_parser!r} must be one of {sorted(REASONING_PARSERS)}")
    names = list(served_model_names or [engine.model_name])
    state = ServerState(
        engine=engine,
        served_names=names,
        metrics=ServerMetrics(engine, names[0]),
        sampling_defaults=dict(engine.sampling_defaults),
        chat_template=chat_template,
        api_key=api_key,
        max_request_body_bytes=max_request_body_bytes,
        disconnect_poll_s=disconnect_poll_s,
        stats_interval_s=stats_interval_s,
        max_logprobs=max_logprobs,
        enable_auto_tool_choice=enable_auto_tool_choice,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        request_logger=request_logger,
        research_limits=research_limits or ResearchLimits(),
        research_model=research_model(engine) if research_limits and research_limits.enabled else None,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        if manage_engine:
            await engine.start()
        stats = StatsLogger(state.metrics)

        async def log_stats_lines():
            while True:
                await asyncio.sleep(state.stats_interval_s)
                try:
                    was_idle = stats.idle
                    line = stats.tick()
                    if not (was_idle and stats.idle):
                        logger.info(line)
                except Exception:
                    logger.exception("stats logging failed")

        async def watch_engine():
            failure = await engine.wait_until_failed()
            logger.error(
                "the engine has failed (%r): /health answers 503 and new requests are refused%s",
                failure,
                "; the server stops once the requests in flight have their error" if on_engine_dead else "",
            )
            if on_engine_dead is not None:
                on_engine_dead()

        tasks = [asyncio.ensure_future(log_stats_lines())] if log_stats else []
        if manage_engine and hasattr(engine, "wait_until_failed"):  # an engine this app started
            tasks.append(asyncio.ensure_future(watch_engine()))
        state.start_time = time.time()
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if manage_engine:
                await engine.shutdown()

    routes = [
        Route("/v1/chat/completions", _guard(chat_completions), methods=["POST"]),
        Route("/v1/completions", _guard(completions), methods=["POST"]),
        Route("/v1/models", _guard(models), methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/metrics", _guard(metrics), methods=["GET"]),
        Route("/tokenize", _guard(tokenize), methods=["POST"]),
        Route("/detokenize", _guard(detokenize), methods=["POST"]),
    ]
    if http.serve_openapi:
        routes.append(Route("/openapi.json", openapi, methods=["GET"]))
    middleware = [
        *http.middleware(),
        Middleware(HTTPMetricsMiddleware, metrics=state.metrics.http, paths=[r.path for r in routes]),
        Middleware(APIKeyMiddleware, state=state),
    ]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error},
    )
    app.state.server = state
    return app
