"""A request's tokens held as two lists, prompt and output, read without concatenating them.

The engine's `Request` and the runner's own `RequestState` both keep their tokens this way (the prompt is
shared, outputs grow by appending), and both slice across the boundary; the runner may not import the
engine's request type, so the slice lives here.
"""

from __future__ import annotations


def slice_tokens(prompt: list[int], output: list[int], start: int, stop: int) -> list[int]:
    """Tokens [start, stop) of `prompt + output` (one list slice, or two joined across the boundary)."""
    p = len(prompt)
    if stop <= p:
        return prompt[start:stop]
    if start >= p:
        return output[start - p : stop - p]
    return prompt[start:] + output[: stop - p]
