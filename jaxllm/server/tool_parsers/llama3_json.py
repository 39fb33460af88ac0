"""Llama 3.1 / 3.2 JSON tool calls (`--tool-call-parser llama3_json`): the whole answer is the call,
optionally after `<|python_tag|>`, as the Llama 3 JSON tool-calling prompt asks; several calls are
separated by `;`; the arguments are under "parameters" (Meta's prompt) or "arguments":

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

An output that does not start (after whitespace and the tag) with a call object is content, all of it.
Text after the last call that is not `;` and another call is content (whitespace after the call
dropped). `<|python_tag|>` is a special token: it reaches the text only with skip_special_tokens off.
"""

from __future__ import annotations

from jaxllm.server.tool_parsers.base import ToolParser
from jaxllm.server.tool_parsers.call_scanner import CallScanner
from jaxllm.server.tool_parsers.json_scanner import WHITESPACE

PYTHON_TAG = "<|python_tag|>"
_LEAD, _CALL, _SEP, _TEXT = range(4)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    needs_special_tokens = True
    args_keys = ("parameters", "arguments")

    def __init__(self, *, stream: bool = True) -> None:
        super().__init__(stream=stream)
        self._buf = ""
        self._state = _LEAD
        self._held = ""  # text read since the last call (or the start) that is content if no call follows
        self._tag_seen = False
        self._scanner: CallScanner | None = None

    def _consume(self, text: str, final: bool) -> None:
        self._buf += text
        while self._buf or final:
            if self._state == _TEXT:
                self._content(self._buf)
                self._buf = ""
                return
            if self._state == _CALL:
                if not self._call(final):
                    return
                continue
            # _LEAD or _SEP: whitespace, the tag (at the start) or `;` (between calls), then `{`.
            stripped = self._buf.lstrip(WHITESPACE)
            self._held += self._buf[: len(self._buf) - len(stripped)]
            self._buf = stripped
            if not self._buf:
                if final:
                    self._to_text()
                return
            if self._state == _LEAD and not self._tag_seen and self._buf[0] == "<":
                if self._buf.startswith(PYTHON_TAG):
                    self._held += PYTHON_TAG
                    self._buf = self._buf[len(PYTHON_TAG) :]
                    self._tag_seen = True
                    continue
                if PYTHON_TAG.startswith(self._buf) and not final:
                    return  # may still become the tag
                self._to_text()
                continue
            if self._state == _SEP and self._buf[0] == ";" and ";" not in self._held:
                self._held += ";"
                self._buf = self._buf[1:]
                continue
            if self._buf[0] == "{" and (self._state == _LEAD or ";" in self._held):
                self._state, self._scanner = _CALL, CallScanner(self.args_keys, early=self.early)
                continue
            self._to_text()

    def _call(self, final: bool) -> bool:
        """Feeds the call object; False: wait for more text."""
        s = self._scanner
        n = self._feed_call(s, self._buf)
        self._held += self._buf[:n]
        self._buf = self._buf[n:]
        if s.done:
            self._end_call()
            self._end_section()
            self._held, self._state = "", _SEP
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
        self._held, self._state = "", _TEXT
