"""Random weights at a model's real shapes (`load_format="dummy"`), generated on the device leaf by leaf.

Kernels and embeddings ~ N(0, 0.02^2), norm scales = 1, biases = 0: the activations stay finite in any
dtype, and no host copy of the weights ever exists. A quantized layer's leaves (jaxllm/quantization/
scheme.py) get the same spread: random codes with scales that make w ~ 0.02 in magnitude, zero points
in the middle of the int4 range, and the identity permutation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import traverse_util

from jaxllm.loader.params_builder import ShardingFn


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "kind"))
def _leaf(key: jax.Array, shape: tuple[int, ...], dtype: str, kind: str) -> jax.Array:
    if kind == "scale":
        return jnp.ones(shape, dtype)
    if kind == "bias":
        return jnp.zeros(shape, dtype)
    if kind == "qweight":
        if dtype == "uint8":  # two int4 codes per byte
            return jax.random.randint(key, shape, 0, 256, jnp.int32).astype(jnp.uint8)
        if dtype == "int8":
            return jax.random.randint(key, shape, -127, 128, jnp.int32).astype(jnp.int8)
        return jax.random.normal(key, shape, jnp.float32).astype(dtype)  # fp8 codes ~ N(0, 1)
    if kind in ("scales", "weight_scale"):  # int4 codes span 16, int8 codes 254, fp8 codes ~1
        return jnp.full(shape, 0.02 / 4, dtype)
    if kind == "zeros":
        return jnp.full(shape, 8, dtype)
    if kind == "perm":
        return jnp.arange(shape[0], dtype=jnp.int32)
    if kind == "input_scale":
        return jnp.ones(shape, dtype)
    return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype)


_KINDS = ("scale", "bias", "qweight", "scales", "weight_scale", "zeros", "perm", "input_scale")


def dummy_params(abstract: dict, seed: int = 0, sharding_fn: ShardingFn | None = None) -> dict:
    flat = traverse_util.flatten_dict(abstract)
    out = {}
    key = jax.random.key(seed)
    for i, (path, s) in enumerate(sorted(flat.items())):
        kind = path[-1] if path[-1] in _KINDS else "weight"
        leaf = _leaf(jax.random.fold_in(key, i), tuple(s.shape), jnp.dtype(s.dtype).name, kind)
        if sharding_fn is not None:
            leaf = jax.device_put(leaf, sharding_fn("/".join(path), s))
        out[path] = leaf
    return traverse_util.unflatten_dict(out)
