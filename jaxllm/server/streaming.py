"""Server-sent events as OpenAI sends them: `data: {json}\n\n` per chunk, then `data: [DONE]\n\n`.

`ChoiceDeltas` turns the engine's cumulative outputs into per-choice increments (text, token ids,
logprob positions), each emitted once, with the finish reason emitted exactly once per choice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from jaxllm.outputs import CompletionOutput

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass(slots=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list | None  # the new positions' logprob dicts
    finish_reason: str | None
    first: bool  # first chunk of this choice


class ChoiceDeltas:
    def __init__(self):
        self._text_len: dict[int, int] = {}
        self._num_tokens: dict[int, int] = {}
        self._finished: set[int] = set()

    def update(self, index: int, out: CompletionOutput) -> Delta | None:
        """The increment of choice `index` since its last update, or None when nothing changed."""
        if index in self._finished:
            return None
        first = index not in self._text_len
        t0, n0 = self._text_len.get(index, 0), self._num_tokens.get(index, 0)
        text = out.text[t0:] if len(out.text) > t0 else ""
        ids = list(out.token_ids[n0:])
        lps = list(out.logprobs[n0 : len(out.token_ids)]) if out.logprobs is not None else None
        self._text_len[index] = max(t0, len(out.text))
        self._num_tokens[index] = max(n0, len(out.token_ids))
        if out.finish_reason is not None:
            self._finished.add(index)
        if not text and not ids and out.finish_reason is None and not first:
            return None
        return Delta(text, ids, lps, out.finish_reason, first)
