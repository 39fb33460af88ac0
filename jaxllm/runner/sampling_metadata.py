"""Host side of sampling: a batch of requests' `SamplingParams` -> fixed-shape arrays for `sampler.sample`.

Data flow: the runner lists one `SamplingRow` per request it samples for this step (in row order),
calls `build_sampling_metadata(rows, num_rows_padded, vocab_size)` and gets
  - `SamplingMetadata`: numpy arrays of static shape (padded to S rows), passed into the jitted step;
  - `SamplingMode`: hashable flags, passed as the static `mode` argument of `sampler.sample`, so a batch
    without penalties / top-k / top-p / min-p / logprobs compiles (and runs) a program without them.

Dimension letters: S padded rows, H token-history width, K suppressed ids per row.

Randomness: row r draws its k-th generated token (k = len(output_token_ids)) with
`fold_in(PRNGKey(sampling_seed), k)`; the folding happens on the device (sampler.row_keys), the host only
splits the 64-bit seed into the two u32 words of a threefry key, which is what PRNGKey(seed) does.

Token history (only built when some row uses a penalty): prompt + output ids of each row, -1 padded,
with a flag marking the generated ones. Its width H is static: by default the next power of two of the
longest history (at least 64), so a serving process compiles O(log max_model_len) variants; pass
`history_width=max_model_len` to compile a single one at the cost of a wider array.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import numpy as np

from jaxllm.sampling_params import SamplingParams

_MIN_HISTORY_WIDTH = 64
_MIN_SUPPRESS_WIDTH = 8
_U32 = 0xFFFFFFFF


def _next_pow2(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """What the sampler needs of one request (the runner builds it from a `Request`)."""

    params: SamplingParams
    sampling_seed: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.sampling_seed < 2**64:
            raise ValueError(f"sampling_seed={self.sampling_seed} must be in [0, 2**64)")

    @classmethod
    def from_request(cls, request) -> SamplingRow:
        eos = () if request.eos_token_id is None else (request.eos_token_id,)
        return cls(
            request.sampling_params,
            request.sampling_seed,
            request.prompt_token_ids,
            request.output_token_ids,
            eos,
        )


@dataclass(frozen=True, slots=True)
class SamplingMode:
    """Static switches of the compiled sampler (hashable: a jit static argument)."""

    all_greedy: bool = True  # no row draws at random: skip keys, temperature, filters
    do_penalties: bool = False  # some row has a presence/frequency/repetition penalty
    do_top_k_top_p: bool = False  # some random row needs the V-wide sort
    do_min_p: bool = False  # some random row has min_p > 0
    num_logprobs: int = -1  # -1: no logprobs; N >= 0: sampled token + top-N (max N in the batch)

    def __post_init__(self) -> None:
        if not -1 <= self.num_logprobs <= 20:
            raise ValueError(f"num_logprobs={self.num_logprobs} must be in [-1, 20]")


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
    key_data: np.ndarray  # u32[S, 2] threefry key data of PRNGKey(sampling_seed)
    step: np.ndarray  # i32[S] index k of the token being drawn (folded into the key)
    is_greedy: np.ndarray  # bool[S] (True for padding rows)
    suppress_ids: np.ndarray  # i32[S, K] ids that may not be drawn yet (min_tokens), -1 padded
    history_ids: np.ndarray | None = field(default=None)  # i32[S, H] prompt + output ids, -1 padded
    history_is_output: np.ndarray | None = field(default=None)  # bool[S, H] True for generated ids

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]


def seed_key_data(seed: int) -> tuple[int, int]:
    """The two u32 words of `jax.random.PRNGKey(seed)` (threefry2x32): high word, low word."""
    return (seed >> 32) & _U32, seed & _U32


def _suppressed(row: SamplingRow) -> list[int]:
    p = row.params
    if len(row.output_token_ids) >= p.min_tokens:
        return []
    ids = list(p.stop_token_ids or [])
    if not p.ignore_eos:
        ids += list(row.eos_token_ids)
    return sorted(set(ids))


def build_sampling_metadata(
    rows: Sequence[SamplingRow],
    num_rows_padded: int,
    vocab_size: int,
    *,
    history_width: int | None = None,
) -> tuple[SamplingMetadata, SamplingMode]:
    """Pads `rows` to `num_rows_padded` and returns the arrays and the static mode flags."""
    n = len(rows)
    if num_rows_padded < n:
        raise ValueError(f"num_rows_padded={num_rows_padded} must be >= the number of rows ({n})")
    S = num_rows_padded
    temperature = np.ones(S, np.float32)
    top_p = np.ones(S, np.float32)
    top_k = np.zeros(S, np.int32)
    min_p = np.zeros(S, np.float32)
    presence = np.zeros(S, np.float32)
    frequency = np.zeros(S, np.float32)
    repetition = np.ones(S, np.float32)
    key_data = np.zeros((S, 2), np.uint32)
    step = np.zeros(S, np.int32)
    is_greedy = np.ones(S, bool)

    mode = dict(all_greedy=True, do_penalties=False, do_top_k_top_p=False, do_min_p=False, num_logprobs=-1)
    suppress: list[list[int]] = []
    for i, row in enumerate(rows):
        p = row.params
        key_data[i] = seed_key_data(row.sampling_seed)
        step[i] = len(row.output_token_ids)
        presence[i] = p.presence_penalty
        frequency[i] = p.frequency_penalty
        repetition[i] = p.repetition_penalty
        mode["do_penalties"] |= p.uses_penalties
        if p.logprobs is not None:
            mode["num_logprobs"] = max(mode["num_logprobs"], p.logprobs)
        suppress.append(_suppressed(row))
        if p.greedy:
            continue
        is_greedy[i] = False
        mode["all_greedy"] = False
        temperature[i] = p.temperature
        top_p[i] = p.top_p
        top_k[i] = p.top_k if 0 < p.top_k < vocab_size else 0
        min_p[i] = p.min_p
        mode["do_top_k_top_p"] |= bool(top_k[i] > 0 or p.top_p < 1.0)
        mode["do_min_p"] |= p.min_p > 0.0

    width = _next_pow2(max((len(s) for s in suppress), default=0), _MIN_SUPPRESS_WIDTH)
    suppress_ids = np.full((S, width), -1, np.int32)
    for i, ids in enumerate(suppress):
        suppress_ids[i, : len(ids)] = ids

    history_ids = history_is_output = None
    if mode["do_penalties"]:
        longest = max(len(r.prompt_token_ids) + len(r.output_token_ids) for r in rows)
        H = _next_pow2(longest, _MIN_HISTORY_WIDTH) if history_width is None else history_width
        if H < longest:
            raise ValueError(f"history_width={history_width} must be >= the longest history ({longest})")
        history_ids = np.full((S, H), -1, np.int32)
        history_is_output = np.zeros((S, H), bool)
        for i, row in enumerate(rows):
            if not row.params.uses_penalties:
                continue
            np_, no = len(row.prompt_token_ids), len(row.output_token_ids)
            history_ids[i, :np_] = row.prompt_token_ids
            history_ids[i, np_ : np_ + no] = row.output_token_ids
            history_is_output[i, np_ : np_ + no] = True

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
    )
    return md, SamplingMode(**mode)
