"""API-key check (ASGI middleware): `Authorization: Bearer <key>` on /v1/*, /tokenize and /detokenize.

/health, /metrics and /version stay open, as in vLLM. Keys are compared with hmac.compare_digest. The key is
read per request from the app's ServerState (None: no check), so it can be changed on a running app.
"""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse

from jaxllm.server.errors import error_body
from jaxllm.server.http_options import route_path

PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize")


class APIKeyMiddleware:
    def __init__(self, app, state):
        self.app = app
        self.state = state  # ServerState

    async def __call__(self, scope, receive, send):
        key = self.state.api_key
        if key is None or scope["type"] != "http" or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        if not route_path(scope).startswith(PROTECTED_PREFIXES):  # below --root-path, as the routes see it
            return await self.app(scope, receive, send)
        got = b""
        for k, v in scope.get("headers", []):
            if k == b"authorization":
                got = v
                break
        if not hmac.compare_digest(got, f"Bearer {key}".encode()):
            body = error_body("invalid or missing API key", 401, code="invalid_api_key")
            response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)
