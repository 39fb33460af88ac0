"""The canonical int4 weight layout (W4A16) in plain numpy/jnp: packing, unpacking, dequantization and the
reference matmul every int4 kernel is tested against. No Pallas here, so a loader can import it on any host.

Layout of one linear layer with K inputs, N outputs and group size g (g divides K; g = K: per channel):

    q        u8[K, N]       4-bit codes 0..15
    qweight  u8[K/2, N]     byte j of column n = q[2j, n] | q[2j + 1, n] << 4   (pack_int4)
    scales   [K/g, N]       float (the compute dtype)
    zeros    [K/g, N]       float; w[k, n] = (q[k, n] - zeros[k // g, n]) * scales[k // g, n]

Packing along K (two rows per byte) keeps a column's bytes in the row-major order of the dense weight,
so a kernel tile of packed rows [k/2, k/2 + r) x columns is a plain 2-D slice, and the low / high nibbles
of a tile are the even / odd rows of the dense tile. Zeros are floats, not codes, so AWQ's and GPTQ's
integer zero points and compressed-tensors' symmetric scheme (zeros = 8) all convert to this one form.

    pack_int4(q) -> qweight              unpack_int4(qweight) -> q
    dequantize_int4(qweight, scales, zeros) -> w[K, N]
    ref_w4a16_matmul(x, qweight, scales, zeros) -> x @ w  (float32 math, x's dtype out)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["dequantize_int4", "group_size_of", "pack_int4", "ref_w4a16_matmul", "unpack_int4"]


def _xp(a):
    """numpy for numpy inputs (a loader packs on the host), jnp otherwise."""
    return np if isinstance(a, np.ndarray) else jnp


def pack_int4(q):  # u8[K, N] (values 0..15) -> u8[K/2, N]
    """Two 4-bit codes per byte along K: the even row in the low nibble, the odd row in the high one."""
    if q.ndim != 2:
        raise ValueError(f"q must be 2-D [K, N], got shape {q.shape}")
    if q.shape[0] % 2:
        raise ValueError(f"q has K={q.shape[0]} rows; int4 packing needs an even K")
    if not jnp.issubdtype(q.dtype, jnp.integer):
        raise ValueError(f"q must hold integer codes 0..15, got dtype {q.dtype}")
    xp = _xp(q)
    if xp is np and q.size and (q.min() < 0 or q.max() > 15):
        raise ValueError(f"q holds values in [{q.min()}, {q.max()}]; int4 codes are 0..15")
    q = q.astype(xp.uint8)
    return q[0::2] | (q[1::2] << 4)


def unpack_int4(qweight):  # u8[K/2, N] -> u8[K, N]
    """The inverse of pack_int4."""
    if qweight.ndim != 2 or qweight.dtype != jnp.uint8:
        raise ValueError(f"qweight must be u8[K/2, N], got {qweight.dtype}{list(qweight.shape)}")
    xp = _xp(qweight)
    lo = qweight & 0xF
    hi = qweight >> 4
    half, n = qweight.shape
    return xp.stack([lo, hi], axis=1).reshape(2 * half, n)


def group_size_of(qweight, scales) -> int:
    """g = K / scales.shape[0], checked: it must divide K and be even (a byte's two rows share a group)."""
    k = 2 * qweight.shape[0]
    groups = scales.shape[0]
    if groups < 1 or k % groups:
        raise ValueError(
            f"scales has {groups} rows, which does not divide K={k} (qweight {list(qweight.shape)})"
        )
    g = k // groups
    if g % 2:
        raise ValueError(f"group size K/scales.shape[0] = {g} must be even")
    return g


def dequantize_int4(qweight, scales, zeros, dtype=jnp.float32):
    """w[K, N] = (q - zeros[k // g]) * scales[k // g], computed in float32, returned in `dtype`."""
    if scales.ndim != 2 or scales.shape[1] != qweight.shape[1]:
        raise ValueError(f"scales {list(scales.shape)} must be [K/g, N={qweight.shape[1]}]")
    if zeros.shape != scales.shape:
        raise ValueError(f"zeros {list(zeros.shape)} must have the shape of scales {list(scales.shape)}")
    g = group_size_of(qweight, scales)
    q = jnp.asarray(unpack_int4(jnp.asarray(qweight)), jnp.float32)  # f32[K, N]
    s = jnp.repeat(jnp.asarray(scales, jnp.float32), g, axis=0)  # f32[K, N]
    z = jnp.repeat(jnp.asarray(zeros, jnp.float32), g, axis=0)  # f32[K, N]
    return ((q - z) * s).astype(dtype)


def ref_w4a16_matmul(x, qweight, scales, zeros):  # [M, K], u8[K/2, N], [K/g, N] x2 -> [M, N]
    """x @ dequantize_int4(...) in float32 at full precision, cast to x's dtype."""
    w = dequantize_int4(qweight, scales, zeros)  # f32[K, N]
    y = jnp.matmul(jnp.asarray(x, jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype)
