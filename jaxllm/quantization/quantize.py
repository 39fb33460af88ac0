"""Float weights -> the canonical quantized leaves (jaxllm/quantization/scheme.py), in plain jnp.

`quantize_fp8` is `--quantization fp8` on a float checkpoint (vLLM's dynamic FP8: one scale per output
channel, max|w| / 448). `quantize_int8` and `quantize_int4` (round to nearest, per group, asymmetric for
int4) give the other layouts from float weights: random-weight models at real sizes and tests of the
layer against dequantize-then-matmul use them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.kernels.int4_reference import pack_int4
from jaxllm.quantization.scheme import FP8_DTYPE, FP8_MAX


def quantize_fp8(w: jax.Array) -> dict[str, jax.Array]:
    """w [K, N] -> {qweight f8[N, K], weight_scale f32[N]}, per output channel (W8A8's [N, K] layout)."""
    wf = w.astype(jnp.float32).T  # [N, K]
    scale = jnp.maximum(jnp.max(jnp.abs(wf), axis=1), 1e-12) / FP8_MAX  # [N]
    q = jnp.clip(wf / scale[:, None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return {"qweight": q, "weight_scale": scale}


def quantize_int8(w: jax.Array, group: int | None = None, w8a8: bool = False) -> dict[str, jax.Array]:
    """w [K, N] -> {qweight i8[K, N], scales [K/g, N]}, or for W8A8 {qweight i8[N, K], weight_scale f32[N]}
    (the layouts of scheme.py), symmetric."""
    k, n = w.shape
    g = group or k
    if w8a8 and g != k:
        raise ValueError(f"W8A8 weights have one scale per output channel, not group={group}")
    wf = w.astype(jnp.float32).reshape(k // g, g, n)
    scale = jnp.maximum(jnp.max(jnp.abs(wf), axis=1), 1e-12) / 127.0  # [K/g, N]
    q = jnp.clip(jnp.round(wf / scale[:, None, :]), -127, 127).astype(jnp.int8).reshape(k, n)
    if w8a8:
        return {"qweight": q.T, "weight_scale": scale[0]}
    return {"qweight": q, "scales": scale.astype(w.dtype)}


def quantize_int4(w: jax.Array, group: int) -> dict[str, jax.Array]:
    """w [K, N] -> {qweight u8[K/2, N], scales [K/g, N], zeros [K/g, N]}: asymmetric round to nearest.

    Each group's range is widened to include 0, so that the integer zero point (as AWQ and GPTQ store it)
    lies in 0..15 and no code is clipped: the error is at most half a step, range / 30. (Without the
    widening a group of only positive weights gets zero point 0 and its large weights saturate at 15.)"""
    k, n = w.shape
    wf = w.astype(jnp.float32).reshape(k // group, group, n)
    lo = jnp.minimum(jnp.min(wf, axis=1), 0.0)  # [K/g, N]
    hi = jnp.maximum(jnp.max(wf, axis=1), 0.0)
    scale = jnp.maximum(hi - lo, 1e-12) / 15.0
    zero = jnp.clip(jnp.round(-lo / scale), 0, 15)
    q = jnp.clip(jnp.round(wf / scale[:, None, :]) + zero[:, None, :], 0, 15).astype(jnp.uint8)
    return {
        "qweight": pack_int4(q.reshape(k, n)),
        "scales": scale.astype(w.dtype),
        "zeros": zero.astype(w.dtype),
    }
