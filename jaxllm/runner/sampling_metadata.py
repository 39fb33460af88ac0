"""Host side of sampling: a batch of requests' `SamplingParams` -> fixed-shape arrays for `sampler.sample`.

Data flow: the runner lists one `SamplingRow` per scheduled request in row order (None for a request
that samples nothing this step), then
  - `build_sampling_metadata(rows, num_rows_padded, vocab_size)` -> `SamplingMetadata`: numpy arrays
    of static shape (padded to S rows), passed into the jitted sampler;
  - `SamplerFlags.for_rows(rows, max_logprobs)` -> hashable flags, the static `flags` argument of
    `sampler.sample`, so a batch without penalties / top-k / top-p / logprobs runs a program without
    them. `SamplerFlags.all_variants` lists every program, for compiling ahead.

Dimension letters: S padded rows, H token-history width, K suppressed ids per row.

Randomness: row r draws its k-th generated token (k = len(output_token_ids)) with
`fold_in(PRNGKey(seed), k)`; the folding happens on the device (sampler.row_keys), the host only
splits the 64-bit seed into the two u32 words of a threefry key, which is what PRNGKey(seed) does.

Token history (built only when some row uses a penalty; otherwise H = 0, nothing to transfer): prompt
+ output ids of each row, -1 padded, with a flag marking the generated ones. H is static: by default
the next power of two of the longest history (at least 64), so a server compiles O(log max_model_len)
penalty programs per row bucket; pass `history_width=max_model_len` for a single, wider one.
min_tokens suppression lists at most K ids per row, K the next power of two of the longest list, at
least 8 (one shape unless a request lists more than 8 stop_token_ids); bad words the next token would
complete join that list.

Token rules (flags.do_token_mask, when a row has a grammar, allowed_token_ids or logit_bias): a bitmask
i32[S, W] (W = ceil(V / 32); every bit set on free rows) and a sparse logit bias (ids, values)[S, L],
built by jaxllm/structured_output/token_constraint.py. Without the flag both have width 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

from jaxllm.sampling_params import SamplingParams
from jaxllm.structured_output.token_constraint import (
    TokenConstraint,
    bias_arrays,
    bitmask_width,
    fill_token_bitmask,
)

# Logprobs are computed for this many top tokens whenever any request in the step asks (one static width).
MAX_LOGPROBS = 20
_MIN_HISTORY_WIDTH = 64
_MIN_SUPPRESS_WIDTH = 8
_U32 = 0xFFFFFFFF


def _next_pow2(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """What the sampler needs of one request (each RequestState holds one, with its live token lists)."""

    params: SamplingParams
    seed: int  # the request's sampling_seed
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_id: int | Sequence[int] | None = None
    constraint: TokenConstraint | None = None  # grammar, allowed_token_ids, bad words (None: free)

    def __post_init__(self) -> None:
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed={self.seed} must be in [0, 2**64)")

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)


@dataclass(frozen=True, slots=True)
class SamplerFlags:
    """Static switches of the compiled sampler (hashable: a jit static argument).

    Canonical: a greedy-only batch never sets `do_top_k_top_p`, so `all_variants` lists the programs a
    server compiles ahead."""

    all_greedy: bool = True  # no row draws at random: no keys, temperature or filters
    do_penalties: bool = False  # some row has a presence/frequency/repetition penalty
    do_top_k_top_p: bool = False  # some random row has top_k or top_p: the V-wide sort
    num_logprobs: int = -1  # -1: no logprobs; N >= 0: the sampled token's + the top-N
    do_token_mask: bool = False  # some row has a token bitmask (grammar, allowed ids) or a logit bias

    def __post_init__(self) -> None:
        if not -1 <= self.num_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"num_logprobs={self.num_logprobs} must be in [-1, {MAX_LOGPROBS}]")
        if self.all_greedy and self.do_top_k_top_p:
            raise ValueError("do_top_k_top_p=True needs all_greedy=False (greedy rows never sort)")

    @property
    def needed_at_start(self) -> bool:
        """Compiled before the engine is ready: greedy and random sampling, with or without top-k /
        top-p (what benchmarks and most clients send). Penalties and logprobs compile after ready."""
        return not self.do_penalties and self.num_logprobs < 0 and not self.do_token_mask

    @classmethod
    def for_rows(
        cls,
        rows: Sequence[SamplingRow | None],
        max_logprobs: int | None = None,
        vocab_size: int | None = None,
    ) -> SamplerFlags:
        """The flags a batch needs. num_logprobs is `max_logprobs` when any row asks for logprobs (one
        width, fewer programs), or the batch's largest N when `max_logprobs` is None. With `vocab_size`,
        a top_k >= vocab_size does not count as a filter (build_sampling_metadata turns it off)."""
        big = vocab_size if vocab_size is not None else 2**62
        real = [r for r in rows if r is not None]
        random_rows = [r.params for r in real if not r.params.greedy]
        asked = [r.params.logprobs for r in real if r.params.logprobs is not None]
        num_logprobs = -1
        if asked:
            num_logprobs = max(asked) if max_logprobs is None else max_logprobs
            if num_logprobs < max(asked):
                raise ValueError(f"max_logprobs={max_logprobs} must be >= the logprobs asked ({max(asked)})")
        return cls(
            all_greedy=not random_rows,
            do_penalties=any(r.params.uses_penalties for r in real),
            do_top_k_top_p=any(0 < p.top_k < big or p.top_p < 1.0 for p in random_rows),
            num_logprobs=num_logprobs,
            do_token_mask=any(
                r.params.logit_bias or (r.constraint is not None and r.constraint.needs_mask) for r in real
            ),
        )

    @classmethod
    def all_variants(cls, max_logprobs: int) -> list[SamplerFlags]:
        """Every program compiled ahead: all combinations without a token mask, and the token-mask ones
        without penalties or logprobs (structured outputs as clients send them: 15 in all). A batch that
        combines token rules with penalties or logprobs compiles its program through jit at first use."""
        out = []
        for all_greedy in (True, False):
            for do_penalties in (False, True):
                for do_top_k_top_p in (False, True) if not all_greedy else (False,):
                    for num_logprobs in (-1, max_logprobs):
                        out.append(cls(all_greedy, do_penalties, do_top_k_top_p, num_logprobs))
                    if not do_penalties:
                        out.append(cls(all_greedy, False, do_top_k_top_p, -1, do_token_mask=True))
        return out


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingMetadata:
    temperature: np.ndarray  # f32[S] (1.0 for greedy and padding rows, never 0)
    top_p: np.ndarray  # f32[S] (1.0: off)
    top_k: np.ndarray  # i32[S] (0: off)
    min_p: np.ndarray  # f32[S] (0.0: off)
    presence_penalty: np.ndarray  # f32[S]
    frequency_penalty: np.ndarray  # f32[S]
    repetition_penalty: np.ndarray  # f32[S] (1.0: off)
    key_data: np.ndarray  # u32[S, 2] threefry key data of PRNGKey(seed)
    step: np.ndarray  # i32[S] index k of the token being drawn (folded into the key)
    is_greedy: np.ndarray  # bool[S] (True for padding rows)
    suppress_ids: np.ndarray  # i32[S, K] ids that may not be drawn yet (min_tokens), -1 padded
    history_ids: np.ndarray  # i32[S, H] prompt + output ids, -1 padded (H = 0: no penalties)
    history_is_output: np.ndarray  # bool[S, H] True for generated ids
    token_bitmask: np.ndarray  # i32[S, W] bit t of row r: token t allowed (W = 0: no token mask)
    bias_ids: np.ndarray  # i32[S, L] logit_bias token ids, -1 padded (L = 0: no bias)
    bias_values: np.ndarray  # f32[S, L]

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]


def seed_key_data(seed: int) -> tuple[int, int]:
    """The two u32 words of `jax.random.PRNGKey(seed)` (threefry2x32): high word, low word."""
    return (seed >> 32) & _U32, seed & _U32


def _min_tokens_suppressed(row: SamplingRow, num_output: int) -> list[int]:
    p = row.params
    ids = []
    if num_output < p.min_tokens:
        ids += p.stop_token_ids or []
        if not p.ignore_eos:
            ids += row.eos_token_ids
    return sorted(set(ids)) if ids else ids


def _max_banned(row: SamplingRow | None) -> int:
    """At most how many ids a row's bad words ban at one step (the suppression width is reserved for them
    before the tokens they depend on are known)."""
    c = None if row is None else row.constraint
    return 0 if c is None else len(c.bad_single) + len(c.bad_multi)


@dataclass(frozen=True, slots=True)
class TokenRulesRow:
    """One row whose token rules (grammar, allowed ids, bad words) `apply_token_rules` fills in: its
    constraint and its output ids as of the step's dispatch (a copy, when the rules are applied on
    another thread while the step thread appends to the live list)."""

    row: int
    constraint: TokenConstraint
    output_token_ids: Sequence[int]


def token_rules_rows(rows: Sequence[SamplingRow | None], *, copy: bool = False) -> list[TokenRulesRow]:
    return [
        TokenRulesRow(i, r.constraint, tuple(r.output_token_ids) if copy else r.output_token_ids)
        for i, r in enumerate(rows)
        if r is not None and r.constraint is not None
    ]


def apply_token_rules(
    md: SamplingMetadata,
    rules: Sequence[TokenRulesRow],
    in_flight_ids: dict[int, Sequence[int]] | None = None,
) -> None:
    """Fills in what depends on the tokens drawn so far, in place: each grammar consumes the tokens it has
    not seen (`in_flight_ids[row]`: those the device is still sampling, after the collected ones), then
    the rows' bitmasks (grammar AND allowed_token_ids) and the ids bad words ban next, appended to
    the row's suppressed ids (their width reserved by `build_sampling_metadata`)."""
    in_flight_ids = in_flight_ids or {}
    if md.token_bitmask.shape[1]:
        for r in rules:
            r.constraint.advance(r.output_token_ids, in_flight_ids.get(r.row, ()))
        fill_token_bitmask(md.token_bitmask, {r.row: r.constraint for r in rules})
    for r in rules:
        c = r.constraint
        if not (c.bad_single or c.bad_multi):
            continue
        banned = c.banned_ids(r.output_token_ids, in_flight_ids.get(r.row, ()))
        row = md.suppress_ids[r.row]
        free = int(np.count_nonzero(row >= 0))
        row[free : free + len(banned)] = banned


