"""Strict JSON, checked one character at a time as a model writes it.

A tool call's arguments are streamed while they are generated, so the parser must know, after every
delta, whether the text so far can still become valid JSON, where the value ends, and which top-level
member it is in. `JsonScanner.feed(text)` consumes characters until the value is complete or a character
cannot continue it; it never looks ahead, so feeding a text in one piece or in any split gives the same
state. It accepts exactly what `json.loads` accepts, minus NaN / Infinity (not JSON, and not valid in
a tool call's arguments).

For a top-level object it records each member: its decoded key and the [start, end) span of its value in
the consumed text (`members`), and while a member's value is being written, its key and start
(`member_key`, `member_start`). Offsets index `text`, everything consumed so far.
"""

from __future__ import annotations

import json

WHITESPACE = " \t\n\r"
_HEX = set("0123456789abcdefABCDEF")
_ESCAPES = set('"\\/bfnrt')
_DIGITS = set("0123456789")

# What the scanner expects next.
_VALUE, _KEY_OR_CLOSE, _KEY, _COLON, _COMMA_OR_CLOSE_OBJ, _VALUE_OR_CLOSE, _COMMA_OR_CLOSE_ARR = range(7)
_STRING, _ESCAPE, _UNICODE, _NUMBER, _LITERAL, _DONE = range(7, 13)

# Number sub-states (JSON's grammar: -?(0|[1-9]d*)(.d+)?([eE][+-]?d+)?); True: may end here.
_N_SIGN, _N_ZERO, _N_INT, _N_DOT, _N_FRAC, _N_E, _N_E_SIGN, _N_EXP = range(8)
_NUMBER_MAY_END = {_N_ZERO, _N_INT, _N_FRAC, _N_EXP}


