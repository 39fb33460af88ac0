"""Hermes-style tool calls (`--tool-call-parser hermes` or `qwen`): each call is a JSON object inside
`<tool_call>` ... `</tool_call>`, anywhere in the output, with content before, between and after:

    I'll check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block's text up to the first `</tool_call>` (or the end of the output) must begin, after whitespace,
with a call object; what follows that object inside the block is ignored. A block that does not hold one
(invalid JSON, no name, arguments that are not an object) stays in the content as written, and parsing
goes on after it.
"""

from __future__ import annotations

from jaxllm.server.tool_parsers.base import ToolParser, partial_marker_len
from jaxllm.server.tool_parsers.call_scanner import CallScanner
from jaxllm.server.tool_parsers.json_scanner import WHITESPACE

# Where in the text the machine is.
_TEXT, _OPEN, _CALL, _TAIL, _BROKEN = range(5)


class HermesToolParser(ToolParser):
    name = "hermes"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def __init__(self, *, stream: bool = True) -> None:
        super().__init__(stream=stream)
        self._buf = ""  # text not yet processed (a partial marker at most, between calls)
        self._state = _TEXT
        self._block = ""  # the open block's text so far, marker included: content if it is no call
        self._scanner: CallScanner | None = None

    def _consume(self, text: str, final: bool) -> None:
        self._buf += text
        while True:
            if self._state == _TEXT:
                i = self._buf.find(self.start_marker)
                if i < 0:
                    keep = 0 if final else partial_marker_len(self._buf, self.start_marker)
                    self._content(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return
                self._content(self._buf[:i])
                self._buf = self._buf[i + len(self.start_marker) :]
                self._block, self._state, self._scanner = self.start_marker, _OPEN, None
                continue
            j = self._buf.find(self.end_marker)
            if j >= 0:
                body, self._buf = self._buf[:j], self._buf[j + len(self.end_marker) :]
            else:
                keep = 0 if final else partial_marker_len(self._buf, self.end_marker)
                body, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
            self._body(body)
            if j >= 0:
                self._close_block(self.end_marker)
            elif final:
                self._close_block("")
            else:
                return

    def _body(self, body: str) -> None:
        """Text inside the open block (no end marker in it)."""
        if self._state == _OPEN:
            stripped = body.lstrip(WHITESPACE)
            self._block += body[: len(body) - len(stripped)]
            body = stripped
            if not body:
                return
            if body[0] != "{":
                self._break_block()
            else:
                self._state, self._scanner = _CALL, CallScanner(early=self.early)
        if self._state == _CALL:
            s = self._scanner
            n = self._feed_call(s, body)
            self._block += body[:n]
            body = body[n:]
            if s.broken:
                self._break_block()
            elif s.done:
                self._end_call()
                self._state = _TAIL
                return
        if self._state == _BROKEN:
            self._content(body)

    def _break_block(self) -> None:
        """The block is no call: its text so far is content (from the fault on, if the call went out)."""
        if self._live is None:
            self._content(self._block)
        self._live = None
        self._state = _BROKEN

    def _close_block(self, marker: str) -> None:
        if self._state == _TAIL:
            self._end_section()
        else:
            if self._state in (_OPEN, _CALL):
                self._break_block()
            self._content(marker)
        self._state = _TEXT


class QwenToolParser(HermesToolParser):
    """Qwen2.5 and Qwen3 write hermes' format exactly (their chat templates ask for it:
    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`), so `qwen` is `hermes`."""

    name = "qwen"
