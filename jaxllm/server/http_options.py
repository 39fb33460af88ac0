"""What a deployment sets about the HTTP layer, with vLLM's flags: CORS, X-Request-Id headers, the path
prefix of a reverse proxy, and whether /openapi.json is served.

    request --RootPathMiddleware (scope["root_path"] = --root-path)
            --CORSMiddleware (starlette's; --allowed-origins/-methods/-headers, --allow-credentials)
            --RequestIdMiddleware (--enable-request-id-headers: X-Request-Id on every response)
            --APIKeyMiddleware (auth.py) --> routes

All are plain ASGI middleware (no BaseHTTPMiddleware), so streamed responses pass through unbuffered and a
client's disconnect still reaches the handler. CORS sits outside the API-key check, as in vLLM, so that a
browser's preflight and a 401 both carry the CORS headers the browser needs to read them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from starlette.datastructures import Headers, MutableHeaders
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

REQUEST_ID_HEADER = "X-Request-Id"


@dataclass(frozen=True, slots=True)
class HTTPOptions:
    # vLLM's defaults: CORS allows every origin, method and header; no credentials.
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    enable_request_id_headers: bool = False
    root_path: str = ""  # the prefix a proxy serves the API under ("" none), FastAPI's root_path
    serve_openapi: bool = True  # GET /openapi.json (off: --disable-fastapi-docs)

    def __post_init__(self) -> None:
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(
                f"root_path={self.root_path!r} (--root-path) must start with '/' and not end with it"
            )

    def middleware(self) -> list[Middleware]:
        """The middleware in order, outermost first."""
        stack = []
        if self.root_path:
            stack.append(Middleware(RootPathMiddleware, root_path=self.root_path))
        stack.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(self.allowed_origins),
                allow_methods=list(self.allowed_methods),
                allow_headers=list(self.allowed_headers),
                allow_credentials=self.allow_credentials,
            )
        )
        if self.enable_request_id_headers:
            stack.append(Middleware(RequestIdMiddleware))
        return stack


def route_path(scope) -> str:
    """The request's path below the root path, which is what the routes match (a proxy may pass the
    prefix on or strip it: both reach the same route, as with FastAPI's root_path)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root + "/"):
        return path[len(root) :]
    return path


class RootPathMiddleware:
    """Sets the ASGI root_path, as FastAPI(root_path=...) does for vLLM's --root-path: Starlette's router
    then matches "/v1/models" and "/PREFIX/v1/models" alike, and URLs built from the request carry the prefix."""

    def __init__(self, app, root_path: str):
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """X-Request-Id on every response: the request's own X-Request-Id when it has one (a proxy's or a
    client's trace id), else a new one, so a caller can match a response with the server's logs."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = Headers(scope=scope).get(REQUEST_ID_HEADER) or uuid.uuid4().hex

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)
