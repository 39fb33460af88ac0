"""Random weights at a model's real shapes (`load_format="dummy"`), generated on the device leaf by leaf.

Kernels and embeddings ~ N(0, 0.02^2), norm scales = 1, biases = 0: the activations stay finite in any
dtype, and no host copy of the weights ever exists.
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
    return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype)


def dummy_params(abstract: dict, seed: int = 0, sharding_fn: ShardingFn | None = None) -> dict:
    flat = traverse_util.flatten_dict(abstract)
    out = {}
    key = jax.random.key(seed)
    for i, (path, s) in enumerate(sorted(flat.items())):
        kind = path[-1] if path[-1] in ("scale", "bias") else "weight"
        leaf = _leaf(jax.random.fold_in(key, i), tuple(s.shape), jnp.dtype(s.dtype).name, kind)
        if sharding_fn is not None:
            leaf = jax.device_put(leaf, sharding_fn("/".join(path), s))
        out[path] = leaf
    return traverse_util.unflatten_dict(out)
