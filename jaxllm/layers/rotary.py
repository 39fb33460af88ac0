"""Rotary position embedding (RoPE) with the Hugging Face scaling variants.

Host side: `rope_inv_freq(head_dim, theta, scaling, max_pos)` -> (f32[D/2] inverse frequencies,
attention factor) for rope_type default / linear / llama3 / yarn (numpy, computed once per model).
Device side: `apply_rotary(x, positions, inv_freq, attention_factor)` rotates [T, H, D] in float32 with
the "rotate half" layout HF checkpoints use. Dynamic NTK scales the base per sequence from its context
length (`dynamic_ntk_inv_freq`), matching HF, which recomputes frequencies from the longest position seen.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _base_inv_freq(dim: int, theta: float) -> np.ndarray:
    return 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any], max_position_embeddings: int
) -> tuple[np.ndarray, float]:
    """(f32[D/2] inverse frequencies, cos/sin multiplier). Dynamic NTK returns the unscaled base here."""
    dim = int(head_dim * scaling.get("partial_rotary_factor", 1.0))
    rope_type = scaling.get("rope_type", "default")
    inv_freq = _base_inv_freq(dim, theta)
    if rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    if rope_type == "longrope":
        short, _, attn = longrope_inv_freq(dim, theta, scaling, max_position_embeddings)
        return short, attn
    factor = float(scaling["factor"]) if scaling.get("factor") is not None else None
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        low_ff, high_ff = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wl, high_wl = old_len / low_ff, old_len / high_ff
        wavelen = 2 * math.pi / inv_freq
        out = np.where(wavelen > low_wl, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return np.where(medium, smoothed, out).astype(np.float32), 1.0
    if rope_type == "yarn":
        orig = scaling["original_max_position_embeddings"]
        if factor is None:
            factor = max_position_embeddings / orig

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attn = scaling.get("attention_factor")
        if attn is None:
            m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            attn = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
        beta_fast = scaling.get("beta_fast") or 32
        beta_slow = scaling.get("beta_slow") or 1

        def corr_dim(rot: float) -> float:
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

        low, high = corr_dim(beta_fast), corr_dim(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extrap = 1 - ramp
        pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
        return inv.astype(np.float32), float(attn)
    raise ValueError(f"rope_type={rope_type!r} is not supported")


def longrope_inv_freq(
    dim: int, theta: float, scaling: dict[str, Any], max_position_embeddings: int
) -> tuple[np.ndarray, np.ndarray, float]:
    """LongRoPE (Phi-3): (f32[D/2] short, f32[D/2] long inverse frequencies, cos/sin multiplier). A sequence
    uses the long ones once its context passes original_max_position_embeddings, the short ones before
    (as HF chooses per forward pass from the longest position); the multiplier applies to both."""
    orig = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or max_position_embeddings / orig
    attn = scaling.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    base = theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    short, long = (np.asarray(scaling[k], np.float32) for k in ("short_factor", "long_factor"))
    if short.shape != base.shape or long.shape != base.shape:
        raise ValueError(
            f"rope_scaling short_factor/long_factor have {short.size}/{long.size} entries; head_dim {dim} needs {base.size}"
        )
    return (1.0 / (short * base)).astype(np.float32), (1.0 / (long * base)).astype(np.float32), float(attn)


def longrope_token_inv_freq(
    seq_lens: jax.Array,  # i32[T] context length of each token's sequence
    short: np.ndarray,  # f32[D/2]
    long: np.ndarray,  # f32[D/2]
    original_max_position_embeddings: int,
) -> jax.Array:  # f32[T, D/2]
    use_long = (seq_lens > original_max_position_embeddings)[:, None]
    return jnp.where(use_long, jnp.asarray(long)[None, :], jnp.asarray(short)[None, :])


def dynamic_ntk_inv_freq(
    seq_lens: jax.Array,  # i32[T] context length of each token's sequence
    head_dim: int,
    theta: float,
    factor: float,
    max_position_embeddings: int,
) -> jax.Array:  # f32[T, D/2]
    dim = head_dim
    seq = jnp.maximum(seq_lens, max_position_embeddings).astype(jnp.float32)
    base = theta * ((factor * seq / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    exps = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    return 1.0 / (base[:, None] ** exps[None, :])


def apply_rotary(
    x: jax.Array,  # [T, H, D]
    positions: jax.Array,  # i32[T]
    inv_freq: jax.Array,  # f32[D/2] or f32[T, D/2]
    attention_factor: float = 1.0,
    rotated: tuple[int, int] | None = None,
) -> jax.Array:  # [T, H, D], x.dtype
    """The "rotate half" rotation: with x = [x1, x2] (halves of D), out = [x1 cos - x2 sin, x2 cos + x1 sin].

    Written without concatenation: the halves are a size-2 axis, and [-x2, x1] is that axis reversed
    times a sign, so the whole rotation is elementwise work on x that XLA fuses into one loop with its
    neighbours (the cast, the attention kernel's layout padding) instead of two separate concatenate
    kernels per layer, whose launches alone are a visible share of a small decode step.

    rotated=(period, count): only heads whose index modulo `period` is below `count` rotate; the others
    pass through unchanged (exactly: cos 1, sin 0). That rotates the q and k heads of a fused q|k|v
    array [T, Hq + 2 S, D] in one elementwise pass: laid out shard by shard for N devices
    (models/fused_projections.py), each run of period = (Hq + 2 S) / N heads is one shard's q|k|v, and
    its first count = (Hq + S) / N heads rotate.

    inv_freq narrower than D / 2 (partial_rotary_factor < 1, Phi-4-mini): only the first 2 * len(inv_freq)
    dims of each head rotate, in the same "rotate half" layout; the others pass through."""
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
    if inv_freq.ndim == 1:
        inv_freq = inv_freq[None, :]
    t, h, d = x.shape
    rd = 2 * inv_freq.shape[-1]
    if rd < d:  # partial rotary (partial_rotary_factor): the first rd dims rotate, the rest pass through
        head = apply_rotary(x[..., :rd], positions, inv_freq, attention_factor, rotated)
        return jnp.concatenate([head, x[..., rd:]], axis=-1)
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq  # [T, D/2]
    cos = (jnp.cos(freqs) * attention_factor)[:, None, None, :]  # [T, 1, 1, D/2]
    sin = (jnp.sin(freqs) * attention_factor)[:, None, None, :]
    # [2, 1]: [-1, 1], the first half takes -x2 sin (from an iota: an array constant would be hoisted out
    # of the layer's shared trace, models/layer_trace.py)
    sign = 2.0 * jax.lax.broadcasted_iota(jnp.float32, (2, 1), 0) - 1.0
    xf = x.astype(jnp.float32).reshape(t, h, 2, d // 2)
    sin = sign * sin
    if rotated is not None:
        period, count = rotated
        rot = jax.lax.broadcasted_iota(jnp.int32, (1, h, 1, 1), 1) % period < count  # [1, H, 1, 1]
        cos, sin = jnp.where(rot, cos, 1.0), jnp.where(rot, sin, 0.0)
    out = xf * cos + xf[:, :, ::-1, :] * sin
    return out.reshape(t, h, d).astype(x.dtype)
