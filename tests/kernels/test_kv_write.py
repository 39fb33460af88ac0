"""write_kv_cache (XLA scatter) and write_kv_cache_pallas against ref_write_kv_cache, bit-exact; into fp8
pages against the bytes numpy's float8 types make of k / k_scale, saturated."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxllm.kernels.kv_write_pallas import row_block
from jaxllm.kernels.kv_write_xla import ref_write_kv_cache
from jaxllm.kernels.ops import write_kv_cache_pallas, write_kv_cache_xla


def _problem(t, hkv, p, ps, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    kp = jnp.asarray(rng.standard_normal((hkv, p, ps, d)), dtype)
    vp = jnp.asarray(rng.standard_normal((hkv, p, ps, d)), dtype)
    k = jnp.asarray(rng.standard_normal((t, hkv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((t, hkv, d)), dtype)
    # Slot 0 is real and must not be clobbered by the masked padding rows.
    slots = np.concatenate([[0], 1 + rng.permutation(p * ps - 1)[: t - 1]]).astype(np.int32)
    slots[-3:] = -1
    return k, v, kp, vp, jnp.asarray(slots)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("ps", [16, 64])
@pytest.mark.parametrize("which", ["pallas", "xla"])
def test_write_matches_reference(dtype, ps, which, interpret):
    k, v, kp, vp, slots = _problem(37, 2, 5, ps, 64, dtype)
    rk, rv = ref_write_kv_cache(k, v, kp, vp, slots)
    kp2, vp2 = jnp.array(kp), jnp.array(vp)  # donated below
    if which == "pallas":
        ok, ov = write_kv_cache_pallas(k, v, kp2, vp2, slots, interpret=interpret)
    else:
        ok, ov = write_kv_cache_xla(k, v, kp2, vp2, slots)
    assert bool((ok == rk).all()) and bool((ov == rv).all())
    # The written rows are really the new ones (the reference could be wrong the same way).
    s = np.asarray(slots)[:-3]
    got = np.asarray(ok, np.float32).reshape(2, -1, 64)[:, s]
    assert np.array_equal(got, np.swapaxes(np.asarray(k, np.float32)[:-3], 0, 1))


@pytest.mark.parametrize("t, block", [(8, 8), (24, 8), (32, 16), (37, 16), (40, 8), (4, 16), (1, 16)])
def test_row_block_divides_t_or_pads(t, block):
    """Rows per program: a power-of-two divisor of T of at least 8 (no padded copy), else 16 with padding."""
    assert row_block(t, 16) == block


@pytest.mark.parametrize("t", [8, 24, 4])
def test_write_without_and_with_padding(t, interpret):
    """T = 8 and 24 run 8-row programs with no padding; T = 4 pads to one 16-row program."""
    k, v, kp, vp, slots = _problem(t, 2, 5, 16, 64, jnp.bfloat16, seed=t)
    rk, rv = ref_write_kv_cache(k, v, kp, vp, slots)
    ok, ov = write_kv_cache_pallas(k, v, jnp.array(kp), jnp.array(vp), slots, interpret=interpret)
    assert bool((ok == rk).all()) and bool((ov == rv).all())


@pytest.mark.parametrize("t", [8, 37])
def test_write_from_a_fused_qkv_array(t, interpret):
    """k and v read in place from one [T, Hq + 2 Hkv, D] array (k_head, v_head): the same cache as writing
    the cut-out k and v."""
    hq, hkv = 6, 2
    k, v, kp, vp, slots = _problem(t, hkv, 5, 16, 64, jnp.bfloat16, seed=3)
    q = jnp.asarray(np.random.default_rng(4).standard_normal((t, hq, 64)), jnp.bfloat16)
    qkv = jnp.concatenate([q, k, v], axis=1)
    rk, rv = ref_write_kv_cache(k, v, kp, vp, slots)
    ok, ov = write_kv_cache_pallas(
        qkv, qkv, jnp.array(kp), jnp.array(vp), slots, k_head=hq, v_head=hq + hkv, interpret=interpret
    )
    assert bool((ok == rk).all()) and bool((ov == rv).all())
    with pytest.raises(ValueError, match="holding the 2 cache heads from head 9"):
        write_kv_cache_pallas(qkv, qkv, kp, vp, slots, k_head=9, v_head=8, interpret=interpret)


FP8 = [(jnp.float8_e4m3fn, ml_dtypes.float8_e4m3fn, 448.0), (jnp.float8_e5m2, ml_dtypes.float8_e5m2, 57344.0)]


def _hand_fp8(x, scale, np_dtype, fmax):
    """What an fp8 cache stores for x, by hand: x / scale, clipped to the format's range, rounded."""
    y = np.clip(np.asarray(x, np.float64) / scale, -fmax, fmax).astype(np.float32)
    return y.astype(np_dtype).view(np.uint8)


