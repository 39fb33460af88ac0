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
# "temperature=..." -> ("temperature", "="); "steer.vector: ..." -> ("steer.vector", ": ")
_FIELD_RE = re.compile(r"^([\w.]+)(:\s*|=)")


def split_field(msg: str) -> tuple[str, str]:
    """A ValueError's message that starts by naming its field -> (the field, the rest); ("", msg) if it
    names none. A `field=value ...` message is kept whole: the value is part of what it says."""
    m = _FIELD_RE.match(msg)
    if m is None:
        return "", msg
    return m.group(1), msg if m.group(2) == "=" else msg[m.end() :]


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
    """A `ValueError` whose message starts with `field=...` or `field: ...` (SamplingParams, the engine)
    names its param."""
    msg = str(exc)
    return APIError(msg, status=status, param=split_field(msg)[0] or None)


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