class JsonScanner:
    def __init__(self) -> None:
        self.text = ""  # everything consumed
        self.error = False  # a character could not continue the value (it was not consumed)
        self._stack: list[str] = []  # "{" or "[" per open container
        self._state = _VALUE
        self._string_is_key = False
        self._string_start = 0
        self._hex_left = 0
        self._number = _N_SIGN
        self._literal = ""
        self._literal_pos = 0
        self._at = 0
        self.members: list[tuple[str, int, int]] = []  # top-level object: (key, value start, value end)
        self.member_key: str | None = None  # key of the top-level member whose value is being scanned
        self.member_start: int | None = None  # where that value starts (None: not started yet)

    @property
    def done(self) -> bool:
        return self._state == _DONE

    def end(self) -> None:
        """The text ended: a top-level number that may end here is complete; anything else unfinished
        stays unfinished (`done` False)."""
        if self._state == _NUMBER and not self._stack and self._number in _NUMBER_MAY_END:
            self._state = _DONE

    def feed(self, text: str) -> int:
        """Consumes characters of `text` until the value is complete or one cannot continue it (then
        `error` is set); returns how many were consumed."""
        base = len(self.text)
        self.text += text  # cut back below to what was consumed; positions index it meanwhile
        n = 0
        for ch in text:
            if self._state == _DONE or self.error:
                break
            self._at = base + n
            if not self._step(ch):
                if self._state != _DONE:
                    self.error = True
                break
            n += 1
        if n < len(text):
            self.text = self.text[: base + n]
        return n

    # --- one character ----------------------------------------------------------------------------
    def _pos(self) -> int:
        """The position of the character being consumed."""
        return self._at

    def _step(self, ch: str) -> bool:
        """Consumes `ch` (True) or refuses it (False: an error, or the end of a top-level number)."""
        s = self._state
        if s == _STRING:
            if ch == '"':
                self._end_string()
            elif ch == "\\":
                self._state = _ESCAPE
            elif ord(ch) < 0x20:
                return False
            return True
        if s == _ESCAPE:
            if ch == "u":
                self._state, self._hex_left = _UNICODE, 4
                return True
            if ch in _ESCAPES:
                self._state = _STRING
                return True
            return False
        if s == _UNICODE:
            if ch not in _HEX:
                return False
            self._hex_left -= 1
            if not self._hex_left:
                self._state = _STRING
            return True
        if s == _NUMBER:
            if self._number_step(ch):
                return True
            if self._number not in _NUMBER_MAY_END:
                return False
            self._value_done()  # the number ended just before `ch`, which the state after it takes
            if self._state == _DONE:
                return False
            return self._step(ch)
        if s == _LITERAL:
            if ch != self._literal[self._literal_pos]:
                return False
            self._literal_pos += 1
            if self._literal_pos == len(self._literal):
                self._value_done(offset=1)
            return True
        if ch in WHITESPACE:
            return True
        if s in (_VALUE, _VALUE_OR_CLOSE):
            if s == _VALUE_OR_CLOSE and ch == "]":
                self._close()
                return True
            return self._begin_value(ch)
        if s in (_KEY_OR_CLOSE, _KEY):
            if s == _KEY_OR_CLOSE and ch == "}":
                self._close()
                return True
            if ch != '"':
                return False
            self._state, self._string_is_key, self._string_start = _STRING, True, self._pos()
            return True
        if s == _COLON:
            if ch != ":":
                return False
            self._state = _VALUE
            return True
        if s == _COMMA_OR_CLOSE_OBJ:
            if ch == ",":
                self._state = _KEY
            elif ch == "}":
                self._close()
            else:
                return False
            return True
        if s == _COMMA_OR_CLOSE_ARR:
            if ch == ",":
                self._state = _VALUE
            elif ch == "]":
                self._close()
            else:
                return False
            return True
        return False

    def _begin_value(self, ch: str) -> bool:
        if len(self._stack) == 1 and self._stack[0] == "{":
            self.member_start = self._pos()
        if ch == "{":
            self._stack.append("{")
            self._state = _KEY_OR_CLOSE
        elif ch == "[":
            self._stack.append("[")
            self._state = _VALUE_OR_CLOSE
        elif ch == '"':
            self._state, self._string_is_key = _STRING, False
        elif ch == "-" or ch in _DIGITS:
            self._state = _NUMBER
            self._number = _N_SIGN if ch == "-" else _N_ZERO if ch == "0" else _N_INT
        elif ch in "tfn":
            self._state = _LITERAL
            self._literal = {"t": "true", "f": "false", "n": "null"}[ch]
            self._literal_pos = 1
        else:
            if len(self._stack) == 1:
                self.member_start = None
            return False
        return True

    def _number_step(self, ch: str) -> bool:
        n = self._number
        digit = ch in _DIGITS
        if n == _N_SIGN and digit:
            self._number = _N_ZERO if ch == "0" else _N_INT
        elif n == _N_INT and digit:
            pass
        elif n in (_N_ZERO, _N_INT) and ch == ".":
            self._number = _N_DOT
        elif n in (_N_DOT, _N_FRAC) and digit:
            self._number = _N_FRAC
        elif n in (_N_ZERO, _N_INT, _N_FRAC) and ch in "eE":
            self._number = _N_E
        elif n == _N_E and ch in "+-":
            self._number = _N_E_SIGN
        elif n in (_N_E, _N_E_SIGN, _N_EXP) and digit:
            self._number = _N_EXP
        else:
            return False
        return True

    def _end_string(self) -> None:
        if self._string_is_key:
            self._state = _COLON
            if len(self._stack) == 1:
                self.member_key = json.loads(self.text[self._string_start : self._pos() + 1])
                self.member_start = None
        else:
            self._value_done(offset=1)

    def _close(self) -> None:
        self._stack.pop()
        self._value_done(offset=1)

    def _value_done(self, offset: int = 0) -> None:
        """A value ended; `offset` 1: the character being consumed is its last (a quote, bracket or the
        literal's last letter), 0: it ended before that character (a number)."""
        if not self._stack:
            self._state = _DONE
            return
        if len(self._stack) == 1 and self._stack[0] == "{" and self.member_start is not None:
            self.members.append((self.member_key, self.member_start, self._pos() + offset))
            self.member_key, self.member_start = None, None
        self._state = _COMMA_OR_CLOSE_OBJ if self._stack[-1] == "{" else _COMMA_OR_CLOSE_ARR
