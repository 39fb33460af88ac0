"""Mistral tool calls (`--tool-call-parser mistral`), after the `[TOOL_CALLS]` token, in either form:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]    (v3 tokenizers)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}             (v11 and later)

Text before the first `[TOOL_CALLS]` is content, and so is text after a section of calls (whitespace
next to the calls dropped). A section that turns out to hold no valid call is content as written, and
the text after its `[TOOL_CALLS]` is read again as content that may open another section; when a list
breaks after some of its calls, those stand and the text after the last good one is read again so.
Ids are 9 letters and digits: Mistral's chat templates refuse other ids when the calls come back.
`[TOOL_CALLS]` and `[ARGS]` are special tokens: they reach the text only with skip_special_tokens off.
"""

from __future__ import annotations

import random
import string

from jaxllm.server.tool_parsers.base import ToolParser, partial_marker_len
from jaxllm.server.tool_parsers.call_scanner import CallScanner
from jaxllm.server.tool_parsers.json_scanner import WHITESPACE

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME_CHARS = set(string.ascii_letters + string.digits + "_-.")
_ID_CHARS = string.ascii_letters + string.digits

# _SECTION: after [TOOL_CALLS]; _LIST_OPEN: after "["; _ITEM: a call object of the list; _LIST_NEXT:
# after one ("," or "]"); _LIST_ITEM: after ","; _NAME: a function name before [ARGS]; _ARGS_OPEN: after
# [ARGS]; _ARGS: its arguments object.
_TEXT, _SECTION, _LIST_OPEN, _ITEM, _LIST_NEXT, _LIST_ITEM, _NAME, _ARGS_OPEN, _ARGS = range(9)


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def __init__(self, *, stream: bool = True) -> None:
        super().__init__(stream=stream)
        self._buf = ""
        self._state = _TEXT
        self._pending = ""  # section text since its marker or its last complete call: reread if it breaks
        self._section_calls = 0
        self._fname = ""
        self._scanner: CallScanner | None = None

    def new_call_id(self) -> str:
        return "".join(random.choices(_ID_CHARS, k=9))

    def _consume(self, text: str, final: bool) -> None:
        self._buf += text
        while True:
            if self._state == _TEXT:
                i = self._buf.find(TOOL_CALLS)
                if i < 0:
                    keep = 0 if final else partial_marker_len(self._buf, TOOL_CALLS)
                    self._content(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return
                self._content(self._buf[:i])
                self._buf = self._buf[i + len(TOOL_CALLS) :]
                self._state, self._pending, self._section_calls = _SECTION, "", 0
                continue
            if self._state in (_ITEM, _ARGS):
                if not self._scan(final):
                    return
                continue
            if not self._buf:
                if final:
                    self._break()
                    continue
                return
            if not self._step(final):
                return

    def _advance(self, n: int) -> None:
        self._pending += self._buf[:n]
        self._buf = self._buf[n:]

    def _step(self, final: bool) -> bool:
        """One move in the states between call objects; False: wait for more text."""
        s, ch = self._state, self._buf[0]
        if s == _NAME:
            if ch in _NAME_CHARS:
                self._advance(1)
                self._fname += ch
            elif self._buf.startswith(ARGS) and self._fname:
                self._advance(len(ARGS))
                self._state = _ARGS_OPEN
            elif partial_marker_len(self._buf, ARGS) == len(self._buf) and self._fname and not final:
                return False
            else:
                self._break()
            return True
        if ch in WHITESPACE:
            self._advance(1)
            return True
        if s == _SECTION and ch == "[":
            self._advance(1)
            self._state = _LIST_OPEN
        elif s == _SECTION and ch in _NAME_CHARS:
            self._fname, self._state = "", _NAME
        elif s in (_LIST_OPEN, _LIST_ITEM) and ch == "{":
            self._state, self._scanner = _ITEM, CallScanner(early=self.early)
        elif s == _ARGS_OPEN and ch == "{":
            self._state, self._scanner = _ARGS, CallScanner(None, early=self.early)
        elif s == _LIST_NEXT and ch == ",":
            self._advance(1)
            self._state = _LIST_ITEM
        elif s == _LIST_NEXT and ch == "]":
            self._buf = self._buf[1:]
            self._end_section()
            self._state = _TEXT
        else:
            self._break()
        return True

    def _scan(self, final: bool) -> bool:
        """Feeds the call object (or the [ARGS] object); False: wait for more text."""
        sc = self._scanner
        self._advance(self._feed_call(sc, self._buf, self._fname if self._state == _ARGS else None))
        if sc.done:
            self._end_call()
            self._pending, self._section_calls = "", self._section_calls + 1
            if self._state == _ARGS:
                self._end_section()
                self._state = _TEXT
            else:
                self._state = _LIST_NEXT
            return True
        if sc.broken or final:
            if self._live is not None:  # it went out: it stays; the rest is read as text
                self._live, self._pending = None, ""
                self._state = _TEXT
            else:
                self._break()
            return True
        return False

    def _break(self) -> None:
        """The section holds no further call: its unsent text is read again as text."""
        if self._section_calls:
            self._end_section()
        else:
            self._content(TOOL_CALLS)
        self._buf = self._pending + self._buf
        self._pending, self._state = "", _TEXT
