"""Reading a JSON request body under a size limit (413 on Content-Length or while reading)."""

from __future__ import annotations

import json

from starlette.requests import ClientDisconnect, Request

from jaxllm.server.errors import APIError


def _too_large(limit: int) -> APIError:
    return APIError(
        f"request body is larger than the limit of {limit} bytes", status=413, code="request_too_large"
    )


async def read_json_object(request: Request, limit: int) -> dict:
    length = request.headers.get("content-length")
    if length is not None:
        try:
            if int(length) > limit:
                raise _too_large(limit)
        except ValueError:
            raise APIError("invalid Content-Length header") from None
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError("client disconnected while sending the body") from None
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise APIError(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError("request body must be a JSON object")
    return body
