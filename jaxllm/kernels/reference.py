"""Ragged paged attention: a flattened batch mixing decode tokens and prefill chunks.

Sequence s owns query rows cu_q_lens[s]:cu_q_lens[s+1] and kv_lens[s] tokens of context in its pages
(block_tables[s]); the new tokens' K/V are already written. Query row i of s sits at position
kv_lens[s] - q_len + i and attends causally to context positions <= its own. Rows past cu_q_lens[num_seqs]
are padding: their output is zero.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def check_inputs(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, dtypes) -> None:
    """The contract's shapes and dtypes, shared by the kernels; a ValueError names the argument."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {q.shape}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages/v_pages must both be [Hkv, P, PS, D]; got {k_pages.shape}, {v_pages.shape}"
        )
    _, hq, d = q.shape
    hkv, _, ps, dk = k_pages.shape
    if dk != d:
        raise ValueError(f"head_dim of q ({d}) and k_pages ({dk}) must match")
    if d not in (64, 128, 256):
        raise ValueError(f"head_dim={d} must be one of 64, 128, 256")
    if hq % hkv:
        raise ValueError(f"num q heads {hq} must be a multiple of num kv heads {hkv}")
    if ps < 1 or ps & (ps - 1):
        raise ValueError(f"page_size={ps} must be a power of two")
    if q.dtype not in dtypes or k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        names = ", ".join(jnp.dtype(t).name for t in dtypes)
        raise ValueError(f"q/k/v dtype must match and be one of {names}; got {q.dtype}, {k_pages.dtype}")
    if block_tables.ndim != 2 or block_tables.dtype != jnp.int32:
        raise ValueError(f"block_tables must be i32[S, B], got {block_tables.dtype}{list(block_tables.shape)}")
    s = block_tables.shape[0]
    for name, x, shape in (
        ("kv_lens", kv_lens, (s,)),
        ("cu_q_lens", cu_q_lens, (s + 1,)),
        ("num_seqs", num_seqs, (1,)),
    ):
        if x.shape != shape or x.dtype != jnp.int32:
            raise ValueError(f"{name} must be i32{list(shape)}, got {x.dtype}{list(x.shape)}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window"))
def ref_ragged_paged_attention(
    q,  # [T, Hq, D]
    k_pages,  # [Hkv, P, PS, D]
    v_pages,  # [Hkv, P, PS, D]
    kv_lens,  # i32[S]
    block_tables,  # i32[S, B]
    cu_q_lens,  # i32[S + 1]
    num_seqs,  # i32[1]
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
):
    """Plain-jnp reference: gathers each token's sequence pages and does masked softmax in float32."""
    t, hq, d = q.shape
    hkv, _, ps, _ = k_pages.shape
    s, b = block_tables.shape
    g = hq // hkv
    rows = jnp.arange(t, dtype=jnp.int32)
    # seq_of[i]: the sequence that owns row i (rows past the last real sequence map to no one).
    seq_of = jnp.searchsorted(cu_q_lens[1:], rows, side="right").astype(jnp.int32)
    valid_row = (rows < cu_q_lens[jnp.minimum(num_seqs[0], s)]) & (seq_of < num_seqs[0])
    seq_of = jnp.minimum(seq_of, s - 1)
    q_len = cu_q_lens[seq_of + 1] - cu_q_lens[seq_of]  # [T]
    kv_len = kv_lens[seq_of]  # [T]
    q_pos = kv_len - q_len + (rows - cu_q_lens[seq_of])  # [T]

    pages = block_tables[seq_of]  # [T, B]
    k = k_pages[:, pages].reshape(hkv, t, b * ps, d)  # [Hkv, T, L, D]
    v = v_pages[:, pages].reshape(hkv, t, b * ps, d)
    qg = q.reshape(t, hkv, g, d).astype(jnp.float32)
    scores = jnp.einsum("thgd,htld->thgl", qg, k.astype(jnp.float32)) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    kv_pos = jnp.arange(b * ps, dtype=jnp.int32)
    mask = (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] < kv_len[:, None])  # [T, L]
    if sliding_window is not None:
        mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
    mask &= valid_row[:, None]
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask[:, None, None, :], jnp.exp(scores - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    # A masked-out page may hold NaN/inf garbage: select, never multiply, so it cannot leak.
    vf = jnp.where(mask[None, :, :, None], v.astype(jnp.float32), 0.0)
    out = jnp.einsum("thgl,htld->thgd", p, vf)
    out = out / jnp.where(denom == 0.0, 1.0, denom)
    return out.reshape(t, hq, d).astype(q.dtype)
