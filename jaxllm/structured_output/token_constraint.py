"""One request's rules on which tokens it may draw, and how a step turns them into the sampler's arrays.

    SamplingParams (+ CompiledGrammar, bad words as token ids) --TokenConstraint.create--> per request
    each sampling step, for the rows that have one:
      advance(output ids, the token still in flight) -> the grammar matcher consumes what it has not seen
      fill_token_bitmask(mask, rows)        -> i32[S, W] bitmask, bit t of row r set = token t allowed
                                  (grammar rows filled together on llguidance's threads; AND allowed_token_ids)
      banned_ids(...) -> bad words that the next token would complete (into the sampler's suppressed ids)
    logit_bias -> bias_arrays(rows) -> (ids i32[S, L], values f32[S, L]), added before any other step

W = ceil(V / 32). A row with no constraint has every bit set, so a free row's logits pass unchanged and
its tokens are the same whatever its neighbours ask.

bad_words (vLLM's semantics): each word is tokenized as it would appear at the start of the output and
after a space; a one-token word is never drawn, a longer one's last token is not drawn right after the
rest of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

_MIN_BIAS_WIDTH = 16
_executor = None


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def _ll_executor():
    global _executor
    if _executor is None:
        import llguidance

        _executor = llguidance.LLExecutor()
    return _executor


def allowed_ids_bitmask(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:  # i32[W]
    bits = np.zeros(bitmask_width(vocab_size) * 32, np.uint8)
    bits[np.asarray(token_ids, np.int64)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def bitmask_allows(row: np.ndarray, token_id: int) -> bool:
    """Whether bit `token_id` of one bitmask row (i32[W]) is set."""
    return bool((int(row[token_id >> 5]) >> (token_id & 31)) & 1)


@dataclass(slots=True, eq=False)
class TokenConstraint:
    """The runner's view of one request's token rules (held by its RequestState)."""

    matcher: object | None = None  # llguidance.LLMatcher, advanced with every token the request drew
    allowed: np.ndarray | None = None  # i32[W] bitmask of allowed_token_ids
    bad_single: list[int] = field(default_factory=list)  # never drawn
    bad_multi: list[list[int]] = field(default_factory=list)  # last token banned after the others
    num_consumed: int = 0  # output tokens the matcher has consumed

    @classmethod
    def create(
        cls, params, vocab_size: int, grammar=None, bad_words_token_ids: Sequence[Sequence[int]] = ()
    ) -> TokenConstraint | None:
        """None when the request constrains nothing (no grammar, allowed ids nor bad words)."""
        matcher = grammar.new_matcher() if grammar is not None else None
        allowed = (
            allowed_ids_bitmask(params.allowed_token_ids, vocab_size)
            if params.allowed_token_ids is not None
            else None
        )
        single = sorted({w[0] for w in bad_words_token_ids if len(w) == 1})
        multi = [list(w) for w in bad_words_token_ids if len(w) > 1]
        if matcher is None and allowed is None and not single and not multi:
            return None
        return cls(matcher, allowed, single, multi)

    @property
    def needs_mask(self) -> bool:
        return self.matcher is not None or self.allowed is not None

    @property
    def needs_last_token(self) -> bool:
        """The rules depend on the tokens drawn so far (a grammar, a bad word of several tokens): a step
        needs the token still in flight before it can build this row's mask or banned ids."""
        return self.matcher is not None or bool(self.bad_multi)

    def advance(self, output_token_ids: Sequence[int], in_flight: Sequence[int] = ()) -> None:
        """Feed the matcher the tokens drawn since it last saw the request: the collected outputs, then
        those still in flight (async scheduling: read back from the previous step's device output)."""
        if self.matcher is None:
            return
        n = len(output_token_ids) + len(in_flight)
        if self.num_consumed >= n:
            return
        done = len(output_token_ids)
        new = list(output_token_ids[self.num_consumed :]) + list(
            in_flight[max(0, self.num_consumed - done) :]
        )
        # A token the mask allowed is always accepted; one it did not (a stop token the engine added,
        # max_tokens cutting a token short) puts the matcher in its error state, which allows only EOS.
        self.matcher.consume_tokens(new)
        self.num_consumed = n

    def banned_ids(self, output_token_ids: Sequence[int], in_flight: Sequence[int] = ()) -> list[int]:
        """Ids the next token may not be: one-token bad words, and the last token of any longer one whose
        other tokens end the output."""
        if not self.bad_multi:
            return self.bad_single
        out = list(self.bad_single)
        longest = max(len(w) for w in self.bad_multi) - 1
        tail = list(output_token_ids[-longest:]) + list(in_flight)
        for word in self.bad_multi:
            prefix = word[:-1]
            if len(tail) >= len(prefix) and tail[len(tail) - len(prefix) :] == prefix:
                out.append(word[-1])
        return out


def fill_token_bitmask(mask: np.ndarray, constraints: Mapping[int, TokenConstraint]) -> None:
    """Fills the step's bitmask (i32[S, W], every bit set) in place: row r of `constraints` gets its
    grammar's next-token mask AND its allowed_token_ids; the other rows (free) keep every bit. The grammar
    rows are filled together by llguidance, in parallel and without the GIL."""
    grammar_rows = [(c.matcher, i) for i, c in constraints.items() if c.matcher is not None]
    if grammar_rows:
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask_par(_ll_executor(), grammar_rows, mask)
    for i, c in constraints.items():
        if c.allowed is not None:
            mask[i] &= c.allowed


def bias_arrays(
    biases: Sequence[dict[int, float] | None],  # per row
    num_rows_padded: int,  # S
) -> tuple[np.ndarray, np.ndarray]:  # i32[S, L] ids (-1 padded), f32[S, L] values
    """logit_bias as a sparse list per row; L is the next power of two of the longest, at least 16."""
    longest = max((len(b) for b in biases if b), default=0)
    width = max(_MIN_BIAS_WIDTH, 1 << max(0, longest - 1).bit_length())
    ids = np.full((num_rows_padded, width), -1, np.int32)
    values = np.zeros((num_rows_padded, width), np.float32)
    for i, b in enumerate(biases):
        if b:
            ids[i, : len(b)] = list(b.keys())
            values[i, : len(b)] = list(b.values())
    return ids, values
