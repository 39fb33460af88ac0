"""Device side of sampling: logits f32[S, V] + `SamplingMetadata` -> token ids (and logprobs), jittable.

Order of the logits processing (vLLM v1's):
  0. token rules (flags.do_token_mask): logit_bias added, then tokens outside the row's bitmask (grammar,
     allowed_token_ids) get -inf;
  1. penalties (flags.do_penalties): repetition over prompt + generated ids, then frequency and presence
     over generated ids only (OpenAI semantics);
  2. min_tokens suppression: listed ids get -inf;
  -> greedy rows take the argmax here (penalties and suppression still apply to them);
  3. temperature; 4. min_p (no sort: compared in log space against the row's max; a no-op at 0);
  5. top-k then top-p (flags.do_top_k_top_p: the only V-wide sort);
  6. one categorical draw per row with key fold_in(PRNGKey(sampling_seed), k) (Gumbel-max via vmap).
A batch where every row is greedy (flags.all_greedy) never builds keys nor sorts: it is an argmax.

Logprobs (flags.num_logprobs >= 0) describe the model's distribution, log_softmax of the raw logits
before any processing (vLLM's default "raw_logprobs"): the sampled token's logprob and 1-based rank,
then the top-N. Column 0 is the sampled token, columns 1..N the top-N, matching
`runner_output.TokenLogprobs`.

Dimension letters: S rows, V vocab, H token history, K suppressed ids, N top logprobs, P positions,
W bitmask words (ceil(V / 32)), L logit-bias entries.

Cost: greedy and temperature-only sampling are a few elementwise passes over [S, V]; top-k / top-p and
top-N logprobs need a V-wide sort (`lax.top_k(k > 1)` lowers to the same sort), an order of magnitude
more, which is why `SamplerFlags` compiles programs without it for batches that do not ask
(docs/performance.md has the figures).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.runner.sampling_metadata import SamplerFlags, SamplingMetadata
from jaxllm.runner_output import TokenLogprobs

_NEG_INF = -jnp.inf


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerOutput:
    token_ids: jax.Array  # i32[S]
    logprob_ids: jax.Array | None = None  # i32[S, 1 + N] sampled id, then the top-N ids
    logprobs: jax.Array | None = None  # f32[S, 1 + N]
    ranks: jax.Array | None = None  # i32[S, 1 + N] 1-based ranks


def row_keys(
    key_data: jax.Array,  # u32[S, 2]
    step: jax.Array,  # i32[S]
) -> jax.Array:  # key[S]
    """fold_in(PRNGKey(seed), k) per row: the same key whatever the batch and the row's position."""
    keys = jax.random.wrap_key_data(key_data, impl="threefry2x32")
    return jax.vmap(jax.random.fold_in)(keys, step)


def _scatter_ids(ids: jax.Array, V: int) -> tuple[jax.Array, jax.Array]:
    # -1 padding becomes an out-of-range index, which the scatters below drop.
    rows = jnp.arange(ids.shape[0])[:, None]
    return rows, jnp.where(ids < 0, V, ids)


def apply_penalties(
    logits: jax.Array,  # f32[S, V]
    history_ids: jax.Array,  # i32[S, H] -1 padded
    history_is_output: jax.Array,  # bool[S, H]
    presence_penalty: jax.Array,  # f32[S]
    frequency_penalty: jax.Array,  # f32[S]
    repetition_penalty: jax.Array,  # f32[S]
) -> jax.Array:  # f32[S, V]
    S, V = logits.shape
    rows, ids = _scatter_ids(history_ids, V)
    seen = jnp.zeros((S, V), bool).at[rows, ids].set(True, mode="drop")
    out_counts = (
        jnp.zeros((S, V), jnp.float32).at[rows, ids].add(history_is_output.astype(jnp.float32), mode="drop")
    )
    rep = repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - frequency_penalty[:, None] * out_counts
    return logits - presence_penalty[:, None] * (out_counts > 0)


def apply_suppression(
    logits: jax.Array,  # f32[S, V]
    suppress_ids: jax.Array,  # i32[S, K] -1 padded
) -> jax.Array:  # f32[S, V]
    rows, ids = _scatter_ids(suppress_ids, logits.shape[1])
    return logits.at[rows, ids].set(_NEG_INF, mode="drop")


def apply_token_mask(
    logits: jax.Array,  # f32[S, V]
    bitmask: jax.Array,  # i32[S, W] bit t of row r set: token t allowed; W = ceil(V / 32)
    bias_ids: jax.Array,  # i32[S, L] -1 padded
    bias_values: jax.Array,  # f32[S, L]
) -> jax.Array:  # f32[S, V]
    S, V = logits.shape
    rows, ids = _scatter_ids(bias_ids, V)
    logits = logits.at[rows, ids].add(bias_values, mode="drop")
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (bitmask[:, :, None] >> shifts[None, None, :]) & 1  # i32[S, W, 32], little-endian bit order
    allowed = bits.reshape(S, -1)[:, :V].astype(bool)
    return jnp.where(allowed, logits, _NEG_INF)


def apply_min_p(
    logits: jax.Array,  # f32[S, V]
    min_p: jax.Array,  # f32[S]
) -> jax.Array:  # f32[S, V]
    # p_i < min_p * p_max  <=>  logit_i - logit_max < log(min_p); log(0) = -inf keeps everything.
    top = jnp.max(logits, axis=-1, keepdims=True)
    return jnp.where(logits - top < jnp.log(min_p)[:, None], _NEG_INF, logits)


