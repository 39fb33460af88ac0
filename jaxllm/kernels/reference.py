"""Ragged paged attention in plain jnp: the reference every kernel of this package is tested against.

Sequence s owns query rows cu_q_lens[s]:cu_q_lens[s+1] and kv_lens[s] tokens of context in its pages
(block_tables[s]); the new tokens' K/V are already written. Query row i of s sits at position
kv_lens[s] - q_len + i and attends causally to context positions <= its own. Rows past cu_q_lens[num_seqs]
are padding: their output is zero.

It gathers every row's whole block table and does a masked softmax in float32: simple enough to be
trusted, and it runs on any platform (the CPU engine's attention).

FP8 pages (kv_quant.py) are read as stored * k_scale (v_scale for V), in float32; other pages as they are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxllm.kernels.kv_quant import dequantize_kv
from jaxllm.kernels.metadata import PagedAttentionMetadata


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window"))
def ref_ragged_paged_attention(
    q,  # [T, Hq, D]
    k_pages,  # [Hkv, P, PS, D]
    v_pages,  # [Hkv, P, PS, D]
    md: PagedAttentionMetadata,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale=1.0,  # float or f32[]: fp8 pages hold k / k_scale (kv_quant.py); unused for other dtypes
    v_scale=1.0,
):
    """Plain-jnp reference: gathers each token's sequence pages and does masked softmax in float32."""
    kv_lens, block_tables, cu_q_lens, num_seqs = md.kv_lens, md.block_tables, md.cu_q_lens, md.num_seqs
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
    scores = jnp.einsum("thgd,htld->thgl", qg, dequantize_kv(k, k_scale, jnp.float32)) * sm_scale
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
    vf = jnp.where(mask[None, :, :, None], dequantize_kv(v, v_scale, jnp.float32), 0.0)
    out = jnp.einsum("thgl,htld->thgd", p, vf)
    out = out / jnp.where(denom == 0.0, 1.0, denom)
    return out.reshape(t, hq, d).astype(q.dtype)
