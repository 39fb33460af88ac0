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

# root mean square of the random codes: int4 q - 8 uniform in -8..7, int8 uniform in -127..127, fp8 ~ N(0, 1)
CODE_STD = {"uint8": (344 / 16) ** 0.5, "int8": 127 / 3**0.5, "float8_e4m3fn": 1.0, "": 1.0}


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "kind", "codes"))
def _leaf(key: jax.Array, shape: tuple[int, ...], dtype: str, kind: str, codes: str = "") -> jax.Array:
    """One leaf; `codes`: the dtype of the layer's qweight, which the scales are sized for."""
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
    if kind in ("scales", "weight_scale"):  # w = codes * scale ~ 0.02 (codes' spread: CODE_STD)
        return jnp.full(shape, 0.02 / CODE_STD[codes], dtype)
    if kind == "zeros":
        return jnp.full(shape, 8, dtype)
    if kind == "perm":
        return jnp.arange(shape[0], dtype=jnp.int32)
    if kind == "input_scale":  # static W8A8: activations of a few units fit the code range
        return jnp.full(shape, 8.0 / 127 if codes == "int8" else 1.0, dtype)
    return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype)


_KINDS = ("scale", "bias", "qweight", "scales", "weight_scale", "zeros", "perm", "input_scale")


def dummy_params(abstract: dict, seed: int = 0, sharding_fn: ShardingFn | None = None) -> dict:
    flat = traverse_util.flatten_dict(abstract)
    out = {}
    key = jax.random.key(seed)
    for i, (path, s) in enumerate(sorted(flat.items())):
        kind = path[-1] if path[-1] in _KINDS else "weight"
        qweight = flat.get((*path[:-1], "qweight"))
        codes = jnp.dtype(qweight.dtype).name if qweight is not None else ""
        leaf = _leaf(jax.random.fold_in(key, i), tuple(s.shape), jnp.dtype(s.dtype).name, kind, codes)
        if sharding_fn is not None:
            leaf = jax.device_put(leaf, sharding_fn("/".join(path), s))
        out[path] = leaf
    return traverse_util.unflatten_dict(out)