@pytest.mark.parametrize("dtype, np_dtype, fmax", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("which", ["pallas", "xla"])
def test_fp8_write_stores_scaled_saturated_bytes(dtype, np_dtype, fmax, which, interpret):
    """Both writes put k / k_scale and v / v_scale into fp8 pages, saturated (a few values exceed the range
    at these scales), the bytes numpy's float8 makes; untouched slots and padding rows stay as they were."""
    k, v, kp, vp, slots = _problem(37, 2, 5, 16, 64, jnp.bfloat16)
    k_scale, v_scale = 2.5 / fmax, 3.0 / fmax  # |k| past 2.5 (|v| past 3) saturates: some do
    kp8 = jnp.asarray(kp, jnp.float32).astype(dtype)
    vp8 = jnp.asarray(vp, jnp.float32).astype(dtype)
    before_k = np.asarray(kp8).view(np.uint8).copy()
    write = (
        functools.partial(write_kv_cache_pallas, interpret=interpret)
        if which == "pallas"
        else write_kv_cache_xla
    )
    ok, ov = write(k, v, jnp.array(kp8), jnp.array(vp8), slots, k_scale, v_scale)
    assert ok.dtype == jnp.dtype(dtype) and ov.dtype == jnp.dtype(dtype)
    s = np.asarray(slots)[:-3]
    got_k = np.asarray(ok).view(np.uint8).reshape(2, -1, 64)
    got_v = np.asarray(ov).view(np.uint8).reshape(2, -1, 64)
    np.testing.assert_array_equal(
        got_k[:, s], np.swapaxes(_hand_fp8(np.asarray(k, np.float32)[:-3], k_scale, np_dtype, fmax), 0, 1)
    )
    np.testing.assert_array_equal(
        got_v[:, s], np.swapaxes(_hand_fp8(np.asarray(v, np.float32)[:-3], v_scale, np_dtype, fmax), 0, 1)
    )
    assert (np.abs(np.asarray(ok, np.float32)) == fmax).any()  # saturation happened, and gave no NaN
    assert np.isfinite(np.asarray(ok, np.float32)).all()
    rest = np.setdiff1d(np.arange(got_k.shape[1]), s)
    np.testing.assert_array_equal(got_k[:, rest], before_k.reshape(2, -1, 64)[:, rest])


@pytest.mark.parametrize("t", [8, 37])
def test_fp8_write_from_a_fused_qkv_array(t, interpret):
    """The Pallas write quantizes k and v read in place from a bf16 q|k|v array, with scales given as f32[]
    arrays (checkpoint scales): the same pages as the XLA write of the cut-out k and v."""
    hq, hkv = 6, 2
    k, v, kp, vp, slots = _problem(t, hkv, 5, 16, 64, jnp.bfloat16, seed=5)
    kp8, vp8 = kp.astype(jnp.float8_e4m3fn), vp.astype(jnp.float8_e4m3fn)
    q = jnp.asarray(np.random.default_rng(6).standard_normal((t, hq, 64)), jnp.bfloat16)
    qkv = jnp.concatenate([q, k, v], axis=1)
    ks, vs = jnp.float32(0.01), jnp.float32(0.004)
    rk, rv = ref_write_kv_cache(k, v, kp8, vp8, slots, ks, vs)
    ok, ov = write_kv_cache_pallas(
        qkv,
        qkv,
        jnp.array(kp8),
        jnp.array(vp8),
        slots,
        ks,
        vs,
        k_head=hq,
        v_head=hq + hkv,
        interpret=interpret,
    )
    np.testing.assert_array_equal(np.asarray(ok).view(np.uint8), np.asarray(rk).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(ov).view(np.uint8), np.asarray(rv).view(np.uint8))
