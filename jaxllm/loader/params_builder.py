"""Fill a parameter tree one tensor at a time, checking each against the model's abstract tree.

checkpoint tensor (numpy or device array) -> `ParamsBuilder.put(path, x, transpose)` -> shape check ->
cast to the target dtype -> `jax.device_put` (optionally with a sharding chosen by path) -> stored; the
caller drops its host copy. `finish()` checks nothing is missing and returns the nested params dict.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

# (path "layers_0/attn/q_proj/kernel", ShapeDtypeStruct) -> sharding or None (default device)
ShardingFn = Callable[[str, jax.ShapeDtypeStruct], Any]


class ParamsBuilder:
    def __init__(self, abstract: dict, source: str, sharding_fn: ShardingFn | None = None):
        self.expected = {"/".join(k): v for k, v in traverse_util.flatten_dict(abstract).items()}
        self.source = source
        self.sharding_fn = sharding_fn
        self.loaded: dict[str, jax.Array] = {}

    def put(self, path: str, x: Any, transpose: bool = False, tensor_name: str | None = None) -> None:
        name = tensor_name or path
        if path not in self.expected:
            raise ValueError(
                f"{self.source}: tensor {name!r} maps to {path!r}, which this model does not have"
            )
        want = self.expected[path]
        shape = tuple(x.shape[::-1]) if transpose and x.ndim == 2 else tuple(x.shape)
        if shape != tuple(want.shape):
            got = tuple(x.shape)
            raise ValueError(
                f"{self.source}: tensor {name!r} has shape {got}; the config implies "
                f"{tuple(want.shape[::-1]) if transpose else tuple(want.shape)}"
            )
        if isinstance(x, np.ndarray):
            x = np.ascontiguousarray(x.T if transpose else x).astype(want.dtype, copy=False)
            arr = jax.device_put(x, self.sharding_fn(path, want) if self.sharding_fn else None)
        else:
            arr = jnp.asarray(x).astype(want.dtype)
            if transpose:
                arr = arr.T
            if self.sharding_fn:
                arr = jax.device_put(arr, self.sharding_fn(path, want))
        self.loaded[path] = arr

    def finish(self) -> dict:
        missing = sorted(set(self.expected) - set(self.loaded))
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ValueError(f"{self.source}: missing weights for {', '.join(missing[:5])}{more}")
        return traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in self.loaded.items()})
