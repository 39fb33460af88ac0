"""The output of a request whose tool_choice forces a call, decoded under a JSON schema
(server/tool_choice.py builds the schemas), read as tool calls:

    "required":          [{"name": "get_weather", "parameters": {"city": "Paris"}}, ...]
    a named function:    {"city": "Paris"}            (the text is the arguments)

Under the schema the text is always such JSON; one that is not (the output was cut by max_tokens) is
content, and a stream keeps what it sent, as for the other parsers (base.py).
"""

from __future__ import annotations

from jaxllm.server.tool_parsers.base import ToolCall, ToolParser, openai_call_id
from jaxllm.server.tool_parsers.call_scanner import CallScanner
from jaxllm.server.tool_parsers.json_scanner import WHITESPACE

_OPEN, _FIRST, _ITEM, _NEXT, _AFTER, _TEXT = range(6)


class RequiredToolParser(ToolParser):
    """A JSON array of {"name", "parameters"} objects, each one call."""

    name = "required"

    def __init__(self, *, stream: bool = True) -> None:
        super().__init__(stream=stream)
        self._buf = ""
        self._state = _OPEN
        self._held = ""  # read since the start or the last complete call: content if no call follows
        self._scanner: CallScanner | None = None

    def _consume(self, text: str, final: bool) -> None:
        self._buf += text
        while self._buf or final:
            s = self._state
            if s == _TEXT:
                self._content(self._buf)
                self._buf = ""
                return
            if s == _ITEM:
                if not self._item(final):
                    return
                continue
            if s == _AFTER:  # after "]": whatever follows is content
                self._state = _TEXT
                continue
            stripped = self._buf.lstrip(WHITESPACE)
            self._held += self._buf[: len(self._buf) - len(stripped)]
            self._buf = stripped
            if not self._buf:
                if final:
                    self._to_text()
                return
            ch = self._buf[0]
            if (s == _OPEN and ch == "[") or (s == _NEXT and ch == ","):
                self._held += ch
                self._buf = self._buf[1:]
                self._state = _FIRST
            elif s == _FIRST and ch == "{":
                self._state, self._scanner = _ITEM, CallScanner(("parameters",), early=self.early)
            elif s == _NEXT and ch == "]" and self.calls:
                self._buf = self._buf[1:]
                self._held, self._state = "", _AFTER
            else:
                self._to_text()

    def _item(self, final: bool) -> bool:
        s = self._scanner
        n = self._feed_call(s, self._buf)
        self._held += self._buf[:n]
        self._buf = self._buf[n:]
        if s.done:
            self._end_call()
            self._end_section()
            self._held, self._state = "", _NEXT
            return True
        if s.broken or final:
            if self._live is not None:
                self._live, self._held = None, ""
            self._to_text()
            return True
        return False

    def _to_text(self) -> None:
        self._content(self._held)
        self._held, self._state = "", _TEXT


class NamedToolParser:
    """The whole output is the arguments of the one named function: one call, streamed as written."""

    def __init__(self, function_name: str) -> None:
        self.call = ToolCall("", function_name, "")
        self._started = False

    @property
    def tools_called(self) -> bool:
        return True

    def feed(self, delta: str) -> list[dict]:
        """The tool-call deltas for `delta`."""
        self.call.arguments += delta
        if not self._started:
            self._started = True
            self.call.id = openai_call_id()
            return [
                {
                    "index": 0,
                    "id": self.call.id,
                    "type": "function",
                    "function": {"name": self.call.name, "arguments": delta},
                }
            ]
        return [{"index": 0, "function": {"arguments": delta}}] if delta else []

    def finish(self) -> list[dict]:
        """The call's first delta if the output was empty (its arguments are then "")."""
        return [] if self._started else self.feed("")
