"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of a request's last n tokens.

Input-grounded generation (summarising, editing or quoting a given text, code completion over a file)
copies spans of its context; where the last n generated tokens already occurred in the prompt or output,
the tokens that followed them there are a cheap guess of what comes next, which one forward pass then
verifies (jaxllm/spec_decode/verify.py). n runs from `max_n` down to `min_n`: a longer match is a better
guess. Of several earlier occurrences the latest wins (the nearest context: the span being edited or the
sentence being quoted).

Cost: one vectorised scan of the request's tokens per n and step (numpy over an i32 copy the proposer
keeps per request and extends with the new tokens), nothing on the device.
"""

from __future__ import annotations

import numpy as np


class TokenHistory:
    """A request's tokens as a growing i32 array (amortised doubling), so each step appends only its new
    tokens instead of converting the whole list."""

    __slots__ = ("_buf", "_len")

    def __init__(self) -> None:
        self._buf = np.zeros(256, np.int32)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def sync(self, prompt: list[int], output: list[int]) -> np.ndarray:
        """The tokens prompt + output (which only ever grow), appending what is new since the last call."""
        n = len(prompt) + len(output)
        if n < self._len:  # not a continuation (a request id reused): start over
            self._len = 0
        if n > len(self._buf):
            grown = np.zeros(max(n, 2 * len(self._buf)), np.int32)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        p = len(prompt)
        if self._len < p:
            self._buf[self._len : p] = prompt[self._len :]
            self._buf[p:n] = output
        else:
            self._buf[self._len : n] = output[self._len - p :]
        self._len = n
        return self._buf[:n]


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the last n tokens of `tokens`
    (i32[L]), for the largest n in [min_n, max_n] that has one; [] when none does."""
    L = len(tokens)
    if k < 1 or L < min_n + 1:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n :]
        # Starts i < L - n of an earlier occurrence: tokens[i : i + n] == suffix. Candidates by the first
        # token, then narrowed token by token (few survive the first comparison in real text).
        starts = np.flatnonzero(tokens[: L - n] == suffix[0])
        for j in range(1, n):
            if not len(starts):
                break
            starts = starts[tokens[starts + j] == suffix[j]]
        if len(starts):
            i = int(starts[-1]) + n  # what followed the latest occurrence
            return tokens[i : min(L, i + k)].tolist()
    return []
