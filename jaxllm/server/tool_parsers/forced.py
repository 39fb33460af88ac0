"""The output of a request whose tool_choice forces a call, decoded under a JSON schema
(server/tool_choice.py builds the schemas), read as tool calls:

    "required":          [{"name": "get_weather", "parameters": {"city": "Paris"}}, ...]
    a named function:    {"city": "Paris"}            (the text is the arguments)

Under the schema the text is always such JSON; one that is not (the output was cut by max_tokens) is
content, and a stream keeps what it sent, as for the other parsers (base.py).
"""

from __future__ import annotations

from jaxllm.server.tool_parsers.base import CallRunParser, ToolCall, openai_call_id
from jaxllm.server.tool_parsers.call_scanner import CallScanner

_OPEN, _FIRST, _ITEM, _NEXT, _AFTER, _TEXT = range(6)


class RequiredToolParser(CallRunParser):
    """A JSON array of {"name", "parameters"} objects, each one call."""

    name = "required"
    TEXT = _TEXT

    def __init__(self, *, stream: bool = True) -> None:
        super().__init__(stream=stream)
        self._state = _OPEN

    def _consume(self, text: str, final: bool) -> None:
        self._buf += text
        while self._buf or final:
            s = self._state
            if s == _TEXT:
                self._content(self._buf)
                self._buf = ""
                return
            if s == _ITEM:
                if not self._feed_held_call(final, after=_NEXT):
                    return
                continue
            if s == _AFTER:  # after "]": whatever follows is content
                self._state = _TEXT
                continue
            self._hold_whitespace()
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
