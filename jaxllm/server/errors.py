"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status.

Handlers raise `APIError` (or let a `ValueError` from `SamplingParams` through, which becomes a 400 naming
the field); `error_response` renders either. Nothing a client sends should end as a 500.
"""

from __future__ import annotations

import re

from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}
_FIELD_RE = re.compile(r"^(\w+)=")


class APIError(Exception):
    """An error a client caused (or a server fault), carried to the response with its status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers  # extra response headers (Retry-After on a 503 of a full queue)


def from_value_error(exc: ValueError, status: int = 400) -> APIError:
    """A `ValueError` whose message starts with `field=...` (SamplingParams, the engine) names its param."""
    msg = str(exc)
    m = _FIELD_RE.match(msg)
    return APIError(msg, status=status, param=m.group(1) if m else None)


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(exc.message, exc.status, exc.param, exc.code), status_code=exc.status, headers=exc.headers
    )