def build_sampling_metadata(
    rows: Sequence[SamplingRow | None],
    num_rows_padded: int,
    vocab_size: int,
    *,
    history_width: int | None = None,
    flags: SamplerFlags | None = None,
    pending: Sequence[int] | None = None,
    in_flight_ids: dict[int, list[int]] | None = None,
    token_rules: bool = True,
) -> SamplingMetadata:
    """Pads `rows` (None: a row that samples nothing this step) to `num_rows_padded` rows.

    The history is built (H > 0) when a row uses a penalty or `flags.do_penalties` is set (to compile
    the penalty programs ahead on an empty batch); H is `history_width` if given, else the next power
    of two of the longest history, at least 64. `pending[i]` (async scheduling) counts row i's earlier
    tokens still being sampled on the device: the token drawn now is output number
    len(output_token_ids) + pending[i] (its random key and min_tokens count from there).
    `in_flight_ids[i]`: the values of row i's pending tokens, which a row with token rules needs (its
    grammar consumes them before its mask is filled; a bad word may end with them); the runner reads them
    back from the previous step for those rows only. `token_rules=False` leaves those rules (bitmask rows
    all set, no bad words banned) for `apply_token_rules`, which a caller runs once the in-flight
    tokens are known."""
    n = len(rows)
    if num_rows_padded < n:
        raise ValueError(f"num_rows_padded={num_rows_padded} must be >= the number of rows ({n})")
    S = num_rows_padded
    num_out = [
        0 if row is None else len(row.output_token_ids) + (pending[i] if pending else 0)
        for i, row in enumerate(rows)
    ]
    # Per-row values as Python lists, one numpy conversion per field: a numpy element write per row and
    # field cost ~10 ms a step at 1,000 rows on the host's critical path.
    params = [None if row is None else row.params for row in rows]
    sampled = [p for p in params if p is not None and not p.greedy]

    def column(value, default: float, dtype, only_sampled: bool = False) -> np.ndarray:
        out = np.full(S, default, dtype)
        if only_sampled and not sampled:
            return out
        out[:n] = [
            default if p is None or (only_sampled and p.greedy) else value(p) for p in params
        ]  # fmt: skip
        return out

    presence = column(lambda p: p.presence_penalty, 0.0, np.float32)
    frequency = column(lambda p: p.frequency_penalty, 0.0, np.float32)
    repetition = column(lambda p: p.repetition_penalty, 1.0, np.float32)
    temperature = column(lambda p: p.temperature, 1.0, np.float32, only_sampled=True)
    top_p = column(lambda p: p.top_p, 1.0, np.float32, only_sampled=True)
    top_k = column(lambda p: p.top_k if 0 < p.top_k < vocab_size else 0, 0, np.int32, only_sampled=True)
    min_p = column(lambda p: p.min_p, 0.0, np.float32, only_sampled=True)
    is_greedy = np.ones(S, bool)
    if sampled:
        is_greedy[:n] = [p is None or p.greedy for p in params]
    step = np.zeros(S, np.int32)
    step[:n] = num_out
    key_data = np.zeros((S, 2), np.uint32)
    if n:
        seeds = np.array([0 if row is None else row.seed for row in rows], np.uint64)
        key_data[:n, 0] = seeds >> np.uint64(32)
        key_data[:n, 1] = seeds & np.uint64(_U32)

    suppress = [[] if row is None else _min_tokens_suppressed(row, num_out[i]) for i, row in enumerate(rows)]
    width = _next_pow2(
        max((len(s) + _max_banned(rows[i]) for i, s in enumerate(suppress)), default=0), _MIN_SUPPRESS_WIDTH
    )
    suppress_ids = np.full((S, width), -1, np.int32)
    for i, ids in enumerate(suppress):
        if ids:
            suppress_ids[i, : len(ids)] = ids

    penal = [i for i, r in enumerate(rows) if r is not None and r.params.uses_penalties]
    H = 0
    if penal or (flags is not None and flags.do_penalties):
        longest = max(
            (len(rows[i].prompt_token_ids) + len(rows[i].output_token_ids) for i in penal), default=0
        )
        H = _next_pow2(longest, _MIN_HISTORY_WIDTH) if history_width is None else history_width
        if H < longest:
            raise ValueError(f"history_width={history_width} must be >= the longest history ({longest})")
    history_ids = np.full((S, H), -1, np.int32)
    history_is_output = np.zeros((S, H), bool)
    for i in penal:
        row = rows[i]
        np_, no = len(row.prompt_token_ids), len(row.output_token_ids)
        history_ids[i, :np_] = row.prompt_token_ids
        history_ids[i, np_ : np_ + no] = row.output_token_ids
        history_is_output[i, np_ : np_ + no] = True

    do_mask = flags.do_token_mask if flags is not None else SamplerFlags.for_rows(rows).do_token_mask
    if do_mask:
        token_bitmask = np.full((S, bitmask_width(vocab_size)), -1, np.int32)
        bias_ids, bias_values = bias_arrays([None if p is None else p.logit_bias for p in params], S)
    else:
        token_bitmask = np.zeros((S, 0), np.int32)
        bias_ids, bias_values = np.zeros((S, 0), np.int32), np.zeros((S, 0), np.float32)

    md = SamplingMetadata(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        key_data=key_data,
        step=step,
        is_greedy=is_greedy,
        suppress_ids=suppress_ids,
        history_ids=history_ids,
        history_is_output=history_is_output,
        token_bitmask=token_bitmask,
        bias_ids=bias_ids,
        bias_values=bias_values,
    )
    if token_rules:
        apply_token_rules(md, token_rules_rows(rows), in_flight_ids)
    return md
