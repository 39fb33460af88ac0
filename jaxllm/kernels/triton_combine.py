"""The merge of ragged_paged_attention's context splits (flash-decoding), as a Pallas kernel (Triton).

A split launch (triton_attention.py, k_splits > 1) leaves, for split c, query row t and KV head h, an
unnormalised float32 output acc[c, t, h] with its running max m (log2 units) and sum l. The merge is

    out = sum_c acc_c 2^(m_c - M) / sum_c l_c 2^(m_c - M),    M = max_c m_c.

Written as jnp ops, XLA reads every one of the k_splits partials of every row. But k_splits is the grid's
static maximum, sized for one long sequence alone in its bucket (triton_attention.default_config): at
short contexts the launch uses few of them, and a bucket's padding rows have no keys at all, so most of
those partials were never written. Here one program per (KV head, row) reads only splits 0 .. used - 1
of a live row, CHUNK splits a step (masked loads), with the attention loop's online rescaling, and writes
the row in the output's dtype; a row whose item had no keys is written as zeros without reading anything.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.kernels.ragged_batch import next_pow2
from jaxllm.kernels.triton_schedule import WorkItems, has_keys

MASK_VALUE = -1e30  # scores masked out, and an empty split's running max (triton_attention uses it too)
# Splits merged per loop step: a [CHUNK, Gp, D] float32 tile, 32 KB at Gp 4, D 128 (64 registers a
# thread in 4 warps). One long sequence uses up to 64 splits: four dependent steps of loads, not 64.
CHUNK = 16


def live_rows(items: WorkItems, num_rows: int) -> jax.Array:
    """i32[num_rows]: 1 for a row of an item with keys to read (its partials hold something), else 0."""
    r = jnp.arange(num_rows, dtype=jnp.int32)[None, :]
    inside = (items.q0[:, None] <= r) & (r < items.q1[:, None])
    return jnp.any(has_keys(items)[:, None] & inside, axis=0).astype(jnp.int32)


def split_chunk(k_splits: int) -> int:
    """Splits merged per loop step: all of them at once up to CHUNK (one wave of loads), in CHUNK steps
    beyond. The partials' buffers hold a whole number of chunks (padded_splits), so a chunk never reads
    past them: on the GPU its loads past `used` are masked; interpret mode would clamp the slice."""
    return min(CHUNK, next_pow2(k_splits))


def padded_splits(k_splits: int) -> int:
    c = split_chunk(k_splits)
    return -(-k_splits // c) * c


def _combine_kernel(used_ref, live_ref, acc_ref, m_ref, l_ref, o_ref, *, chunk: int):
    # acc_ref f32[Kp, Tp, Gp, D], m_ref / l_ref f32[Kp, Tp, Gp] (KV head squeezed); o_ref [Tp, Gp, D]
    t = pl.program_id(1)
    _, _, gp, d = acc_ref.shape
    n = jnp.where(live_ref[t] != 0, used_ref[0], 0)

    def body(i, carry):
        acc, m, l_ = carry
        c0 = i * chunk
        take = c0 + jnp.arange(chunk, dtype=jnp.int32) < n  # [C]
        m_c = plgpu.load(m_ref.at[pl.ds(c0, chunk), t, :], mask=take[:, None], other=MASK_VALUE)  # [C, Gp]
        l_c = plgpu.load(l_ref.at[pl.ds(c0, chunk), t, :], mask=take[:, None], other=0.0)
        acc_c = plgpu.load(acc_ref.at[pl.ds(c0, chunk), t, :, :], mask=take[:, None, None], other=0.0)
        m_new = jnp.maximum(m, m_c.max(axis=0))
        a, b = jnp.exp2(m - m_new), jnp.exp2(m_c - m_new[None, :])  # [Gp], [C, Gp]
        acc = acc * a[:, None] + (acc_c * b[:, :, None]).sum(axis=0)
        return acc, m_new, l_ * a + (l_c * b).sum(axis=0)

    init = (
        jnp.zeros((gp, d), jnp.float32),
        jnp.full((gp,), MASK_VALUE, jnp.float32),
        jnp.zeros((gp,), jnp.float32),
    )
    acc, _, l_ = lax.fori_loop(0, (n + chunk - 1) // chunk, body, init)
    o_ref[t, :, :] = (acc / jnp.where(l_ == 0.0, 1.0, l_)[:, None]).astype(o_ref.dtype)


def combine_splits(acc, m, l_, *, used, live, out_dtype, interpret: bool = False):
    """acc f32[Kp, Tp, Hkv, Gp, D], m / l f32[Kp, Tp, Hkv, Gp] -> [Tp, Hkv, Gp, D] in out_dtype, where
    Kp = padded_splits(k_splits). used: i32[1], the splits written (triton_schedule.active_splits);
    live: i32[Tp] (live_rows). Splits at or past `used` and rows not live are never read: whatever their
    buffers hold stays out."""
    kp, tp, hkv, gp, d = acc.shape
    chunk = split_chunk(kp)
    if kp % chunk:
        raise ValueError(f"{kp} splits in the partials' buffers: not whole chunks of {chunk} (padded_splits)")
    return pl.pallas_call(
        functools.partial(_combine_kernel, chunk=chunk),
        grid=(hkv, tp),
        in_specs=[
            pl.BlockSpec((1,), lambda h, t: (0,)),
            pl.BlockSpec((tp,), lambda h, t: (0,)),
            pl.BlockSpec((kp, tp, None, gp, d), lambda h, t: (0, 0, h, 0, 0)),
            pl.BlockSpec((kp, tp, None, gp), lambda h, t: (0, 0, h, 0)),
            pl.BlockSpec((kp, tp, None, gp), lambda h, t: (0, 0, h, 0)),
        ],
        out_specs=pl.BlockSpec((tp, None, gp, d), lambda h, t: (0, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((tp, hkv, gp, d), out_dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        name=f"ragged_paged_attention_combine_k{kp}",
    )(used, live, acc, m, l_)
