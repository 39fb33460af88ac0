"""Helpers for a ragged batch that the Triton kernel, the Mosaic kernels' schedules and the Hopper
dispatcher all use: which batches are decode-like, who owns a row, and the grouped query layout.

The grouped ("launch") layout: q [T, Hq, D] viewed as [T, Hkv, Gp, D], the G = Hq / Hkv query heads of
each KV head side by side, padded with zero heads to Gp (a power of two, or at least a TMA tile). A
kernel program then loads one KV head's whole query group as one tile, so K/V pages are read once per
group (GQA/MQA). Launches that each write some of the rows (the dispatcher's) share this layout and
write into one output buffer in turn; from_launch_layout cuts the result back to [T, Hq, D].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def decode_like(t: int, s: int) -> bool:
    """Few rows per sequence (T <= 2 S): decode tiles (a handful of rows, long key steps) fit the whole
    batch, and the Mosaic decode kernel's row-at-a-time work stays bounded."""
    return t <= 2 * s


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def owner(ends, idx):  # i32[N], i32[M] -> i32[M]
    """How many of `ends` are <= each idx: the owner of idx when ends are the cumulative ends of
    consecutive ranges (rows of sequences, items of sequences). A vectorised compare, not searchsorted,
    whose binary search is a while loop (a host round trip per step on the GPU)."""
    return jnp.sum(ends[None, :] <= idx[:, None], axis=1, dtype=jnp.int32)


def query_view(q, q_heads: int | None):
    """The shape and dtype of q's query heads (the first q_heads of a fused q|k|v array), for checks."""
    if q_heads is None:
        return q
    if q.ndim != 3 or not 0 < q_heads <= q.shape[1]:
        raise ValueError(
            f"q_heads={q_heads} must be in [1, {q.shape[1] if q.ndim == 3 else '?'}] (q {q.shape})"
        )
    return jax.ShapeDtypeStruct((q.shape[0], q_heads, q.shape[2]), q.dtype)


def to_launch_layout(x, hkv: int, extra_rows: int = 0, min_group: int = 1, q_heads: int | None = None):
    """[T, Hq, D] -> [T + extra_rows, Hkv, Gp, D]: each KV head's query group padded with zeros to a
    power of two (at least min_group: a layout shared with a kernel that moves whole 8-row tiles), and
    `extra_rows` zero rows after the last.

    With q_heads, x is [T, H, D] whose first q_heads heads are the queries (a fused q|k|v array). When the
    groups need no padding and H is whole groups, x is only viewed as [T, H / G, G, D] (no copy): group
    h < Hkv of that view is KV head h's queries, all a launch reads. Otherwise the queries are cut out
    (and padded) as above."""
    t, h, d = x.shape
    hq = q_heads or h
    g = hq // hkv
    gp = max(next_pow2(g), min_group)
    if h != hq:
        if gp == g and not extra_rows and h % g == 0:
            return x.reshape(t, h // g, g, d)
        x = x[:, :hq]
    xg = x.reshape(t, hkv, g, d)
    if gp != g or extra_rows:
        xg = jnp.pad(xg, ((0, extra_rows), (0, 0), (0, gp - g), (0, 0)))
    return xg


def from_launch_layout(out, t: int, hq: int):
    """The inverse of to_launch_layout: [Tp, Hkv, Gp, D] -> [T, Hq, D]."""
    _, hkv, _, d = out.shape
    return out[:t, :, : hq // hkv, :].reshape(t, hq, d)
