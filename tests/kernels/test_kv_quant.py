"""The FP8 KV-cache format (jaxllm/kernels/kv_quant.py) and the reference's reading of it, against hand
computations in numpy (ml_dtypes' float8 types): the round trip's error bound, saturation, the scales, and
ref_ragged_paged_attention on fp8 pages against a softmax written out for one sequence."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxllm.kernels.kv_quant import check_scale, dequantize_kv, fp8_max, is_fp8, quantize_kv
from jaxllm.kernels.metadata import PagedAttentionMetadata
from jaxllm.kernels.reference import ref_ragged_paged_attention

# (jnp dtype, numpy twin, largest finite value, mantissa bits)
FORMATS = [
    (jnp.float8_e4m3fn, ml_dtypes.float8_e4m3fn, 448.0, 3),
    (jnp.float8_e5m2, ml_dtypes.float8_e5m2, 57344.0, 2),
]


@pytest.mark.parametrize("dtype, np_dtype, fmax, mbits", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [1.0, 0.0173, 3.5])
def test_round_trip_error_within_the_format_precision(dtype, np_dtype, fmax, mbits, scale):
    """quantize -> dequantize of values whose quotient x / scale is a normal number of the format errs by
    at most half a unit in the last place: 2^-(mbits + 1) relative (e4m3: 2^-4, inside its 2^-3 epsilon)."""
    rng = np.random.default_rng(0)
    tiny = float(ml_dtypes.finfo(np_dtype).smallest_normal)
    mags = np.exp(rng.uniform(np.log(tiny), np.log(fmax), 4096))
    x = (mags * rng.choice([-1.0, 1.0], mags.size) * scale).astype(np.float32)
    stored = quantize_kv(jnp.asarray(x), scale, dtype)
    assert stored.dtype == jnp.dtype(dtype)
    back = np.asarray(dequantize_kv(stored, scale, jnp.float32))
    rel = np.abs(back - x) / np.abs(x)
    assert rel.max() <= 2.0 ** -(mbits + 1) * (1 + 1e-6)
    assert rel.max() > 2.0 ** -(mbits + 3)  # the bound is near-tight: the values really went through 8 bits
    # The same bits numpy's float8 makes of x / scale (round to nearest even).
    hand = (x.astype(np.float64) / np.float32(scale)).astype(np.float32).astype(np_dtype)
    np.testing.assert_array_equal(np.asarray(stored).view(np.uint8), hand.view(np.uint8))


@pytest.mark.parametrize("dtype, np_dtype, fmax, mbits", FORMATS, ids=["e4m3", "e5m2"])
def test_saturates_to_the_largest_finite_value(dtype, np_dtype, fmax, mbits):
    """Past the format's range the stored value is +-max, never NaN or inf, which a plain cast makes."""
    x = jnp.asarray([fmax * 1.04, fmax * 1.2, 1e9, -1e9, -fmax * 3], jnp.float32)
    assert not np.isfinite(np.asarray(x.astype(dtype), np.float32)).all()  # why quantize_kv clips
    stored = np.asarray(quantize_kv(x, 1.0, dtype), np.float32)
    np.testing.assert_array_equal(stored, [fmax, fmax, fmax, -fmax, -fmax])
    scaled = np.asarray(dequantize_kv(quantize_kv(x * 0.5, 0.5, dtype), 0.5, jnp.float32))
    np.testing.assert_array_equal(scaled, 0.5 * np.asarray([fmax, fmax, fmax, -fmax, -fmax], np.float32))
    assert fp8_max(dtype) == fmax


def test_other_dtypes_are_a_plain_cast():
    x = jnp.asarray([1.5, -1000.0, 3.0e5], jnp.float32)
    assert not is_fp8(jnp.bfloat16) and is_fp8(jnp.float8_e5m2)
    np.testing.assert_array_equal(
        np.asarray(quantize_kv(x, 0.25, jnp.bfloat16), np.float32), [1.5, -1000.0, 299008.0]
    )
    np.testing.assert_array_equal(
        np.asarray(dequantize_kv(x.astype(jnp.bfloat16), 0.25, jnp.float32)), [1.5, -1000.0, 299008.0]
    )


@pytest.mark.parametrize(
    "scale, ok",
    [(1.0, True), (0.02, True), (jnp.float32(0.5), True), (jnp.ones((), jnp.float32), True), (0.0, False),
     (-1.0, False), (float("inf"), False), ("1", False), (jnp.ones((2,), jnp.float32), False),
     (jnp.ones((), jnp.int32), False)],
)  # fmt: skip
def test_scale_checks(scale, ok):
    if ok:
        check_scale("k_scale", scale)
    else:
        with pytest.raises(ValueError, match="k_scale"):
            check_scale("k_scale", scale)


@pytest.mark.parametrize("dtype, np_dtype", [(f[0], f[1]) for f in FORMATS], ids=["e4m3", "e5m2"])
def test_reference_reads_fp8_pages_as_written_out_by_hand(dtype, np_dtype):
    """One sequence of 21 tokens in two permuted pages of 16 (NaN past its end and in a page it does not
    own), a 3-row chunk at its end: ref_ragged_paged_attention equals a causal softmax over the stored
    values times the scales, computed in numpy."""
    rng = np.random.default_rng(3)
    hkv, g, d, ps, kv_len, q_len = 2, 2, 64, 16, 21, 3
    k_scale, v_scale = 0.03, 0.011
    k = rng.standard_normal((hkv, 3, ps, d)).astype(np.float32)
    v = rng.standard_normal((hkv, 3, ps, d)).astype(np.float32)
    pages = [2, 0]  # page 1 is someone else's: NaN
    k[:, 1] = v[:, 1] = np.nan
    k[:, 0, kv_len - ps :] = v[:, 0, kv_len - ps :] = np.nan  # the tail of the last page
    kp = quantize_kv(jnp.asarray(k), k_scale, dtype)
    vp = quantize_kv(jnp.asarray(v), v_scale, dtype)
    q = rng.standard_normal((q_len + 1, hkv * g, d)).astype(np.float32)  # one padding row
    md = PagedAttentionMetadata(
        kv_lens=jnp.asarray([kv_len, 0], jnp.int32),
        block_tables=jnp.asarray([pages, [0, 0]], jnp.int32),
        cu_q_lens=jnp.asarray([0, q_len, q_len], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32),
    )
    out = np.asarray(
        ref_ragged_paged_attention(
            jnp.asarray(q), kp, vp, md, sm_scale=d**-0.5, k_scale=k_scale, v_scale=v_scale
        )
    )
    # By hand: the stored bytes read back with numpy's float8, times the scales; contiguous context.
    kh = (
        np.asarray(kp).astype(np_dtype).astype(np.float64)[:, pages].reshape(hkv, 2 * ps, d)[:, :kv_len]
        * k_scale
    )
    vh = (
        np.asarray(vp).astype(np_dtype).astype(np.float64)[:, pages].reshape(hkv, 2 * ps, d)[:, :kv_len]
        * v_scale
    )
    want = np.zeros((q_len + 1, hkv * g, d))
    for i in range(q_len):
        pos = kv_len - q_len + i
        for h in range(hkv * g):
            s = kh[h // g, : pos + 1] @ q[i, h] * d**-0.5
            p = np.exp(s - s.max())
            want[i, h] = p @ vh[h // g, : pos + 1] / p.sum()
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    # The dequantized values differ from the originals (8 bits), so the scales really entered.
    assert np.abs(kh - k[:, pages].reshape(hkv, 2 * ps, d)[:, :kv_len]).max() > 1e-3
