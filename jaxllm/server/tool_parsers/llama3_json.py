"""Llama 3.1 / 3.2 JSON tool calls (`--tool-call-parser llama3_json`): the whole answer is the call,
optionally after `<|python_tag|>`, as the Llama 3 JSON tool-calling prompt asks; several calls are
separated by `;`; the arguments are under "parameters" (Meta's prompt) or "arguments":

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

An output that does not start (after whitespace and the tag) with a call object is content, all of it.
Text after the last call that is not `;` and another call is content (whitespace after the call
dropped). `<|python_tag|>` is a special token: it reaches the text only with skip_special_tokens off.
"""

from __future__ import annotations

from jaxllm.server.tool_parsers.base import CallRunParser
from jaxllm.server.tool_parsers.call_scanner import CallScanner

PYTHON_TAG = "<|python_tag|>"
_LEAD, _CALL, _SEP, _TEXT = range(4)


class Llama3JsonToolParser(CallRunParser):
    name = "llama3_json"
    needs_special_tokens = True
    args_keys = ("parameters", "arguments")
    TEXT = _TEXT

    def __init__(self, *, stream: bool = True) -> None:
        super().__init__(stream=stream)
        self._state = _LEAD
        self._tag_seen = False

    def _consume(self, text: str, final: bool) -> None:
        self._buf += text
        while self._buf or final:
            if self._state == _TEXT:
                self._content(self._buf)
                self._buf = ""
                return
            if self._state == _CALL:
                if not self._feed_held_call(final, after=_SEP):
                    return
                continue
            # _LEAD or _SEP: whitespace, the tag (at the start) or `;` (between calls), then `{`.
            self._hold_whitespace()
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
