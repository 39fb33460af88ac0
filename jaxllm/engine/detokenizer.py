"""Token ids -> text, a few tokens at a time, and the stop-string checks on the growing text (host only).

Data flow per request: the output processor calls `IncrementalDetokenizer.step(new_ids)` with each
step's new tokens and gets the text they add (the delta); with stop strings it appends the delta to the
text not yet released, calls `check_stop_strings` on that, and releases all of it but its last
`stop_holdback_len(text, stops)` characters; when the request finishes, `flush()` returns anything the
detokenizer still holds back.

Incremental decoding (as vLLM does it): keep two offsets into the token list, `prefix` and `read`.
Each step decodes only tokens[prefix:read] (text already returned) and tokens[prefix:] (the same plus
the new tokens); the delta is the difference. Decoding a few tokens of left context rather than one
token alone keeps what depends on neighbours right (a leading space, bytes of one character spread
over several byte-level tokens). When the new text ends in U+FFFD the last character is incomplete:
nothing is returned and the offsets stay, so the next step decodes the bytes together.

The concatenated deltas equal `tokenizer.decode(output_ids)`. The first window starts at the first
output token (`context_tokens=0`); vLLM instead starts it with the last 5 prompt tokens, which makes no
difference for byte-level BPE (Llama-3, Qwen, SmolLM2) but keeps the leading space of a SentencePiece
model's first token (" Hello" where decode(output_ids) gives "Hello"): pass `context_tokens=5` for that.

`spaces_between_special_tokens` is passed to `decode`, which only slow (Python) tokenizers honour;
`clean_up_tokenization_spaces` is off, since cleaning a window is not cleaning the whole text.

For a fast (Rust `tokenizers`) tokenizer whose class keeps transformers' own `_decode`, the windows are
decoded by its Rust tokenizer directly: what `decode` returns with cleaning off, without its Python
layers (argument conversion, batch checks), which cost several times the decode itself, twice per
request and step.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxllm.compat import rust_decoder

_REPLACEMENT = "\ufffd"
DEFAULT_CONTEXT_TOKENS = 0


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        *,
        context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    ) -> None:
        if context_tokens < 0:
            raise ValueError(f"context_tokens={context_tokens} must be >= 0")
        self.tokenizer = tokenizer
        self._kwargs = dict(
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        self._rust = rust_decoder(tokenizer)
        context = list(prompt_token_ids[len(prompt_token_ids) - context_tokens :]) if context_tokens else []
        # The window is tokens[prefix:]; `_read` indexes into it: tokens before it are already text.
        self._window: list[int] = context
        self._read = len(context)
        self._prefix_text = self._decode(context)
        self.output_token_ids: list[int] = []
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._rust is not None:
            return self._rust.decode(ids, skip_special_tokens=self._kwargs["skip_special_tokens"])
        return self.tokenizer.decode(ids, **self._kwargs)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """The text that `new_token_ids` complete; "" while a character's bytes are still arriving."""
        self.output_token_ids.extend(new_token_ids)
        self._window.extend(new_token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end: whatever was held back (an incomplete character decodes as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        if self._read == len(self._window):
            return ""
        new_text = self._decode(self._window)
        if len(new_text) <= len(self._prefix_text) or (not final and new_text.endswith(_REPLACEMENT)):
            return ""
        delta = new_text[len(self._prefix_text) :]
        # Slide: the tokens just read become the next step's left context.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        self.output_text += delta
        return delta


def check_stop_strings(
    text: str,
    new_delta_len: int,
    stop_list: Sequence[str],
    include_stop_str_in_output: bool,
) -> tuple[str | None, str]:
    """Looks for a stop string that ends inside the last `new_delta_len` characters of `text` (earlier
    ones were checked by earlier calls), so one that spans token boundaries is found.

    Returns (the stop string, text truncated before it, or after it if `include_stop_str_in_output`),
    or (None, text). Of several matches the earliest wins."""
    best: tuple[int, str] | None = None
    for stop in stop_list:
        start = max(0, len(text) - new_delta_len - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    if best is None:
        return None, text
    i, stop = best
    return stop, text[: i + len(stop)] if include_stop_str_in_output else text[:i]


def stop_holdback_len(text: str, stop_list: Sequence[str]) -> int:
    """How many trailing characters of `text` not to stream yet: the longest end of `text` that is the
    beginning of a stop string (at most len(longest stop) - 1), so streamed text is never taken back."""
    hold = 0
    for stop in stop_list:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return hold
