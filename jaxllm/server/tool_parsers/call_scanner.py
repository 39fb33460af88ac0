"""One tool-call object as a model writes it: `{"name": "<function>", "<args key>": {...}, ...}`.

Built on `JsonScanner`: the members "name" (a string) and the arguments (an object, under one of
`args_keys`: "arguments" for hermes and mistral, also "parameters" for llama3_json and tool_choice
"required") are picked out as they complete; other members are ignored, and so are repeats of either
(the first one counts: it may already have been streamed).

`ready` says the call may be sent. With `early` (streaming) that is as soon as the name is complete and
the arguments object has opened, so the arguments can then stream as they are written; to make that
point exact whatever the deltas are, characters are fed one at a time until then. Without `early` (one
whole text) it is when the object is complete. `broken`: the text cannot be such an object (invalid
JSON, a name that is not a string, arguments that are not an object, a member missing at the end).

With `args_keys=None` the object is the arguments themselves (the name was written outside it, as in
mistral's `name[ARGS]{...}`): it is ready as soon as it opens (or, without `early`, once complete).
"""

from __future__ import annotations

import json

from jaxllm.server.tool_parsers.json_scanner import JsonScanner

ARGUMENTS = ("arguments",)


class CallScanner:
    def __init__(self, args_keys: tuple[str, ...] | None = ARGUMENTS, *, early: bool = True) -> None:
        self.json = JsonScanner()
        self.args_keys = args_keys
        self.early = early
        self.broken = False
        self.ready = False
        self.name: str | None = None
        self.args_start: int | None = None  # where the arguments object starts in json.text
        self.args_end: int | None = None  # and ends (None: still being written)

    @property
    def done(self) -> bool:
        """The object is complete and is a tool call."""
        return self.json.done and not self.broken

    @property
    def text(self) -> str:
        return self.json.text

    def arguments(self) -> str:
        """The arguments' JSON text so far (all of it once `args_end` is known)."""
        if self.args_start is None:
            return ""
        return self.json.text[self.args_start : self.args_end]

    def feed(self, text: str) -> int:
        """Consumes characters of `text`, stopping at the object's end, at a fault, or (with `early`) just
        after the call became ready, so that the caller sends it before reading on; returns how many."""
        if not self.early or self.ready:
            n = self.json.feed(text)
            self._update()
            return n
        n = 0
        while n < len(text) and not (self.ready or self.broken or self.json.done):
            if not self.json.feed(text[n]):
                self._update()
                break
            n += 1
            self._update()
        return n

    def _update(self) -> None:
        if self.broken:
            return
        if self.json.error:
            self.broken = True
            return
        js = self.json
        if self.args_keys is None:
            self.args_start = 0
            self.args_end = len(js.text) if js.done else None
            self.ready = self.early or js.done
            return
        for key, start, end in js.members:
            self._see(key, start, end)
        if js.member_start is not None:
            self._see(js.member_key, js.member_start, None)
        if js.done and (self.name is None or self.args_start is None):
            self.broken = True
            return
        if not self.broken:
            self.ready = (self.name is not None and self.args_start is not None) if self.early else js.done

    def _see(self, key: str | None, start: int, end: int | None) -> None:
        """A member whose value starts at `start` (and ends at `end`, once complete)."""
        first = self.json.text[start]
        if key == "name" and self.name is None:
            if first != '"':
                self.broken = True
            elif end is not None:
                self.name = json.loads(self.json.text[start:end])
        elif key in self.args_keys and (self.args_start is None or self.args_start == start):
            if first != "{":
                self.broken = True
            else:
                self.args_start, self.args_end = start, end
