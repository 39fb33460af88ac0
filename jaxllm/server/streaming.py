"""Server-sent events as OpenAI sends them: `data: {json}\n\n` per chunk, then `data: [DONE]\n\n`.

A streamed request asks the engine for DELTA outputs, so each chunk is made straight from one output's
new text, token ids and logprob positions (serving_chat.py, serving_completion.py); nothing is diffed.

`dumps` writes JSON as the OpenAI server does (compact, UTF-8), with one addition: a `RawJSONText` value
(research captures' base64, megabytes) goes into the document as a string without the encoder scanning
it for characters to escape (base64 has none): json.dumps takes tens of ms over 20 MB, holding the
interpreter lock the engine thread needs. The encoder writes a short marker for it; the text is joined in
once at the end.
"""

from __future__ import annotations

import json
import os
import re

from starlette.responses import JSONResponse

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_MARK = f"@jaxllm-raw-json-{os.urandom(6).hex()}@"
_MARKS = re.compile(f'"{_MARK}(\\d+)"')


class RawJSONText:
    """A string value that `dumps` writes as it is: the caller vouches it needs no JSON escapes."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text


def dumps(obj, *, allow_nan: bool = True) -> str:
    raws: list[str] = []

    def default(o):
        if isinstance(o, RawJSONText):
            raws.append(o.text)
            return f"{_MARK}{len(raws) - 1}"
        raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")

    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=allow_nan, default=default)
    if not raws:
        return text
    parts = _MARKS.split(text)  # literal, index, literal, index, ..., literal
    for i in range(1, len(parts), 2):
        parts[i] = f'"{raws[int(parts[i])]}"'
    return "".join(parts)


def sse(obj: dict) -> str:
    return f"data: {dumps(obj)}\n\n"


class RawTextJSONResponse(JSONResponse):
    """Starlette's JSONResponse (same bytes), written by `dumps` so RawJSONText values pass through."""

    def render(self, content) -> bytes:
        return dumps(content, allow_nan=False).encode("utf-8")
