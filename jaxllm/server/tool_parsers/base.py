"""What every tool-call parser shares: the calls it found, content around them, and OpenAI's deltas.

A parser is a state machine over the generated text, fed in deltas (`feed`, then `finish` once the
output ends); each returns a `ParserDelta`: content to send, and tool-call deltas shaped as OpenAI
streams them: a call's first delta carries its `index`, `id`, `type` "function" and `function.name`
(with the arguments written so far, possibly ""), later ones `{"index", "function": {"arguments": piece}}`.
`extract(text)` runs the same machine over a whole text in one piece, so a streamed response and a
single one agree; the one difference is when a call breaks after its name went out (its JSON turns
invalid, or the output ends inside it): a stream cannot take back what it sent, so the call stays with
the arguments sent so far, and the text from the fault on is sent as content; the whole text knows
better and leaves that call's text as content (vLLM's behaviour for invalid JSON).

Content is the text outside the calls, with whitespace that touches a call dropped (the newlines a
model writes around its tool-call markers are not an answer); with no calls it is the text unchanged.
A stream releases text as soon as it can no longer become part of a call: a partial marker, trailing
whitespace, and a call's text before it is known to be a valid call are held back.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import ClassVar

from jaxllm.server.tool_parsers.call_scanner import CallScanner
from jaxllm.server.tool_parsers.json_scanner import WHITESPACE


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object

    def to_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ExtractedToolCalls:
    content: str | None  # None: only calls
    calls: list[ToolCall]


@dataclass(slots=True)
class ParserDelta:
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker` (it may still become
    the marker, so it is held back)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser:
    """Subclasses implement `_consume(text, final)`: take `text` (more output; `final`: the output
    ended) and report through `_content`, `_feed_call`, `_end_call` and `_end_section`."""

    name: ClassVar[str]
    # The format's markers are special tokens: the server then detokenizes with skip_special_tokens off
    # (unless the request says otherwise), as vLLM does for these parsers.
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, *, stream: bool = True) -> None:
        self.early = stream  # calls go out as soon as their name is known (else once complete)
        self.calls: list[ToolCall] = []
        self._content_out: list[str] = []
        self._calls_out: dict[int, dict] = {}  # this delta's tool-call deltas by call index
        self._held_ws = ""  # whitespace after content: dropped if a call follows
        self._lstrip = False  # a call just ended: whitespace before further content is dropped
        self._live: CallScanner | None = None  # the call whose arguments are streaming
        self._sent = 0  # how much of its arguments went out

    # --- the interface ----------------------------------------------------------------------------
    def feed(self, delta: str) -> ParserDelta:
        self._consume(delta, final=False)
        return self._take()

    def finish(self) -> ParserDelta:
        self._consume("", final=True)
        if self._held_ws:
            self._content_out.append(self._held_ws)
            self._held_ws = ""
        return self._take()

    @property
    def tools_called(self) -> bool:
        return bool(self.calls)

    @classmethod
    def extract(cls, text: str) -> ExtractedToolCalls:
        parser = cls(stream=False)
        content = parser.feed(text).content + parser.finish().content
        if not parser.calls:
            return ExtractedToolCalls(content, [])
        return ExtractedToolCalls(content or None, parser.calls)

    def new_call_id(self) -> str:
        return openai_call_id()

    # --- for the subclasses -------------------------------------------------------------------------
    def _consume(self, text: str, final: bool) -> None:
        raise NotImplementedError

    def _content(self, text: str) -> None:
        """Text that is content, subject to the whitespace rule."""
        if not text:
            return
        if self._lstrip:
            text = text.lstrip()
            if not text:
                return
            self._lstrip = False
        body = text.rstrip()
        if body:
            self._content_out.append(self._held_ws + body)
            self._held_ws = ""
        self._held_ws += text[len(body) :]

    def _feed_call(self, scanner: CallScanner, text: str, name: str | None = None) -> int:
        """Feeds a call object: sends the call when it becomes ready (`name`: when the name is not in
        the object), then its arguments as they come; returns the characters consumed."""
        n = scanner.feed(text)
        if scanner.ready and self._live is None and not scanner.broken:
            self._start_call(scanner, name)
            if n < len(text) and not scanner.done:
                n += scanner.feed(text[n:])
        self._sync_call()
        return n

    def _start_call(self, scanner: CallScanner, name: str | None = None) -> None:
        """`scanner` is ready: the call goes out (with `name` when the name is not in the object)."""
        self._held_ws = ""
        call = ToolCall(self.new_call_id(), name if name is not None else scanner.name, "")
        self.calls.append(call)
        self._calls_out[len(self.calls) - 1] = {
            "index": len(self.calls) - 1,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        self._live, self._sent = scanner, 0
        self._sync_call()

    def _sync_call(self) -> None:
        """Sends the live call's arguments written since the last sync."""
        if self._live is None:
            return
        text = self._live.arguments()
        piece = text[self._sent :]
        if not piece:
            return
        self._sent = len(text)
        index = len(self.calls) - 1
        self.calls[index].arguments += piece
        out = self._calls_out.setdefault(index, {"index": index, "function": {"arguments": ""}})
        out["function"]["arguments"] += piece

    def _end_call(self) -> None:
        self._sync_call()
        self._live = None

    def _end_section(self) -> None:
        """Calls were made and their section ended: whitespace after them is not content."""
        self._held_ws = ""
        self._lstrip = True

    def _take(self) -> ParserDelta:
        out = ParserDelta("".join(self._content_out), list(self._calls_out.values()))
        self._content_out.clear()
        self._calls_out = {}
        return out


class CallRunParser(ToolParser):
    """A format whose answer is call objects one after another (llama3_json, tool_choice "required"):
    `_held` keeps what was read since the start or the last complete call, which is content if no call
    follows; `_buf` is what is not read yet; `_state` is the subclass's, `TEXT` the one where everything
    is content."""

    TEXT: ClassVar[int]

    def __init__(self, *, stream: bool = True) -> None:
        super().__init__(stream=stream)
        self._buf = ""
        self._held = ""
        self._scanner: CallScanner | None = None

    def _hold_whitespace(self) -> None:
        stripped = self._buf.lstrip(WHITESPACE)
        self._held += self._buf[: len(self._buf) - len(stripped)]
        self._buf = stripped

    def _feed_held_call(self, final: bool, after: int) -> bool:
        """Feeds the call object being read; a complete one moves to state `after`, a broken one (or the
        end of the output) makes the rest content. False: wait for more text."""
        s = self._scanner
        n = self._feed_call(s, self._buf)
        self._held += self._buf[:n]
        self._buf = self._buf[n:]
        if s.done:
            self._end_call()
            self._end_section()
            self._held, self._state = "", after
            return True
        if s.broken or final:
            if self._live is not None:  # it went out: keep it, the rest is content
                self._live, self._held = None, ""
            self._to_text()
            return True
        return False

    def _to_text(self) -> None:
        """No (further) call: what was held and everything after it is content."""
        self._content(self._held)
        self._held, self._state = "", self.TEXT
