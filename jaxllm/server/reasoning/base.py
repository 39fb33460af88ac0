"""Splitting a model's thinking from its answer: `<think>` ... `</think>` text becomes the message's
`reasoning_content`, the rest its `content` (vLLM's `--reasoning-parser`).

A parser is a small state machine fed the output in deltas (`feed`, then `finish` at the end), each
returning a `ReasoningDelta` (reasoning text, content text); `extract(text)` runs it over the whole text,
so streamed and single responses agree exactly. The tags themselves are in neither part; a tag split
across deltas is held back until it is complete (or cannot be).

    starts_in_reasoning  True (deepseek_r1): the chat template opened `<think>`, so the output begins
                         inside the reasoning (a `<think>` the model writes itself is dropped);
                         False (qwen3): only an output that begins with `<think>` has reasoning.
Either way, everything up to `</think>` is reasoning and everything after it content; an output that
ends before `</think>` (cut by max_tokens) is all reasoning, since a stream has sent it as such already.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from jaxllm.server.tool_parsers.base import partial_marker_len

THINK_START = "<think>"
THINK_END = "</think>"

_START, _REASONING, _CONTENT = range(3)


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    name: ClassVar[str]
    starts_in_reasoning: ClassVar[bool]

    def __init__(self) -> None:
        self._buf = ""
        self._state = _START

    @classmethod
    def extract(cls, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; an empty part is None."""
        p = cls()
        a, b = p.feed(text), p.finish()
        return (a.reasoning + b.reasoning) or None, (a.content + b.content) or None

    def feed(self, delta: str) -> ReasoningDelta:
        return self._run(delta, final=False)

    def finish(self) -> ReasoningDelta:
        return self._run("", final=True)

    def _run(self, text: str, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        self._buf += text
        if self._state == _START:
            if THINK_START.startswith(self._buf) and self._buf != THINK_START and not final:
                return out  # may still become <think>
            if self._buf.startswith(THINK_START):
                self._buf = self._buf[len(THINK_START) :]
                self._state = _REASONING
            else:
                self._state = _REASONING if self.starts_in_reasoning else _CONTENT
        if self._state == _REASONING:
            i = self._buf.find(THINK_END)
            if i < 0:
                keep = 0 if final else partial_marker_len(self._buf, THINK_END)
                out.reasoning = self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                return out
            out.reasoning = self._buf[:i]
            self._buf = self._buf[i + len(THINK_END) :]
            self._state = _CONTENT
        out.content, self._buf = self._buf, ""
        return out
