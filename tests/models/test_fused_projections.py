"""Fused projections: the fused weight's product is the separate parts' products, laid out shard by shard
(checked against a hand-built layout), and the loader names a part a checkpoint lacks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.loader.params_builder import ParamsBuilder
from jaxllm.models.fused_projections import FusedGroup, FusedPart, fuse_columns, split_columns


def qkv(hq: int, hkv: int, d: int, shards: int) -> FusedGroup:
    parts = (
        FusedPart("attn/q_proj", hq, d),
        FusedPart("attn/k_proj", hkv, d),
        FusedPart("attn/v_proj", hkv, d),
    )
    return FusedGroup("attn/qkv_proj", parts, shards)


@pytest.mark.parametrize(("hq", "hkv", "shards"), [(8, 2, 1), (8, 2, 2), (8, 2, 4), (8, 2, 8), (4, 4, 2)])
def test_split_of_fused_product_is_the_parts_products(hq, hkv, shards):
    d, h = 3, 5
    rng = np.random.default_rng(hq * 10 + shards)
    q, k, v = (rng.standard_normal((h, n * d)) for n in (hq, hkv, hkv))
    g = qkv(hq, hkv, d, shards)
    w = np.asarray(fuse_columns(g, [q, k, v]))
    slots = max(hkv, shards)
    assert w.shape == (h, (hq + 2 * slots) * d) == (h, g.width)
    x = rng.standard_normal((2, h))
    got_q, got_k, got_v = (np.asarray(a) for a in split_columns(g, jnp.asarray(x @ w)))
    np.testing.assert_allclose(got_q, x @ q, rtol=1e-6, atol=1e-6)
    # K/V: slot s holds head s // (slots / hkv)
    for got, ref in ((got_k, x @ k), (got_v, x @ v)):
        want = np.repeat(ref.reshape(2, hkv, d), slots // hkv, axis=1).reshape(2, slots * d)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_layout_by_hand_two_shards():
    """2 query heads and 2 KV heads of width 1 over 2 shards: columns q0 k0 v0 | q1 k1 v1."""
    g = qkv(2, 2, 1, 2)
    q, k, v = np.array([[10.0, 11.0]]), np.array([[20.0, 21.0]]), np.array([[30.0, 31.0]])
    np.testing.assert_array_equal(np.asarray(fuse_columns(g, [q, k, v])), [[10, 20, 30, 11, 21, 31]])
    # one KV head over 2 shards: repeated, one slot per shard
    g1 = qkv(2, 1, 1, 2)
    got = np.asarray(fuse_columns(g1, [q, np.array([[20.0]]), np.array([[30.0]])]))
    np.testing.assert_array_equal(got, [[10, 20, 30, 11, 20, 30]])
    # biases (1-D) fuse the same way
    np.testing.assert_array_equal(np.asarray(fuse_columns(g, [q[0], k[0], v[0]])), [10, 20, 30, 11, 21, 31])


def test_uneven_heads_are_refused():
    with pytest.raises(ValueError, match="k_proj has 3 heads"):
        qkv(6, 3, 4, 2)


def test_builder_fuses_parts_and_names_missing_ones():
    g = qkv(2, 1, 2, 1)
    abstract = {
        "layers_0": {"attn": {"qkv_proj": {"kernel": jax.ShapeDtypeStruct((3, g.width), jnp.float32)}}}
    }
    rng = np.random.default_rng(0)
    q, k, v = (
        rng.standard_normal((4, 3)),
        rng.standard_normal((2, 3)),
        rng.standard_normal((2, 3)),
    )  # [out, in]
    b = ParamsBuilder(abstract, "ckpt", fused_groups=(g,))
    b.put("layers_0/attn/q_proj/kernel", q, transpose=True)
    b.put("layers_0/attn/v_proj/kernel", v, transpose=True)
    with pytest.raises(
        ValueError, match=r"layers_0/attn/k_proj/kernel \(parts of layers_0/attn/qkv_proj/kernel\)"
    ):
        b.finish()
    with pytest.raises(ValueError, match=r"tensor 'layers_0/attn/k_proj/kernel' has shape \(3, 3\)"):
        b.put("layers_0/attn/k_proj/kernel", rng.standard_normal((3, 3)), transpose=True)
    b.put("layers_0/attn/k_proj/kernel", k, transpose=True)
    fused = np.asarray(b.finish()["layers_0"]["attn"]["qkv_proj"]["kernel"])
    np.testing.assert_allclose(fused, np.concatenate([q.T, k.T, v.T], axis=1), rtol=1e-6, atol=1e-6)
