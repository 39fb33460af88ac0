"""FP8 KV-cache pages: how K/V are stored in 8 bits and read back (vLLM's `--kv-cache-dtype fp8`).

A cache whose pages are float8 (e4m3fn or e5m2) holds every K (and V) element as

    stored = saturate(k / k_scale) cast to the page dtype        (the KV write: kv_write_*.py)
    read   = stored cast to the compute dtype * k_scale          (attention: reference.py, kernels)

with one float32 scale per layer for K and one for V (per tensor, vLLM's `k_scale` / `v_scale`, 1.0 when
the checkpoint has none). `saturate` clips to the format's largest finite value (e4m3fn: 448, e5m2:
57344) before the cast: XLA's plain float -> float8 conversion turns anything past that into NaN
(e4m3fn has no infinity) or inf (e5m2), and one NaN key would poison every score of the row that reads
it. Pages of any other dtype hold the values themselves: the scales are ignored there, as in vLLM.

A scale is a Python float or an f32[] array (checkpoint scales are arrays in the params); the ops take
them as `k_scale`, `v_scale`. The kernels read them as one f32[2] array (`scales_array`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def is_fp8(dtype) -> bool:
    """Whether pages of this dtype hold scaled 8-bit floats (the dtypes of FP8_DTYPES)."""
    return jnp.dtype(dtype) in FP8_DTYPES


def fp8_max(dtype) -> float:
    """The format's largest finite value: 448 for e4m3fn, 57344 for e5m2."""
    return float(jnp.finfo(dtype).max)


def quantize_kv(x, scale, dtype):
    """x (any float dtype) as stored in pages of `dtype`: divided by `scale`, saturated, cast (fp8);
    for other page dtypes a plain cast. Plain jnp: the XLA write and the Pallas write kernel share it."""
    if not is_fp8(dtype):
        return x.astype(dtype)
    m = fp8_max(dtype)
    y = x.astype(jnp.float32) / scale
    # min/max rather than jnp.clip: both lower in the Pallas Triton kernel as well as in XLA.
    return jnp.minimum(jnp.maximum(y, -m), m).astype(dtype)


def dequantize_kv(pages, scale, dtype):
    """Stored pages as values of `dtype`: upcast and multiplied by `scale` (fp8); else a plain cast."""
    if not is_fp8(pages.dtype):
        return pages.astype(dtype)
    return (pages.astype(jnp.float32) * scale).astype(dtype)


def check_scale(name: str, scale) -> None:
    """A scale is a positive finite Python float or a float scalar array, f32[] as a rule (its value may
    be known only on the device, so only its shape and dtype are checked)."""
    if hasattr(scale, "dtype"):
        if scale.shape != () or not jnp.issubdtype(scale.dtype, jnp.floating):
            raise ValueError(
                f"{name} must be a float or an f32[] array, got {scale.dtype}{list(scale.shape)}"
            )
        return
    if not isinstance(scale, (int, float)) or not 0 < float(scale) < float("inf"):
        raise ValueError(f"{name}={scale!r} must be a positive finite float or an f32[] array")


def scales_array(k_scale, v_scale) -> jax.Array:
    """f32[2] (k_scale, v_scale): what the Pallas kernels read the scales from."""
    check_scale("k_scale", k_scale)
    check_scale("v_scale", v_scale)
    return jnp.stack([jnp.asarray(k_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32)])
