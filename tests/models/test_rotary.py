"""apply_rotary against the "rotate half" formula written out in numpy, one frequency per pair."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.layers.rotary import apply_rotary


def rotate_half_numpy(x, positions, inv_freq, factor):
    """x [T, H, D] f64; inv_freq [D/2] or [T, D/2]: out[..., i] = x_i cos - x_{i+D/2} sin for i < D/2,
    x_i cos + x_{i-D/2} sin after, angle = position * inv_freq[i mod D/2] (rounded to f32; the rest in
    f64)."""
    d = x.shape[-1]
    inv = np.broadcast_to(inv_freq, (x.shape[0], d // 2))
    out = np.empty_like(x)
    for t in range(x.shape[0]):
        for i in range(d):
            a = np.float32(positions[t]) * np.float32(inv[t, i % (d // 2)])  # the angle in f32, as on device
            c, s = np.cos(a) * factor, np.sin(a) * factor
            partner = x[t, :, i + d // 2] if i < d // 2 else x[t, :, i - d // 2]
            out[t, :, i] = x[t, :, i] * c + (-partner if i < d // 2 else partner) * s
    return out


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_rotate_half(per_token, dtype):
    rng = np.random.default_rng(0)
    t, h, d = 5, 3, 8
    x = rng.standard_normal((t, h, d)).astype(np.float32)
    positions = np.array([0, 1, 7, 300, 4095], np.int32)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, d, 2) / d))
    if per_token:  # dynamic NTK: a frequency row per token
        inv_freq = inv_freq[None, :] * rng.uniform(0.5, 1.0, (t, 1))
    inv_freq = inv_freq.astype(np.float32)
    xd = jnp.asarray(x, dtype)
    out = apply_rotary(xd, jnp.asarray(positions), jnp.asarray(inv_freq), 0.75)
    assert out.dtype == dtype and out.shape == (t, h, d)
    ref = rotate_half_numpy(np.asarray(xd, np.float64), positions, inv_freq, 0.75)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=tol, atol=tol * 4)
