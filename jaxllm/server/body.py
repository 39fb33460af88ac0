"""Reading a JSON request body under a size limit (413 on Content-Length or while reading).

bytes --json.loads--> value: a 400 (code invalid_json) for bytes that are not JSON, nesting past the
    recursion limit, or an integer past Python's 4,300-digit conversion limit (a plain ValueError)
--find_lone_surrogate--> a 400 naming the field whose text holds an escaped lone surrogate ("\\ud800"):
    JSON allows the escape, but the text is not Unicode, and the tokenizer, the log and the response
    encoder all fail on it
"""

from __future__ import annotations

import json
import re

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
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, the digit limit
        raise APIError(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError("request body must be a JSON object")
    if (path := find_lone_surrogate(body)) is not None:
        raise APIError(
            f"{path or 'a field name'}: the text holds a lone UTF-16 surrogate escape (\\ud800-\\udfff "
            "without its pair), which is not Unicode",
            param=path or None,
            code="invalid_json",
        )
    return body


_SURROGATE = re.compile("[\ud800-\udfff]")


def find_lone_surrogate(body: dict) -> str | None:
    """The path ("messages[0].content") of a string holding a lone surrogate, "" when it is a key,
    None when there is none. A pair escaped as two \\u escapes is decoded to one character by json.loads,
    so what is left in the range is a lone half. Iterative: json.loads already bounds the depth."""
    stack: list[tuple[str, object]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path
        elif isinstance(value, dict):
            for key, v in value.items():
                if _SURROGATE.search(key):
                    return ""
                stack.append((f"{path}.{key}" if path else key, v))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
    return None
