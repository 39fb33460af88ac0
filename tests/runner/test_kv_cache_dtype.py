"""runner/kv_cache.py with FP8 pages: vLLM's --kv-cache-dtype names map to page dtypes, sizes count one
byte per element (twice bfloat16's blocks in one budget, on a device as on the host), and swapping blocks
out to host memory and back keeps their values (NaN included)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import KV_CACHE_DTYPES
from jaxllm.runner import kv_cache as kvc


@pytest.mark.parametrize(
    "name, model_dtype, want",
    [
        ("auto", jnp.bfloat16, jnp.bfloat16),
        ("auto", jnp.float32, jnp.float32),
        ("float16", jnp.bfloat16, jnp.float16),
        ("fp8", jnp.bfloat16, jnp.float8_e4m3fn),
        ("fp8_e4m3", jnp.float32, jnp.float8_e4m3fn),
        ("fp8_e5m2", jnp.bfloat16, jnp.float8_e5m2),
    ],
)
def test_page_dtype_of_each_setting(name, model_dtype, want):
    assert kvc.kv_page_dtype(name, jnp.dtype(model_dtype)) == jnp.dtype(want)


def test_every_setting_has_a_page_dtype():
    for name in KV_CACHE_DTYPES:
        assert kvc.kv_page_dtype(name, jnp.dtype(jnp.bfloat16)).itemsize in (1, 2, 4)


GEO = kvc.KVGeometry(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=jnp.dtype(jnp.bfloat16))


def test_an_fp8_block_takes_half_the_bytes_of_bfloat16():
    fp8 = dataclasses.replace(GEO, dtype=jnp.dtype(jnp.float8_e4m3fn))
    assert GEO.bytes_per_block == 2 * 30 * 3 * 16 * 64 * 2  # K and V, per layer, per head, per token
    assert fp8.bytes_per_block == GEO.bytes_per_block // 2
    assert dataclasses.replace(GEO, dtype=jnp.dtype(jnp.float8_e5m2)).bytes_per_block == fp8.bytes_per_block


@pytest.mark.parametrize("shards", [1, 2])
def test_twice_the_blocks_of_bfloat16_in_device_memory(monkeypatch, shards):
    """On a device (memory stats present) the blocks that fit what the weights and the step leave double
    for fp8 pages: the same budget divided by half the bytes."""
    limit, in_use, temp = 80 << 30, 17 << 30, 3 << 30
    monkeypatch.setattr(kvc, "device_memory_budget", lambda util: (limit, in_use))
    free = limit - in_use - temp - kvc._SAFETY_BYTES - int(0.02 * limit)
    fp8 = dataclasses.replace(GEO, dtype=jnp.dtype(jnp.float8_e4m3fn))
    n16, _ = kvc.num_blocks_for_memory(GEO, 0.9, temp, 10**9, shards)
    n8, _ = kvc.num_blocks_for_memory(fp8, 0.9, temp, 10**9, shards)
    assert n16 == free // (GEO.bytes_per_block // shards)
    assert n8 == free // (fp8.bytes_per_block // shards)
    assert 2 * n16 <= n8 <= 2 * n16 + 1


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_swap_out_and_in_keeps_fp8_values(dtype):
    geo = kvc.KVGeometry(num_layers=2, num_kv_heads=2, head_dim=64, block_size=4, dtype=jnp.dtype(dtype))
    rng = np.random.default_rng(0)
    caches = []
    for _ in range(geo.num_layers):
        k, v = (rng.standard_normal(geo.layer_shape(6)).astype(np.float32) * 30 for _ in range(2))
        k[0, 1, 2, 3] = np.nan  # garbage is copied as it is
        caches.append((jnp.asarray(k).astype(dtype), jnp.asarray(v).astype(dtype)))
    # Compared as values (NaN equal to NaN): e5m2 has several NaN encodings, and copies may keep any one.
    before = [(np.asarray(k, np.float32), np.asarray(v, np.float32)) for k, v in caches]
    swap = kvc.HostSwapSpace(geo, 4)
    swap.swap_out(caches, [(1, 2), (4, 0)])  # (device block, host block)
    zeroed = [(k.at[:, 1].set(0).at[:, 4].set(0), v.at[:, 1].set(0).at[:, 4].set(0)) for k, v in caches]
    back = swap.swap_in(zeroed, [(5, 2), (0, 0)])  # into other device blocks
    for (k, v), (bk, bv) in zip(back, before, strict=True):
        assert k.dtype == jnp.dtype(dtype)
        got_k, got_v = np.asarray(k, np.float32), np.asarray(v, np.float32)
        np.testing.assert_array_equal(got_k[:, 5], bk[:, 1])
        np.testing.assert_array_equal(got_k[:, 0], bk[:, 4])
        np.testing.assert_array_equal(got_v[:, 5], bv[:, 1])
        np.testing.assert_array_equal(got_v[:, 0], bv[:, 4])
        np.testing.assert_array_equal(got_k[:, 2:4], bk[:, 2:4])  # untouched blocks stay