def apply_top_k_top_p(
    logits: jax.Array,  # f32[S, V]
    top_k: jax.Array,  # i32[S] 0: off
    top_p: jax.Array,  # f32[S] 1.0: off
) -> jax.Array:  # f32[S, V]
    """Keeps the k largest logits, then the smallest prefix of those whose probability reaches top_p.

    Tokens tied with the last kept one are kept too (the cut is a threshold on the value)."""
    V = logits.shape[1]
    desc = -jnp.sort(-logits, axis=-1)  # f32[S, V]
    kth = jnp.take_along_axis(desc, jnp.clip(top_k - 1, 0, V - 1)[:, None], axis=-1)
    kth = jnp.where(top_k[:, None] > 0, kth, _NEG_INF)  # f32[S, 1]
    desc = jnp.where(desc < kth, _NEG_INF, desc)
    probs = jax.nn.softmax(desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above
    num_keep = jnp.maximum(jnp.sum(mass_before < top_p[:, None], axis=-1), 1)  # i32[S]
    cut = jnp.take_along_axis(desc, (num_keep - 1)[:, None], axis=-1)
    cut = jnp.where(top_p[:, None] < 1.0, jnp.maximum(cut, kth), kth)
    return jnp.where(logits < cut, _NEG_INF, logits)


def _logprobs(
    logits: jax.Array,  # f32[P, V] raw
    token_ids: jax.Array,  # i32[P]
    num_logprobs: int,  # N
) -> tuple[jax.Array, jax.Array, jax.Array]:  # i32[P, 1 + N], f32[P, 1 + N], i32[P, 1 + N]
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, token_ids[:, None], axis=-1)  # f32[P, 1]
    rank = 1 + jnp.sum(lp > chosen, axis=-1, dtype=jnp.int32)[:, None]
    ids, lps, ranks = token_ids[:, None].astype(jnp.int32), chosen, rank
    if num_logprobs > 0:
        top_lp, top_ids = jax.lax.top_k(lp, num_logprobs)
        top_ranks = jnp.broadcast_to(jnp.arange(1, num_logprobs + 1, dtype=jnp.int32), top_ids.shape)
        ids = jnp.concatenate([ids, top_ids.astype(jnp.int32)], axis=-1)
        lps = jnp.concatenate([lps, top_lp], axis=-1)
        ranks = jnp.concatenate([ranks, top_ranks], axis=-1)
    return ids, lps, ranks


def compute_prompt_logprobs(
    logits: jax.Array,  # f32[P, V] logits at prompt positions
    next_ids: jax.Array,  # i32[P] the prompt token that follows each position
    num_logprobs: int,  # N (static)
) -> tuple[jax.Array, jax.Array, jax.Array]:  # i32[P, 1 + N], f32[P, 1 + N], i32[P, 1 + N]
    """Logprob and rank of each actual next prompt token under the model, plus the top-N."""
    return _logprobs(logits, next_ids, num_logprobs)


def sample(
    logits: jax.Array,  # f32[S, V] (any float dtype; computed in f32)
    md: SamplingMetadata,
    *,
    flags: SamplerFlags,  # static
) -> SamplerOutput:
    raw = logits.astype(jnp.float32)
    x = raw
    if flags.do_token_mask:
        x = apply_token_mask(x, md.token_bitmask, md.bias_ids, md.bias_values)
    if flags.do_penalties:
        x = apply_penalties(
            x,
            md.history_ids,
            md.history_is_output,
            md.presence_penalty,
            md.frequency_penalty,
            md.repetition_penalty,
        )
    x = apply_suppression(x, md.suppress_ids)
    ids = jnp.argmax(x, axis=-1).astype(jnp.int32)
    if not flags.all_greedy:
        x = x / md.temperature[:, None]
        x = apply_min_p(x, md.min_p)  # no sort: one max and a compare, no flag needed
        if flags.do_top_k_top_p:
            x = apply_top_k_top_p(x, md.top_k, md.top_p)
        keys = row_keys(md.key_data, md.step)
        drawn = jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)
        ids = jnp.where(md.is_greedy, ids, drawn)
    if flags.num_logprobs < 0:
        return SamplerOutput(ids)
    lp_ids, lps, ranks = _logprobs(raw, ids, flags.num_logprobs)
    return SamplerOutput(ids, lp_ids, lps, ranks)


sample_jit = jax.jit(sample, static_argnames=("flags",))


def row_token_logprobs(
    token_ids: np.ndarray,  # i32[S, 1 + N] (host copy of SamplerOutput.logprob_ids)
    logprobs: np.ndarray,  # f32[S, 1 + N]
    ranks: np.ndarray,  # i32[S, 1 + N]
    row: int,
    num_logprobs: int,  # this request's N (<= the batch's)
) -> TokenLogprobs:
    """One request's slice of the batch's logprobs, as the runner returns it (P = 1)."""
    cols = slice(0, 1 + num_logprobs)
    return TokenLogprobs(
        token_ids=np.asarray(token_ids[row : row + 1, cols], np.int32),
        logprobs=np.asarray(logprobs[row : row + 1, cols], np.float32),
        ranks=np.asarray(ranks[row : row + 1, cols], np.int32),
    )
