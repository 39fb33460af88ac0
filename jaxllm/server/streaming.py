"""Server-sent events as OpenAI sends them: `data: {json}\n\n` per chunk, then `data: [DONE]\n\n`.

A streamed request asks the engine for DELTA outputs, so each chunk is made straight from one output's
new text, token ids and logprob positions (serving_chat.py, serving_completion.py); nothing is diffed.
"""

from __future__ import annotations

import json

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
